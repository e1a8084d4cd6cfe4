// The profiler: named ranges around every op (forward and backward) and every model block,
// with each op's FLOPs and bytes moved, so a run can be read per op and per block (calls,
// total and mean time, share, achieved GFLOP/s and GB/s) and drawn as a Chrome/Perfetto trace
// with one track per thread role (a device's compute, copy or communication work).
//
// Off by default and free when off: a range then costs one relaxed atomic load.
// Times are host steady-clock times. On a GPU they are the time to queue the work unless
// UNETCU_CUDA_SYNC=1 makes every launch wait for its kernels; the ranges are also NVTX ranges
// in CUDA builds, so Nsight Systems shows them over the real kernel timeline.
#pragma once
#include <atomic>
#include <map>
#include <string>
#include <vector>

namespace unetcu {

struct ProfileRecord {
  std::string name;      // op ("conv2d", "conv2d.backward") or block ("encoder.layer1")
  std::string category;  // "op", "backward" or "block"
  std::string block;     // the model block an op ran for (empty outside a block)
  std::string track;     // e.g. "cpu:0 compute", "cpu:1 comm"
  double start_us = 0, duration_us = 0;
  double flops = 0, bytes = 0;
};

class Profiler {
 public:
  static bool enabled() { return on_.load(std::memory_order_relaxed); }
  static void enable(bool on);
  static void reset();
  static void add(ProfileRecord r);
  static std::vector<ProfileRecord> records();
  static double now_us();  // since the profiler's epoch

  // The calling thread's track name (default "main").
  static void set_thread_track(const std::string& track);
  static const std::string& thread_track();

  struct Totals {
    int64_t calls = 0;
    double us = 0, flops = 0, bytes = 0;
  };
  // Per op name (block ranges left out; communication ranges included).
  static std::map<std::string, Totals> totals_by_op(const std::vector<ProfileRecord>& records);
  // Per "<block> forward" / "<block> backward": the ops that ran for it.
  static std::map<std::string, Totals> totals_by_block(const std::vector<ProfileRecord>& records);
  // Tables per op and per block: calls, total ms, mean ms, share, GFLOP/s, GB/s.
  static std::string summary();
  // Chrome trace event format (chrome://tracing, ui.perfetto.dev); written to a temporary
  // file and renamed.
  static void write_trace(const std::string& path);

 private:
  static std::atomic<bool> on_;
};

// Times [construction, destruction) when the profiler is on.
class ProfileRange {
 public:
  ProfileRange(const char* name, const char* category, double flops = 0, double bytes = 0);
  ProfileRange(const std::string& name, const char* category, double flops = 0, double bytes = 0)
      : ProfileRange(name.c_str(), category, flops, bytes) {}
  ~ProfileRange();
  ProfileRange(const ProfileRange&) = delete;
  ProfileRange& operator=(const ProfileRange&) = delete;

 private:
  bool active_ = false;
  ProfileRecord rec_;
};

// The model block the calling thread is running (op ranges and tape nodes record it).
class BlockScope {
 public:
  explicit BlockScope(const std::string& name);
  ~BlockScope();
  static const std::string& current();

 private:
  std::string previous_;
};

}  // namespace unetcu
