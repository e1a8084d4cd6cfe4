#include "kernels/cpu/cpu_select.h"

#include "kernels/cpu/conv_dnnl.h"

#include <cpuid.h>
#include <strings.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

#ifdef UNETCU_HAVE_OPENBLAS
extern "C" char* openblas_get_corename(void);
extern "C" char* openblas_get_config(void);
#endif

namespace unetcu::kernels::cpu {

namespace {

// OpenMP threads that find no work spin before they sleep: libgomp's default is 300,000 spins
// (about a millisecond), made for a machine of one's own. Beside other work (a second run, a
// compiler) the spinning threads take the cores the working ones need: one epoch of the main
// job beside a second copy of itself took 3.8-4.3x its time alone on 2 cores instead of 2x.
// 1,000 spins keep that near 2x at a cost of 1-2% alone (docs/benchmarks.md). libgomp reads
// its environment once, when it loads, before main() (a setenv() from an .preinit_array is
// undone by libc's own initialisation), so the default is set by running the program again.
constexpr const char* kSpinCount = "1000";

// Whether the OS saves the AVX (and AVX-512) registers: XGETBV's XCR0 bits.
bool os_saves(unsigned mask) {
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & bit_OSXSAVE)) return false;
  unsigned lo, hi;
  __asm__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (lo & mask) == mask;
}

}  // namespace

CpuIsa cpu_isa() {
  CpuIsa isa;
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return isa;
  const bool avx = (c & bit_AVX) && os_saves(0x6);
  const bool fma = c & bit_FMA;
  unsigned a7 = 0, b7 = 0, c7 = 0, d7 = 0;
  __get_cpuid_count(7, 0, &a7, &b7, &c7, &d7);
  const bool avx2 = avx && (b7 & bit_AVX2) && fma;
  const bool avx512 = avx2 && os_saves(0xE6) && (b7 & bit_AVX512F) && (b7 & bit_AVX512BW) &&
                      (b7 & bit_AVX512VL) && (b7 & bit_AVX512DQ) && (b7 & bit_AVX512CD);
  isa.level = avx512 ? 3 : avx2 ? 2 : avx ? 1 : 0;
  if (avx512) {
    unsigned a1 = 0, b1 = 0, c1 = 0, d1 = 0;
    __get_cpuid_count(7, 1, &a1, &b1, &c1, &d1);
    isa.avx512_bf16 = a1 & (1u << 5);
  }
  return isa;
}

std::string CpuIsa::name() const {
  static const char* names[] = {"SSE", "AVX", "AVX2", "AVX-512"};
  return std::string(names[level]) + (avx512_bf16 ? " (bf16)" : "");
}

int gemm_core_level(const std::string& core) {
  static const char* l3[] = {"SkylakeX", "Cooperlake", "SapphireRapids"};
  static const char* l2[] = {"Haswell", "Zen", "Excavator", "Steamroller"};
  static const char* l1[] = {"Sandybridge", "Bulldozer", "Piledriver"};
  for (const char* n : l3) if (strcasecmp(core.c_str(), n) == 0) return 3;
  for (const char* n : l2) if (strcasecmp(core.c_str(), n) == 0) return 2;
  for (const char* n : l1) if (strcasecmp(core.c_str(), n) == 0) return 1;
  return 0;
}

std::string gemm_core_for(const CpuIsa& isa) {
  switch (isa.level) {
    case 3: return isa.avx512_bf16 ? "Cooperlake" : "SkylakeX";
    case 2: return "Haswell";
    case 1: return "Sandybridge";
    default: return "";
  }
}

std::string gemm_kernels() {
#ifdef UNETCU_HAVE_OPENBLAS
  std::string config = openblas_get_config();  // "OpenBLAS 0.3.21 NO_LAPACKE DYNAMIC_ARCH ..."
  const auto sp = config.find(' ', config.find(' ') + 1);
  return config.substr(0, sp) + " " + openblas_get_corename();
#else
  return "loop GEMM (built without OpenBLAS)";
#endif
}

void select_gemm_kernels(char** argv) {
  if (std::getenv("UNETCU_REEXEC")) return;  // once: this run is the corrected one
  bool again = false;
  const bool set_spin = !std::getenv("OMP_WAIT_POLICY") && !std::getenv("GOMP_SPINCOUNT");
  if (set_spin) {
    setenv("GOMP_SPINCOUNT", kSpinCount, 1);
    again = true;
  }
#ifdef UNETCU_HAVE_OPENBLAS
  const char* force = std::getenv("UNETCU_GEMM_CORE");
  if (!(force && std::strcmp(force, "keep") == 0)) {
    const std::string current = openblas_get_corename();
    std::string want;
    if (force && *force) {
      want = force;
    } else {
      const CpuIsa isa = cpu_isa();
      if (gemm_core_level(current) < isa.level) want = gemm_core_for(isa);
    }
    if (!want.empty() && strcasecmp(want.c_str(), current.c_str()) != 0) {
      setenv("OPENBLAS_CORETYPE", want.c_str(), 1);
      setenv("UNETCU_GEMM_REEXEC", current.c_str(), 1);  // what OpenBLAS had picked, for the log
      again = true;
    }
  }
#endif
  if (!again) return;
  setenv("UNETCU_REEXEC", "1", 1);
  execv("/proc/self/exe", argv);
  // Could not re-execute: carry on with the libraries as they loaded.
  unsetenv("UNETCU_REEXEC");
  unsetenv("UNETCU_GEMM_REEXEC");
  if (set_spin) unsetenv("GOMP_SPINCOUNT");
}

std::string omp_wait_line() {
  if (const char* policy = std::getenv("OMP_WAIT_POLICY")) return std::string("OMP_WAIT_POLICY=") + policy;
  const char* spin = std::getenv("GOMP_SPINCOUNT");
  if (!spin) return "OpenMP waits: libgomp's default";
  return std::string("OpenMP spin ") + spin + (std::strcmp(spin, kSpinCount) == 0 ? "" : " (GOMP_SPINCOUNT)");
}

std::string cpu_gemm_line() {
  std::string line = "cpu: " + cpu_isa().name() + ", conv: " + cpu_conv_line() +
                     ", gemm: " + gemm_kernels() + " kernels";
  const char* force = std::getenv("UNETCU_GEMM_CORE");
  if (force && *force)
    line += std::string(" (UNETCU_GEMM_CORE=") + force + ")";
  else if (const char* before = std::getenv("UNETCU_GEMM_REEXEC"))
    line += std::string(" (OpenBLAS picked ") + before +
            " for this CPU; UNETCU_GEMM_CORE=keep keeps its pick)";
  line += ", " + omp_wait_line();
  return line;
}

}  // namespace unetcu::kernels::cpu
