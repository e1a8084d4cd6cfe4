#include "planning/split_search.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <sstream>

#include "runtime/cuda_api.h"
#include "engine/tape.h"
#include "planning/block_walk.h"
#include "parallel/worker_pool.h"

namespace unetcu {

namespace {

double per_sample(const BlockProfile& b, double m, bool forward) {
  const auto& pts = b.by_batch;
  auto at = [&](const BatchPoint& p) { return forward ? p.forward_s : p.backward_s; };
  if (pts.empty()) return forward ? b.forward_s : b.backward_s;
  if (m <= pts.front().samples) return at(pts.front());
  for (size_t i = 1; i < pts.size(); ++i)
    if (m <= pts[i].samples) {
      const double w = (m - pts[i - 1].samples) / double(pts[i].samples - pts[i - 1].samples);
      return (1 - w) * at(pts[i - 1]) + w * at(pts[i]);
    }
  return at(pts.back());
}

}  // namespace

double forward_per_sample(const BlockProfile& b, double m) { return per_sample(b, m, true); }
double backward_per_sample(const BlockProfile& b, double m) { return per_sample(b, m, false); }

double predict_step(const std::vector<BlockProfile>& blocks, const std::vector<int>& cuts,
                    int batch, int split, Schedule schedule, const LinkModel& link) {
  const int S = int(cuts.size()) + 1;
  const int M = (batch + split - 1) / split;
  std::vector<int> stage(blocks.size(), 0);
  for (size_t b = 0; b < blocks.size(); ++b)
    for (int c : cuts)
      if (int(b) >= c) ++stage[b];
  // Per sample: the bytes each (producer, consumer) pair of stages exchanges.
  std::map<std::pair<int, int>, double> bytes;  // (from, to) -> bytes per sample
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
  // Each stage's time for a whole micro-batch (per-sample time at that micro-batch's size), and
  // its shared slowdown weighted by time.
  std::vector<std::vector<double>> fwd(S, std::vector<double>(M, 0)), bwd = fwd;
  std::vector<double> slow_w(S, 0), slow_t(S, 0);
  for (size_t b = 0; b < blocks.size(); ++b) {
    const int s = stage[b];
    for (int m = 0; m < M; ++m) {
      fwd[s][m] += size[m] * forward_per_sample(blocks[b], size[m]);
      bwd[s][m] += size[m] * backward_per_sample(blocks[b], size[m]);
    }
    const double t = blocks[b].forward_s + blocks[b].backward_s;
    slow_w[s] += t * blocks[b].shared_slowdown;
    slow_t[s] += t;
  }
  std::vector<double> slowdown(S, 1);
  for (int s = 0; s < S; ++s)
    if (slow_t[s] > 0) slowdown[s] = slow_w[s] / slow_t[s];
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
  // The stage's next op can start at ready (its inputs there); < 0: they are not yet.
  auto ready_at = [&](int s) {
    const Op op = order[s][next[s]];
    double ready = 0;
    if (op.forward) {
      for (int p = 0; p < s; ++p) {
        if (f_end[p][op.m] < 0) return -1.0;
        ready = std::max(ready, f_end[p][op.m] + comm(p, s, size[op.m]));
      }
    } else {
      if (f_end[s][op.m] < 0) return -1.0;
      for (int c = s + 1; c < S; ++c) {
        if (b_end[c][op.m] < 0) return -1.0;
        ready = std::max(ready, b_end[c][op.m] + comm(s, c, size[op.m]));
      }
    }
    return ready;
  };
  // Event by event: running stages progress at 1 / (their slowdown with k stages busy).
  std::vector<char> running(S, 0);
  std::vector<double> remaining(S, 0);  // of the running op, in seconds alone
  double now = 0;
  for (;;) {
    for (int s = 0; s < S; ++s)
      if (!running[s] && next[s] < order[s].size()) {
        const double r = ready_at(s);
        if (r >= 0 && r <= now) {
          const Op op = order[s][next[s]];
          running[s] = 1;
          remaining[s] = op.forward ? fwd[s][op.m] : bwd[s][op.m];
        }
      }
    int busy = 0;
    for (int s = 0; s < S; ++s) busy += running[s];
    auto rate = [&](int s) { return 1.0 / (S > 1 ? 1 + (slowdown[s] - 1) * (busy - 1) / (S - 1) : 1.0); };
    double t_next = 1e300;
    for (int s = 0; s < S; ++s) {
      if (running[s]) t_next = std::min(t_next, now + remaining[s] / rate(s));
      else if (next[s] < order[s].size()) {
        const double r = ready_at(s);
        if (r > now) t_next = std::min(t_next, r);
      }
    }
    if (t_next == 1e300) break;
    const double dt = t_next - now;
    for (int s = 0; s < S; ++s) {
      if (!running[s]) continue;
      const double end = now + remaining[s] / rate(s);
      if (end <= t_next) {  // finished now (the earliest finisher ends exactly at t_next)
        const Op op = order[s][next[s]];
        (op.forward ? f_end : b_end)[s][op.m] = t_next;
        running[s] = 0;
        ++next[s];
      } else {
        remaining[s] -= dt * rate(s);
      }
    }
    now = t_next;
  }
  for (int s = 0; s < S; ++s)
    UNETCU_CHECK(next[s] == order[s].size(), "split search: the schedule did not complete");
  return now;
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
    BlockWalk walk;
    Tensor loss;
    {
      TapeScope scope(tape);
      walk = walk_blocks(model, tape, images, [&](size_t k, const std::vector<Tensor>& in) {
        const auto t0 = Clock::now();
        Tensor o = blocks[k].forward(in);
        (void)o.at(0);  // on a GPU, waits for the block to finish
        if (r) f[k].push_back(std::chrono::duration<double>(Clock::now() - t0).count());
        out[k].output_bytes = double(o.nbytes()) / n;
        return o;
      });
      loss = segmentation_loss(loss_kind, walk.outputs.back(), masks);
    }
    const std::vector<size_t>& first_node = walk.first_node;
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
    for (const Module* m : blocks[k].modules)
      for (const Tensor& p : m->parameters()) out[k].param_bytes += double(p.nbytes());
  }
  return out;
}

