#include "engine/profiler.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <mutex>
#include <sstream>

#include "runtime/common.h"
#include "runtime/device.h"

#ifdef UNETCU_WITH_CUDA
#include <nvtx3/nvToolsExt.h>
#endif

namespace unetcu {

std::atomic<bool> Profiler::on_{false};

namespace {
std::mutex g_mu;
std::vector<ProfileRecord>& store() {
  static auto* v = new std::vector<ProfileRecord>();
  return *v;
}
const auto g_epoch = std::chrono::steady_clock::now();
thread_local std::string t_track = "main";
}  // namespace

void Profiler::enable(bool on) { on_.store(on, std::memory_order_relaxed); }
void Profiler::reset() {
  std::lock_guard<std::mutex> lock(g_mu);
  store().clear();
}
void Profiler::add(ProfileRecord r) {
  std::lock_guard<std::mutex> lock(g_mu);
  store().push_back(std::move(r));
}
std::vector<ProfileRecord> Profiler::records() {
  std::lock_guard<std::mutex> lock(g_mu);
  return store();
}
double Profiler::now_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - g_epoch).count();
}
void Profiler::set_thread_track(const std::string& track) { t_track = track; }
const std::string& Profiler::thread_track() { return t_track; }

ProfileRange::ProfileRange(const char* name, const char* category, double flops, double bytes) {
  if (!Profiler::enabled()) return;
  active_ = true;
  rec_.name = name;
  rec_.category = category;
  rec_.block = current_block_name();
  rec_.track = t_track;
  rec_.flops = flops;
  rec_.bytes = bytes;
#ifdef UNETCU_WITH_CUDA
  nvtxRangePushA(name);
#endif
  rec_.start_us = Profiler::now_us();
}

ProfileRange::~ProfileRange() {
  if (!active_) return;
  rec_.duration_us = Profiler::now_us() - rec_.start_us;
#ifdef UNETCU_WITH_CUDA
  nvtxRangePop();
#endif
  Profiler::add(std::move(rec_));
}

BlockScope::BlockScope(const std::string& name) : previous_(current_block_name()) {
  current_block_name() = name;
}
BlockScope::~BlockScope() { current_block_name() = previous_; }
const std::string& BlockScope::current() { return current_block_name(); }

namespace {

using Totals = Profiler::Totals;

std::string table(const char* title, const std::map<std::string, Totals>& rows, double total_us) {
  std::ostringstream os;
  os << "| " << title << " | calls | total ms | mean ms | share | GFLOP/s | GB/s |\n"
     << "|---|---|---|---|---|---|---|\n";
  std::vector<std::pair<std::string, Totals>> sorted(rows.begin(), rows.end());
  std::sort(sorted.begin(), sorted.end(), [](auto& a, auto& b) { return a.second.us > b.second.us; });
  for (const auto& [name, t] : sorted) {
    char line[256];
    std::snprintf(line, sizeof line, "| %s | %lld | %.3f | %.4f | %.1f%% | %.2f | %.2f |\n",
                  name.c_str(), (long long)t.calls, t.us / 1e3, t.us / 1e3 / double(t.calls),
                  total_us > 0 ? 100.0 * t.us / total_us : 0.0,
                  t.us > 0 ? t.flops / (t.us * 1e3) : 0.0, t.us > 0 ? t.bytes / (t.us * 1e3) : 0.0);
    os << line;
  }
  return os.str();
}

std::string json_escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '"' || c == '\\') o += '\\';
    if (static_cast<unsigned char>(c) < 0x20) continue;
    o += c;
  }
  return o;
}

}  // namespace

std::map<std::string, Totals> Profiler::totals_by_op(const std::vector<ProfileRecord>& recs) {
  std::map<std::string, Totals> ops;
  for (const auto& r : recs) {
    if (r.category == "block") continue;  // a block's time is its ops' time
    Totals& t = ops[r.name];
    ++t.calls, t.us += r.duration_us, t.flops += r.flops, t.bytes += r.bytes;
  }
  return ops;
}

std::map<std::string, Totals> Profiler::totals_by_block(const std::vector<ProfileRecord>& recs) {
  std::map<std::string, Totals> blocks;
  for (const auto& r : recs) {
    if (r.category == "block") continue;
    const std::string key = (r.block.empty() ? std::string("(no block)") : r.block) +
                            (r.category == "backward" ? " backward" : " forward");
    Totals& b = blocks[key];
    ++b.calls, b.us += r.duration_us, b.flops += r.flops, b.bytes += r.bytes;
  }
  return blocks;
}

std::string Profiler::summary() {
  const auto recs = records();
  const auto ops = totals_by_op(recs);
  double op_us = 0;
  for (const auto& [name, t] : ops) op_us += t.us;
  return table("op", ops, op_us) + "\n" + table("block (its ops)", totals_by_block(recs), op_us);
}

void Profiler::write_trace(const std::string& path) {
  const auto recs = records();
  std::map<std::string, int> tids;
  for (const auto& r : recs) tids.emplace(r.track, int(tids.size()) + 1);
  const std::string tmp = path + ".tmp";
  FILE* f = std::fopen(tmp.c_str(), "w");
  UNETCU_CHECK(f, "cannot write the trace '", path, "'");
  std::fprintf(f, "{\"traceEvents\":[\n");
  bool first = true;
  for (const auto& [track, tid] : tids) {
    std::fprintf(f, "%s{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":1,\"tid\":%d,\"args\":{\"name\":\"%s\"}}",
                 first ? "" : ",\n", tid, json_escape(track).c_str());
    first = false;
  }
  for (const auto& r : recs)
    std::fprintf(f, "%s{\"name\":\"%s\",\"cat\":\"%s\",\"ph\":\"X\",\"pid\":1,\"tid\":%d,\"ts\":%.3f,\"dur\":%.3f,"
                 "\"args\":{\"block\":\"%s\",\"flops\":%.0f,\"bytes\":%.0f}}",
                 first ? "" : ",\n", json_escape(r.name).c_str(), r.category.c_str(), tids[r.track],
                 r.start_us, r.duration_us, json_escape(r.block).c_str(), r.flops, r.bytes),
        first = false;
  std::fprintf(f, "\n],\"displayTimeUnit\":\"ms\"}\n");
  const bool ok = std::fflush(f) == 0 && !std::ferror(f);
  std::fclose(f);
  if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    throw Error(str_cat("cannot write the trace '", path, "'"));
  }
}

}  // namespace unetcu
