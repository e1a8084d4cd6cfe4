// The CPU's vector instruction sets and the GEMM kernels that match them. Debian's OpenBLAS
// (DYNAMIC_ARCH) picks its kernels by the CPU's model number and falls back to generic SSE3
// ("Prescott") kernels on models it does not know, several times slower on a CPU with AVX-512.
// select_gemm_kernels() compares its pick with what the CPU can do (CPUID feature bits, not
// the model) and, when OpenBLAS chose lower, runs the program again with OPENBLAS_CORETYPE set
// to the matching kernels (OpenBLAS reads it once, when it loads, before main()).
//
// Environment: UNETCU_GEMM_CORE=<OpenBLAS core name> forces those kernels;
// UNETCU_GEMM_CORE=keep keeps OpenBLAS's own pick. GOMP_SPINCOUNT / OMP_WAIT_POLICY, when set,
// replace the engine's OpenMP wait default (1,000 spins, for machines shared with other work).
#pragma once
#include <string>

namespace unetcu::kernels::cpu {

struct CpuIsa {
  int level = 0;          // 0 SSE, 1 AVX, 2 AVX2 + FMA, 3 AVX-512 (F, BW, VL, DQ, CD)
  bool avx512_bf16 = false;
  std::string name() const;  // "AVX-512 (bf16)", "AVX2", ...
};
CpuIsa cpu_isa();

// The level of an OpenBLAS core name ("SkylakeX" 3, "Haswell" 2, "Sandybridge" 1, "Prescott"
// 0; unknown names 0), and the core that matches a CPU ("" when OpenBLAS's generic is right).
int gemm_core_level(const std::string& core);
std::string gemm_core_for(const CpuIsa& isa);

// The kernels the GEMM library runs now: "OpenBLAS 0.3.21 SkylakeX", or the loop GEMM.
std::string gemm_kernels();

// Call first in main(). May not return: it re-executes the program once, with the matching GEMM
// kernels (when OpenBLAS picked lower than the CPU can do and the user did not choose) and with
// GOMP_SPINCOUNT=1000 (when neither GOMP_SPINCOUNT nor OMP_WAIT_POLICY is set), both read by
// the libraries when they load. Does nothing when there is nothing to change.
void select_gemm_kernels(char** argv);

// How idle OpenMP threads wait: "OpenMP spin 1000" (the engine's default, see
// select_gemm_kernels), or the user's GOMP_SPINCOUNT / OMP_WAIT_POLICY.
std::string omp_wait_line();

// One line for the log: "cpu: AVX-512 (bf16), conv: oneDNN 2.6.3 (avx512_core_bf16), gemm:
// OpenBLAS 0.3.21 SkylakeX kernels" plus,
// when the engine corrected OpenBLAS, "(OpenBLAS picked Prescott for this CPU)".
std::string cpu_gemm_line();

}  // namespace unetcu::kernels::cpu
