// Row-major GEMM for the CPU backend: C = alpha * op(A) * op(B) + beta * C, op(A) is M×K.
// OpenBLAS when the build found it (UNETCU_HAVE_OPENBLAS); otherwise a plain loop GEMM, so
// the engine still builds and is checked where no BLAS is installed (the GPU machine), at
// reference speed. With beta = 0, C is overwritten without being read (it may hold NaN).
#pragma once
#include <cstdint>
#include <vector>

#ifdef UNETCU_HAVE_OPENBLAS
#include <cblas.h>
#endif

namespace unetcu::kernels::cpu {

#ifdef UNETCU_HAVE_OPENBLAS
inline void gemm(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A,
                 int lda, const float* B, int ldb, float beta, float* C, int ldc) {
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

inline void gemm(bool trans_a, bool trans_b, int M, int N, int K, double alpha, const double* A,
                 int lda, const double* B, int ldb, double beta, double* C, int ldc) {
  cblas_dgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}
#else
template <class T>
void gemm(bool trans_a, bool trans_b, int M, int N, int K, T alpha, const T* A, int lda,
          const T* B, int ldb, T beta, T* C, int ldc) {
  // op(B) as a contiguous K×N matrix, so the inner loop runs along rows of B and C.
  std::vector<T> bt;
  const T* b = B;
  int ldbb = ldb;
  if (trans_b) {
    bt.resize(size_t(K) * N);
    for (int k = 0; k < K; ++k)
      for (int j = 0; j < N; ++j) bt[size_t(k) * N + j] = B[size_t(j) * ldb + k];
    b = bt.data();
    ldbb = N;
  }
#pragma omp parallel for schedule(static) if (int64_t(M) * N * K > (1 << 20))
  for (int i = 0; i < M; ++i) {
    T* c = C + size_t(i) * ldc;
    if (beta == T(0))
      for (int j = 0; j < N; ++j) c[j] = T(0);
    else if (beta != T(1))
      for (int j = 0; j < N; ++j) c[j] *= beta;
    for (int k = 0; k < K; ++k) {
      const T a = alpha * (trans_a ? A[size_t(k) * lda + i] : A[size_t(i) * lda + k]);
      const T* brow = b + size_t(k) * ldbb;
      for (int j = 0; j < N; ++j) c[j] += a * brow[j];
    }
  }
}
#endif

}  // namespace unetcu::kernels::cpu
