// Ctrl-C during training: the first SIGINT asks the epoch loop to stop after the step in
// progress (it writes the checkpoint, if one is configured, and throws Interrupted); a second
// one ends the process at once with exit code 130.
#pragma once
#include "runtime/common.h"

namespace unetcu {

// Thrown by fit() when it stopped on request; what() says where and what was saved.
struct Interrupted : Error {
  using Error::Error;
};

void install_interrupt_handler();  // SIGINT: request_interrupt(), then exit 130 on a second
void request_interrupt();          // async-signal-safe
bool interrupt_requested();
void clear_interrupt();

}  // namespace unetcu
