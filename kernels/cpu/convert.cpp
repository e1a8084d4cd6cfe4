// CPU launcher of convert: dtype and memory-format changes (bodies/convert.h).
//
// A format change is, per image, the transpose of a C x P matrix (P = H*W pixels): NCHW
// holds it [C][P], NHWC [P][C]. It runs in square tiles, so both the reads and the writes of a
// tile stay within a few dozen cache lines (a weight cast to channels-last, OIHW -> OHWI, is
// such a transpose per output channel: every convolution of a bfloat16 NHWC step makes one).
// Whether the destination is accumulated into is decided once per call, outside the loops.
#include "bodies/convert.h"

#include <algorithm>

#include "bodies/layout.h"
#include "kernels/launchers.h"
#include "kernels/cpu/parallel.h"

namespace unetcu::kernels::cpu {
namespace {

constexpr int64_t kTile = 32;

template <bool Acc, class S, class D>
void convert_same_format(const S* s, D* d, int64_t n) {
  parallel_for(n, [&](int64_t i) { convert_one(s + i, d + i, Acc); });
}

// dst = src transposed per image: to_nhwc, src [N][C][P] -> dst [N][P][C]; else the reverse.
template <bool Acc, class S, class D>
void convert_transposed(const S* s, D* d, int64_t N, int64_t C, int64_t P, bool to_nhwc) {
  const int64_t tiles_c = (C + kTile - 1) / kTile, tiles_p = (P + kTile - 1) / kTile;
  const int64_t per_image = tiles_c * tiles_p;
  parallel_for(
      N * per_image,
      [&](int64_t item) {
        const int64_t n = item / per_image, t = item - n * per_image;
        const int64_t c0 = (t / tiles_p) * kTile, p0 = (t % tiles_p) * kTile;
        const int64_t c1 = std::min(C, c0 + kTile), p1 = std::min(P, p0 + kTile);
        const S* si = s + n * C * P;
        D* di = d + n * C * P;
        if (to_nhwc) {  // write along c (contiguous in dst), read down the tile's columns
          for (int64_t p = p0; p < p1; ++p)
            for (int64_t c = c0; c < c1; ++c) convert_one(si + c * P + p, di + p * C + c, Acc);
        } else {
          for (int64_t c = c0; c < c1; ++c)
            for (int64_t p = p0; p < p1; ++p) convert_one(si + p * C + c, di + c * P + p, Acc);
        }
      },
      32);
}

template <bool Acc, class S, class D>
void convert_typed(const TensorRef& src, const TensorRef& dst) {
  const S* s = src.data<S>();
  D* d = dst.data<D>();
  if (src.format() == dst.format()) return convert_same_format<Acc>(s, d, src.numel());
  const Dims4 dd = dst.dims4();
  convert_transposed<Acc>(s, d, dd.N, dd.C, dd.H * dd.W, dd.nhwc);
}

}  // namespace

void convert(const TensorRef& src, const TensorRef& dst, double beta) {
  UNETCU_DISPATCH_STORAGE(src.dtype(), S, {
    UNETCU_DISPATCH_STORAGE(dst.dtype(), D, {
      if (beta != 0)
        convert_typed<true, S, D>(src, dst);
      else
        convert_typed<false, S, D>(src, dst);
    });
  });
}

}  // namespace unetcu::kernels::cpu
