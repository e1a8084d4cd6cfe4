#include "train/callbacks/profiling.h"

#include "engine/profiler.h"

namespace unetcu {

Profiling::Profiling(FitContext& ctx) { check_writable(ctx.options.profile, "profile trace"); }

void Profiling::on_fit_start(FitContext& ctx) {
  if (ctx.options.profile.empty()) return;
  Profiler::reset();
  Profiler::enable(true);
}

void Profiling::on_fit_end(FitContext& ctx, TrainResult&) {
  const std::string& file = ctx.options.profile;
  if (file.empty()) return;
  Profiler::enable(false);
  ctx.out << "\nprofile (" << Profiler::records().size() << " ranges; trace in " << file << "):\n"
          << Profiler::summary() << "\n";
  const int rank = ctx.strategy.layout().process_rank;
  Profiler::write_trace(ctx.strategy.layout().process_count > 1 && !ctx.lead ? file + ".rank" + std::to_string(rank) : file);
}

}  // namespace unetcu