std::vector<BlockProfile> profile_blocks_by_batch(UNet& model, const std::vector<Batch>& batches,
                                                  LossKind loss, int repeats) {
  UNETCU_CHECK(!batches.empty(), "profile_blocks_by_batch: no batch");
  std::vector<const Batch*> sorted;
  for (const Batch& b : batches) sorted.push_back(&b);
  std::sort(sorted.begin(), sorted.end(),
            [](const Batch* a, const Batch* b) { return a->images.dim(0) < b->images.dim(0); });
  std::vector<BlockProfile> out;
  for (const Batch* b : sorted) {
    // Two rounds, each block's faster: a passing disturbance on the machine is not the block's.
    auto p = profile_blocks(model, *b, loss, repeats);
    const auto again = profile_blocks(model, *b, loss, repeats);
    for (size_t k = 0; k < p.size(); ++k) {
      p[k].forward_s = std::min(p[k].forward_s, again[k].forward_s);
      p[k].backward_s = std::min(p[k].backward_s, again[k].backward_s);
    }
    const int m = int(b->images.dim(0));
    if (out.empty()) out = p;
    for (size_t k = 0; k < p.size(); ++k) {
      out[k].forward_s = p[k].forward_s;  // the largest batch's, in the end
      out[k].backward_s = p[k].backward_s;
      if (!out[k].by_batch.empty() && out[k].by_batch.back().samples == m) continue;
      out[k].by_batch.push_back({m, p[k].forward_s, p[k].backward_s});
    }
  }
  return out;
}

void measure_shared_slowdown(std::vector<BlockProfile>& blocks, const UNetConfig& model,
                             const std::vector<Device>& devices, int threads, const Batch& batch,
                             LossKind loss, int repeats) {
  const int N = int(devices.size());
  if (N < 2) return;
  std::vector<std::unique_ptr<UNet>> models(N);
  std::vector<Batch> shards(N);
  for (int r = 0; r < N; ++r) {
    UNetConfig c = model;
    c.device = devices[r];
    models[r] = std::make_unique<UNet>(c);
    models[r]->train();
    shards[r] = {batch.images.to(devices[r]), batch.masks.to(devices[r])};
  }
  WorkerPool pool(devices, std::max(1, threads), "profile");
  // Two rounds of (first device alone, every device at once); each block's faster round of
  // each kind, so a passing disturbance on the machine does not count as sharing.
  std::vector<double> alone(blocks.size(), 1e300), together(blocks.size(), 1e300);
  for (int round = 0; round < 2; ++round) {
    std::vector<std::vector<BlockProfile>> p(N);
    pool.run([&](int r) {
      if (r == 0) p[0] = profile_blocks(*models[0], shards[0], loss, repeats);
    });
    UNETCU_CHECK(p[0].size() == blocks.size(), "measure_shared_slowdown: the profile has ",
                 blocks.size(), " blocks, the model ", p[0].size());
    for (size_t k = 0; k < blocks.size(); ++k)
      alone[k] = std::min(alone[k], p[0][k].forward_s + p[0][k].backward_s);
    pool.run([&](int r) { p[r] = profile_blocks(*models[r], shards[r], loss, repeats); });
    for (size_t k = 0; k < blocks.size(); ++k) {
      double t = 0;
      for (int r = 0; r < N; ++r) t += (p[r][k].forward_s + p[r][k].backward_s) / N;
      together[k] = std::min(together[k], t);
    }
  }
  for (size_t k = 0; k < blocks.size(); ++k) {
    const double t = together[k], a = alone[k];
    blocks[k].shared_slowdown = a > 0 ? t / a : 1.0;
  }
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
