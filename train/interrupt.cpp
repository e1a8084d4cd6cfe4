#include "train/interrupt.h"

#include <unistd.h>

#include <atomic>
#include <csignal>

namespace unetcu {

namespace {
std::atomic<int> g_requests{0};

extern "C" void on_sigint(int) {
  if (g_requests.fetch_add(1) >= 1) _exit(130);  // the second Ctrl-C: stop at once
  const char msg[] = "\ninterrupt: finishing the step (Ctrl-C again to stop at once)\n";
  ssize_t ignored = write(STDERR_FILENO, msg, sizeof msg - 1);
  (void)ignored;
}
}  // namespace

void install_interrupt_handler() {
  struct sigaction sa {};
  sa.sa_handler = on_sigint;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  sigaction(SIGINT, &sa, nullptr);
}

void request_interrupt() { g_requests.fetch_add(1); }
bool interrupt_requested() { return g_requests.load() > 0; }
void clear_interrupt() { g_requests.store(0); }

}  // namespace unetcu
