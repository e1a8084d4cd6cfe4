// CUDA nearest ×2 upsampling (kernels/bodies/resample.h), channel concatenation, and the two
// fused (upsample into the concat buffer).
#include "kernels/cuda/common.cuh"
#include "kernels/bodies/elementwise.h"
#include "kernels/launchers.h"
#include "kernels/bodies/resample.h"

namespace unetcu::kernels::cuda {
namespace {

// y [planes, 2H, 2W] from x [planes, H, W].
__global__ void upsample_forward_kernel(const float* x, float* y, int64_t H, int64_t W, int64_t n) {
  GRID_STRIDE(i, n) {
    const int64_t OW = 2 * W, ow = i % OW, oh = (i / OW) % (2 * H), plane = i / (OW * 2 * H);
    y[i] = x[plane * H * W + upsample2x_source(oh, ow, W)];
  }
}

__global__ void upsample_backward_kernel(const float* gy, float* gx, float beta, int64_t H,
                                         int64_t W, int64_t n) {
  GRID_STRIDE(i, n) {
    const int64_t w = i % W, h = (i / W) % H, plane = i / (W * H), OW = 2 * W;
    const float* g = gy + (plane * 2 * H + 2 * h) * OW + 2 * w;
    store(gx + i, g[0] + g[1] + g[OW] + g[OW + 1], beta);
  }
}

// x [N, Cx, HW] -> channels [off, off + Cx) of y [N, Cy, HW] (and back, with beta).
__global__ void concat_forward_kernel(const float* x, float* y, int64_t Cx, int64_t Cy,
                                      int64_t off, int64_t HW, int64_t n) {
  GRID_STRIDE(i, n) {
    const int64_t q = i % (Cx * HW), s = i / (Cx * HW);
    y[(s * Cy + off) * HW + q] = x[i];
  }
}
__global__ void concat_backward_kernel(const float* gy, float* gx, float beta, int64_t Cx,
                                       int64_t Cy, int64_t off, int64_t HW, int64_t n) {
  GRID_STRIDE(i, n) {
    const int64_t q = i % (Cx * HW), s = i / (Cx * HW);
    store(gx + i, gy[(s * Cy + off) * HW + q], beta);
  }
}

// Fused upsample-into-concat. Grid: y over the planes n * C + c of y, x over rows, threads
// along a row (grid-stride on all three); the plane's source is worked out once per plane.
// Forward: y [N, Cx + Cs, 2H, 2W] from x [N, Cx, H, W] and skip [N, Cs, 2H, 2W].
__global__ void upsample_concat_forward_kernel(const float* x, const float* skip, float* y,
                                               int64_t Cx, int64_t Cs, int64_t H, int64_t W,
                                               int64_t planes) {
  const int64_t C = Cx + Cs, OH = 2 * H, OW = 2 * W;
  for (int64_t plane = blockIdx.y; plane < planes; plane += gridDim.y) {
    const int64_t n = plane / C, c = plane - n * C;
    int64_t src;
    const bool upsampled = upsample2x_concat_plane(n, c, Cx, Cs, &src);
    for (int64_t oh = blockIdx.x; oh < OH; oh += gridDim.x) {
      float* y_row = y + (plane * OH + oh) * OW;
      if (upsampled) {
        const float* x_row = x + (src * H + (oh >> 1)) * W;
        for (int64_t ow = threadIdx.x; ow < OW; ow += blockDim.x)
          y_row[ow] = upsample2x_row_at(x_row, ow);
      } else {
        const float* s_row = skip + (src * OH + oh) * OW;
        for (int64_t ow = threadIdx.x; ow < OW; ow += blockDim.x) y_row[ow] = s_row[ow];
      }
    }
  }
}

// Backward: an upsampled plane's block x row h writes grad_x row h from grad_y rows 2h, 2h + 1
// (H rows); a skip plane's block x row r copies grad_y row r (2H rows). A null gradient is
// absent: its planes do nothing.
__global__ void upsample_concat_backward_kernel(const float* gy, float* gx, float beta_x,
                                                float* gs, float beta_skip, int64_t Cx,
                                                int64_t Cs, int64_t H, int64_t W,
                                                int64_t planes) {
  const int64_t C = Cx + Cs, OH = 2 * H, OW = 2 * W;
  for (int64_t plane = blockIdx.y; plane < planes; plane += gridDim.y) {
    const int64_t n = plane / C, c = plane - n * C;
    int64_t dst;
    const float* g_plane = gy + plane * OH * OW;
    if (upsample2x_concat_plane(n, c, Cx, Cs, &dst)) {
      if (!gx) continue;
      for (int64_t h = blockIdx.x; h < H; h += gridDim.x) {
        const float* g_top = g_plane + 2 * h * OW;
        float* gx_row = gx + (dst * H + h) * W;
        for (int64_t w = threadIdx.x; w < W; w += blockDim.x)
          store(gx_row + w, upsample2x_grad_at(g_top, g_top + OW, w), beta_x);
      }
    } else {
      if (!gs) continue;
      for (int64_t r = blockIdx.x; r < OH; r += gridDim.x) {
        const float* g_row = g_plane + r * OW;
        float* gs_row = gs + (dst * OH + r) * OW;
        for (int64_t q = threadIdx.x; q < OW; q += blockDim.x) store(gs_row + q, g_row[q], beta_skip);
      }
    }
  }
}

// Threads along one row: a multiple of the warp size, no more than the row needs (up to 256).
int row_threads(int64_t row) { return int(std::clamp<int64_t>((row + 31) / 32 * 32, 32, kThreads)); }
// Blocks along one axis of the grid, capped where the grid-stride loops take over.
unsigned grid_dim(int64_t n) { return unsigned(std::clamp<int64_t>(n, 1, 65535)); }

}  // namespace

void upsample2x_forward(const TensorRef& x, const TensorRef& y) {
  const int64_t n = y.numel();
  Launch l(x);
  upsample_forward_kernel<<<blocks_for(n), kThreads, 0, l.stream>>>(fdata(x), fdata(y), x.dim(2),
                                                                    x.dim(3), n);
  CUDA_CHECK_LAUNCH(l.stream, "upsample2x_forward");
}

void upsample2x_backward(const TensorRef& grad_y, const TensorRef& grad_x, double beta) {
  const int64_t n = grad_x.numel();
  Launch l(grad_x);
  upsample_backward_kernel<<<blocks_for(n), kThreads, 0, l.stream>>>(
      fdata(grad_y), fdata(grad_x), float(beta), grad_x.dim(2), grad_x.dim(3), n);
  CUDA_CHECK_LAUNCH(l.stream, "upsample2x_backward");
}

void concat_forward_part(const TensorRef& x, const TensorRef& y, int64_t channel_offset) {
  const int64_t n = x.numel();
  Launch l(x);
  concat_forward_kernel<<<blocks_for(n), kThreads, 0, l.stream>>>(
      fdata(x), fdata(y), x.dim(1), y.dim(1), channel_offset, x.dim(2) * x.dim(3), n);
  CUDA_CHECK_LAUNCH(l.stream, "concat_forward_part");
}

void concat_backward_part(const TensorRef& grad_y, const TensorRef& grad_x, int64_t channel_offset,
                          double beta) {
  const int64_t n = grad_x.numel();
  Launch l(grad_x);
  concat_backward_kernel<<<blocks_for(n), kThreads, 0, l.stream>>>(
      fdata(grad_y), fdata(grad_x), float(beta), grad_x.dim(1), grad_y.dim(1), channel_offset,
      grad_x.dim(2) * grad_x.dim(3), n);
  CUDA_CHECK_LAUNCH(l.stream, "concat_backward_part");
}

void upsample2x_concat_forward(const TensorRef& x, const TensorRef& skip, const TensorRef& y) {
  const int64_t planes = y.dim(0) * y.dim(1), OH = y.dim(2), OW = y.dim(3);
  if (y.numel() == 0) return;
  Launch l(y);
  const dim3 grid(grid_dim(OH), grid_dim(planes));
  upsample_concat_forward_kernel<<<grid, row_threads(OW), 0, l.stream>>>(
      fdata(x), fdata(skip), fdata(y), x.dim(1), skip.dim(1), x.dim(2), x.dim(3), planes);
  CUDA_CHECK_LAUNCH(l.stream, "upsample2x_concat_forward");
}

void upsample2x_concat_backward(const TensorRef& grad_y, const TensorRef& grad_x, double beta_x,
                                const TensorRef& grad_skip, double beta_skip,
                                int64_t x_channels) {
  const int64_t planes = grad_y.dim(0) * grad_y.dim(1), OH = grad_y.dim(2), OW = grad_y.dim(3);
  if (grad_y.numel() == 0) return;
  Launch l(grad_y);
  const dim3 grid(grid_dim(OH), grid_dim(planes));
  upsample_concat_backward_kernel<<<grid, row_threads(OW), 0, l.stream>>>(
      fdata(grad_y), grad_x.defined() ? fdata(grad_x) : nullptr, float(beta_x),
      grad_skip.defined() ? fdata(grad_skip) : nullptr, float(beta_skip), x_channels,
      grad_y.dim(1) - x_channels, OH / 2, OW / 2, planes);
  CUDA_CHECK_LAUNCH(l.stream, "upsample2x_concat_backward");
}

}  // namespace unetcu::kernels::cuda
