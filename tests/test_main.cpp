// doctest main that fails when a run selects no test case: ctest runs each case through a
// name filter, and a filter that matches nothing must not pass silently. Each run works in a
// scratch folder of its own (scratch_dir.h), so cases run side by side (ctest -j) never share a file.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <atomic>
#include <cstdio>

#include "kernels/cpu/cpu_select.h"
#include "scratch_dir.h"

namespace {
std::atomic<int> g_cases_started{0};

struct CountingListener : doctest::IReporter {
  explicit CountingListener(const doctest::ContextOptions&) {}
  void report_query(const doctest::QueryData&) override {}
  void test_run_start() override {}
  void test_run_end(const doctest::TestRunStats&) override {}
  void test_case_start(const doctest::TestCaseData&) override { ++g_cases_started; }
  void test_case_reenter(const doctest::TestCaseData&) override {}
  void test_case_end(const doctest::CurrentTestCaseStats&) override {}
  void test_case_exception(const doctest::TestCaseException&) override {}
  void subcase_start(const doctest::SubcaseSignature&) override {}
  void subcase_end() override {}
  void log_assert(const doctest::AssertData&) override {}
  void log_message(const doctest::MessageData&) override {}
  void test_case_skipped(const doctest::TestCaseData&) override {}
};
REGISTER_LISTENER("counting", 1, CountingListener);
}  // namespace

int main(int argc, char** argv) {
  unetcu::kernels::cpu::select_gemm_kernels(argv);  // the matching GEMM kernels (may re-run)
  doctest::Context context(argc, argv);
  const unetcu::testing::ScratchDir scratch;  // cases run in parallel write apart
  const int rc = context.run();
  if (context.shouldExit()) return rc;  // --help, --list-test-cases, ...
  if (rc == 0 && g_cases_started == 0) {
    std::fprintf(stderr, "no test case matched the filters\n");
    return 1;
  }
  return rc;
}
