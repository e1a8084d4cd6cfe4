// Which device a thread is on, as the device guards of runtime/cuda/runtime.cu set and restore
// it. Host code over two calls (Api::get and Api::set: cudaGetDevice and cudaSetDevice there),
// so the rules are tested on the CPU with a fake (tests/test_device_choice.cpp).
//
// Since CUDA 12, cudaSetDevice creates the device's primary context (hundreds of MB). A guard
// that put back "the previous device" of a thread that never chose one would set device 0,
// CUDA's default, and so open a context on GPU 0 in a run on cuda:1 alone: wasted memory, and
// a failure where GPU 0 is taken in exclusive-process mode. The rules:
//  - a thread starts with no device; the first guard's device becomes the thread's device, and
//    the thread stays on it when that guard ends (nothing is put back, so nothing else opens);
//  - a guard inside another, or on a thread that has its device, puts back the device it found
//    current;
//  - a raw set inside a guard (NCCL's per-rank loops) is undone when the guard ends;
//  - a set that fails goes back to the device current at entry, on a thread that has a device;
//  - get never opens a context, so the guard reads the current device to skip a needless set.
#pragma once

namespace unetcu::cuda {

// The device the calling thread's guards keep it on; -1 until its first guard.
inline int& thread_device() {
  thread_local int device = -1;
  return device;
}

// One guard's entry and exit. enter and leave return false where a call failed (the caller
// reports it: DeviceGuard throws, the quiet guard of deleters clears CUDA's error).
template <class Api>
class DeviceChoice {
 public:
  bool enter(int device) {
    int now = -1;
    const bool known = Api::get(&now);
    // What to put back: the device current now, which differs from the thread's device inside
    // a raw set (a guard opened within NCCL's per-rank loops returns to the rank's device).
    previous_ = thread_device() < 0 ? -1 : known ? now : thread_device();
    if (!(known && now == device) && !Api::set(device)) {
      // cudaSetDevice may make the device current and then fail (a device taken in
      // exclusive-process mode): back to the device current at entry, never to CUDA's default.
      if (previous_ >= 0) Api::set(previous_);
      return false;  // the thread's device stays as it was
    }
    device_ = device;
    thread_device() = device;
    return true;
  }
  // Puts back the device current at enter on a thread that had a device; a thread that had
  // none keeps the entered one (after an enter that failed, it keeps whatever is current).
  bool leave() {
    const int back = previous_ >= 0 ? previous_ : device_;  // a first guard's device stays
    if (back < 0) return true;
    thread_device() = back;
    return set_if_needed(back);
  }

 private:
  static bool set_if_needed(int device) {
    int now = -1;
    if (Api::get(&now) && now == device) return true;
    return Api::set(device);
  }
  int device_ = -1, previous_ = -1;
};

}  // namespace unetcu::cuda
