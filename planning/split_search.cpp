#include "planning/split_search.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <sstream>

#include "runtime/cuda_api.h"
#include "engine/tape.h"

namespace unetcu {

double predict_step(const std::vector<BlockProfile>& blocks, const std::vector<int>& cuts,
                    int batch, int split, Schedule schedule, const LinkModel& link) {
  const int S = int(cuts.size()) + 1;
  const int M = (batch + split - 1) / split;
  std::vector<int> stage(blocks.size(), 0);
  for (size_t b = 0; b < blocks.size(); ++b)
    for (int c : cuts)
      if (int(b) >= c) ++stage[b];
  // Per sample: each stage's compute, and the bytes each (producer, consumer) pair exchanges.
  std::vector<double> fwd(S, 0), bwd(S, 0);
  std::map<std::pair<int, int>, double> bytes;  // (from, to) -> bytes per sample
  for (size_t b = 0; b < blocks.size(); ++b) {
    fwd[stage[b]] += blocks[b].forward_s;
    bwd[stage[b]] += blocks[b].backward_s;
  }
  for (size_t b = 0; b < blocks.size(); ++b) {
    for (int i : blocks[b].inputs)
      if (i >= 0 && stage[i] != stage[b]) bytes[{stage[i], stage[b]}] += blocks[i].output_bytes;
  }
  auto comm = [&](int from, int to, double n) {
    auto it = bytes.find({from, to});
    return it == bytes.end() ? 0.0 : link.latency + it->second * n / link.bandwidth;
  };
  std::vector<double> size(M);
  for (int m = 0; m < M; ++m) size[m] = std::min(split, batch - m * split);
  // Each stage's op order, as Pipeline runs it.
  struct Op {
    bool forward;
    int m;
  };
  std::vector<std::vector<Op>> order(S);
  for (int s = 0; s < S; ++s) {
    if (schedule == Schedule::GPipe) {
      for (int m = 0; m < M; ++m) order[s].push_back({true, m});
      for (int m = 0; m < M; ++m) order[s].push_back({false, m});
    } else {
      const int warm = std::min(S - s - 1, M);
      for (int m = 0; m < warm; ++m) order[s].push_back({true, m});
      for (int i = 0; i < M - warm; ++i) {
        order[s].push_back({true, warm + i});
        order[s].push_back({false, i});
      }
      for (int m = M - warm; m < M; ++m) order[s].push_back({false, m});
    }
  }
  std::vector<std::vector<double>> f_end(S, std::vector<double>(M, -1)), b_end = f_end;
  std::vector<size_t> next(S, 0);
  std::vector<double> free_at(S, 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (int s = 0; s < S; ++s) {
      while (next[s] < order[s].size()) {
        const Op op = order[s][next[s]];
        double ready = free_at[s];
        bool ok = true;
        if (op.forward) {
          for (int p = 0; p < s && ok; ++p) {
            if (f_end[p][op.m] < 0) ok = false;
            else ready = std::max(ready, f_end[p][op.m] + comm(p, s, size[op.m]));
          }
        } else {
          ok = f_end[s][op.m] >= 0;
          for (int c = s + 1; c < S && ok; ++c) {
            if (b_end[c][op.m] < 0) ok = false;
            else ready = std::max(ready, b_end[c][op.m] + comm(s, c, size[op.m]));
          }
        }
        if (!ok) break;
        const double end = ready + size[op.m] * (op.forward ? fwd[s] : bwd[s]);
        (op.forward ? f_end : b_end)[s][op.m] = end;
        free_at[s] = end;
        ++next[s];
        progress = true;
      }
    }
  }
  double t = 0;
  for (int s = 0; s < S; ++s) {
    UNETCU_CHECK(next[s] == order[s].size(), "split search: the schedule did not complete");
    t = std::max(t, free_at[s]);
  }
  return t;
}

std::vector<PlanCandidate> rank_plans(const std::vector<BlockProfile>& blocks, int batch,
                                      const std::vector<int>& split_sizes, Schedule schedule,
                                      const LinkModel& link) {
  std::vector<PlanCandidate> out;
  for (int c = 1; c < int(blocks.size()); ++c)
    for (int split : split_sizes) {
      if (split < 1 || split > batch) continue;
      out.push_back({{c}, split, predict_step(blocks, {c}, batch, split, schedule, link)});
    }
  std::stable_sort(out.begin(), out.end(), [](const PlanCandidate& a, const PlanCandidate& b) {
    return a.predicted_s < b.predicted_s;
  });
  return out;
}

std::vector<BlockProfile> profile_blocks(UNet& model, const Batch& batch, LossKind loss_kind,
                                         int repeats) {
  using Clock = std::chrono::steady_clock;
  UNETCU_CHECK(repeats >= 1, "profile_blocks: at least one timed repeat");
  const auto& blocks = model.blocks();
  const double n = double(batch.images.dim(0));
  std::vector<std::vector<double>> f(blocks.size()), b(blocks.size());
  std::vector<BlockProfile> out(blocks.size());
  const Device dev = model.parameters()[0].device();
  const Tensor images = batch.images.to(dev), masks = batch.masks.to(dev);
  for (int r = 0; r < repeats + 1; ++r) {  // the first run warms up
    Tape tape;
    std::vector<Tensor> outs(blocks.size());
    std::vector<size_t> first_node(blocks.size() + 1);
    Tensor loss;
    {
      TapeScope scope(tape);
      for (size_t k = 0; k < blocks.size(); ++k) {
        first_node[k] = tape.size();
        std::vector<Tensor> in;
        for (int i : blocks[k].inputs) in.push_back(i < 0 ? images : outs[i]);
        const auto t0 = Clock::now();
        outs[k] = blocks[k].forward(in);
        (void)outs[k].at(0);  // on a GPU, waits for the block to finish
        if (r) f[k].push_back(std::chrono::duration<double>(Clock::now() - t0).count());
        out[k].output_bytes = double(outs[k].nbytes()) / n;
      }
      first_node[blocks.size()] = tape.size();
      loss = segmentation_loss(loss_kind, outs.back(), masks);
    }
    // Backward: nodes run in reverse order; each one's time is the gap since the previous.
    const size_t nodes = tape.size();
    auto last = Clock::now();
    std::vector<double> node_time(nodes, 0);
    size_t done = 0;
    tape.set_node_done_hook([&](const char*) {
      if (dev.is_cuda()) cuda::synchronize(dev.index);  // time the kernels, not their queueing
      const auto now = Clock::now();
      node_time[nodes - 1 - done++] = std::chrono::duration<double>(now - last).count();
      last = now;
    });
    last = Clock::now();
    tape.backward(loss);
    if (r)
      for (size_t k = 0; k < blocks.size(); ++k) {
        double t = 0;
        for (size_t i = first_node[k]; i < first_node[k + 1]; ++i) t += node_time[i];
        b[k].push_back(t);
      }
    for (Tensor& p : model.parameters()) p.zero_grad();
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  for (size_t k = 0; k < blocks.size(); ++k) {
    out[k].name = blocks[k].name;
    out[k].inputs = blocks[k].inputs;
    out[k].forward_s = median(f[k]) / n;
    out[k].backward_s = median(b[k]) / n;
  }
  return out;
}

std::string plans_table(const std::vector<PlanCandidate>& plans,
                        const std::vector<BlockProfile>& blocks) {
  std::vector<int> splits;
  std::vector<int> cuts;
  for (const auto& p : plans) {
    if (std::find(splits.begin(), splits.end(), p.split_size) == splits.end()) splits.push_back(p.split_size);
    if (std::find(cuts.begin(), cuts.end(), p.cuts[0]) == cuts.end()) cuts.push_back(p.cuts[0]);
  }
  std::sort(splits.begin(), splits.end());
  std::sort(cuts.begin(), cuts.end());
  // The fastest: by measurement among the measured, else by prediction.
  const PlanCandidate* best = nullptr;
  for (const auto& p : plans)
    if (p.measured_s >= 0 && (!best || p.measured_s < best->measured_s)) best = &p;
  if (!best && !plans.empty()) best = &plans[0];
  std::ostringstream os;
  os << "| cut after \\ split_size |";
  for (int s : splits) os << " " << s << " |";
  os << "\n|---|";
  for (size_t i = 0; i < splits.size(); ++i) os << "---|";
  os << "\n";
  for (int c : cuts) {
    os << "| " << blocks[c - 1].name << " |";
    for (int s : splits) {
      const PlanCandidate* p = nullptr;
      for (const auto& q : plans)
        if (q.cuts[0] == c && q.split_size == s) p = &q;
      char cell[64] = "";
      if (p) {
        if (p->measured_s >= 0)
          std::snprintf(cell, sizeof cell, "%.3f", p->measured_s);
        else
          std::snprintf(cell, sizeof cell, "(%.3f)", p->predicted_s);
      }
      os << " " << (p == best ? "**" : "") << cell << (p == best ? "**" : "") << " |";
    }
    os << "\n";
  }
  os << "\nSeconds per step: measured, or (predicted) where not run; fastest in bold.\n";
  return os.str();
}

}  // namespace unetcu
