// CPU launcher of convert: dtype and memory-format changes (kernels/bodies/convert.h).
#include "kernels/bodies/convert.h"

#include "kernels/bodies/layout.h"
#include "kernels/launchers.h"
#include "kernels/cpu/parallel.h"

namespace unetcu::kernels::cpu {

void convert(const TensorRef& src, const TensorRef& dst, double beta) {
  const bool acc = beta != 0;
  const int64_t n = src.numel();
  UNETCU_DISPATCH_STORAGE(src.dtype(), S, {
    UNETCU_DISPATCH_STORAGE(dst.dtype(), D, {
      const S* s = src.data<S>();
      D* d = dst.data<D>();
      if (src.format() == dst.format()) {
        parallel_for(n, [&](int64_t i) { convert_one(s + i, d + i, acc); });
      } else {
        // One destination row (a row of W for NCHW, of W x C for NHWC) per iteration.
        const Dims4 ds = src.dims4(), dd = dst.dims4();
        parallel_for(
            dd.N * dd.H,
            [&](int64_t nh) {
              const int64_t nn = nh / dd.H, h = nh % dd.H;
              for (int64_t c = 0; c < dd.C; ++c)
                for (int64_t w = 0; w < dd.W; ++w)
                  convert_one(s + offset_of(ds, nn, c, h, w), d + offset_of(dd, nn, c, h, w), acc);
            },
            1);
      }
    });
  });
}

}  // namespace unetcu::kernels::cpu
