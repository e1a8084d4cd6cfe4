// On a GPU: a training step replayed as a CUDA graph (SingleDeviceStrategy with cuda_graphs) gives the
// eager step's bits — losses, parameters, batch-norm running statistics and counts — over steps
// before the capture, replays, an eager step of another batch shape in between, and replays
// after it; in float32 NCHW and bf16 NHWC. The suite runs with deterministic convolutions, so
// the eager and the captured kernels are the same ones. And once captured, a step takes no
// memory from the system. The same for a pipeline's step (two stages, on one GPU's two streams
// and on two GPUs), captured over the stages' streams.
#include <doctest/doctest.h>

#include <stdlib.h>

#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "cli/parse.h"
#include "data/synthetic.h"
#include "runtime/cuda_api.h"
#include "train/strategy.h"
#include "../steady_alloc.h"
#include "same_state.h"
#include "stream_gate.h"
#include "../small_models.h"

using namespace unetcu;
using namespace unetcu::testing;

namespace {

UNetConfig gpu_model(bool mixed) { return small_unet(9, Device::cuda(0), DType::F32, mixed); }

}  // namespace

namespace {

// One device: 2 eager steps, the capture and its first replay, replays on new data, a short
// batch (eager), and replays after it (order 0); or a short batch third (order 1: the capture
// waits for a third step at the first batch's shape, never capturing the short one). A case
// per precision and order, each under the per-test time bound on the emulator.
void single_graph_equals_eager(bool mixed, int o) {
  CAPTURE(mixed);
  CAPTURE(o);
  SyntheticSegmentation data(64, 3);
  const Batch full = data.batch({0, 1, 2, 3}), other = data.batch({4, 5, 6, 7}), short_batch = data.batch({8, 9});
  const std::vector<std::vector<const Batch*>> orders = {
      {&full, &other, &full, &other, &full, &short_batch, &other, &full},
      {&full, &other, &short_batch, &full, &other, &full}};
  SingleDeviceStrategy eager(gpu_model(mixed), Placement{{}, 0, false, 0}, optimizer_factory({}), LossKind::BCEDice);
  SingleDeviceStrategy graph(gpu_model(mixed), Placement{{}, 0, true, 0}, optimizer_factory({}), LossKind::BCEDice);
  CHECK(graph.describe().find("CUDA graphs") != std::string::npos);
  for (size_t k = 0; k < orders[size_t(o)].size(); ++k) {
    CAPTURE(k);
    const double le = eager.step(eager.place(*orders[size_t(o)][k]));
    const double lg = graph.step(graph.place(*orders[size_t(o)][k]));
    CHECK(std::memcmp(&le, &lg, sizeof le) == 0);
    CHECK(graph.graph_captured() == (k >= size_t(2 + (o == 1))));  // captured, not fallen back
  }
  check_same_state(eager.model(), graph.model());
}

}  // namespace

TEST_CASE("a training step replayed as a CUDA graph equals the eager step, bit for bit: float32 NCHW") {
  single_graph_equals_eager(false, 0);
}
TEST_CASE("a training step replayed as a CUDA graph equals the eager step, bit for bit: bf16 NHWC") {
  single_graph_equals_eager(true, 0);
}
TEST_CASE("a training step replayed as a CUDA graph equals the eager step, bit for bit: a short batch third, float32") {
  single_graph_equals_eager(false, 1);
}
TEST_CASE("a training step replayed as a CUDA graph equals the eager step, bit for bit: a short batch third, bf16") {
  single_graph_equals_eager(true, 1);
}

TEST_CASE("a step replayed as a CUDA graph takes no GPU memory from the system") {
  SyntheticSegmentation data(64, 2);
  const Batch b = data.batch({0, 1, 2, 3});
  SingleDeviceStrategy s(gpu_model(true), Placement{{}, 0, true, 0}, optimizer_factory({}), LossKind::BCEDice);
  CHECK(system_allocations_after_warmup(s, b, 4, 5, [] {
          return cuda::device_memory_stats(0).system_allocations;
        }) == 0);
  CHECK(s.graph_captured());
}

namespace {

// Gradient accumulation: a batch of 4 in chunks of 2, each chunk's forward and backward in the
// one graph (the second chunk's backward adds to the first's gradients). A batch of 3 (another
// shape: eager, chunks of 2 and 1) between replays.
void accumulated_chunks_graph(bool mixed) {
  CAPTURE(mixed);
  SyntheticSegmentation data(64, 4);
  const Batch full = data.batch({0, 1, 2, 3}), other = data.batch({4, 5, 6, 7}), short_batch = data.batch({8, 9, 10});
  const std::vector<const Batch*> order = {&full, &other, &full, &other, &short_batch, &full, &other};
  SingleDeviceStrategy eager(gpu_model(mixed), Placement{{}, 0, false, 2}, optimizer_factory({}), LossKind::BCEDice);
  SingleDeviceStrategy graph(gpu_model(mixed), Placement{{}, 0, true, 2}, optimizer_factory({}), LossKind::BCEDice);
  SingleDeviceStrategy whole(gpu_model(mixed), Placement{{}, 0, false, 0}, optimizer_factory({}), LossKind::BCEDice);
  for (size_t k = 0; k < order.size(); ++k) {
    CAPTURE(k);
    const double le = eager.step(eager.place(*order[k]));
    const double lg = graph.step(graph.place(*order[k]));
    CHECK(std::memcmp(&le, &lg, sizeof le) == 0);
    CHECK(graph.graph_captured() == (k >= 2));
    if (k == 0) {
      // Not the whole batch at once: batch norm saw each chunk alone (the loss differs).
      const double lw = whole.step(whole.place(*order[k]));
      CHECK(lw != le);
    }
  }
  check_same_state(eager.model(), graph.model());
}

}  // namespace

TEST_CASE(
    "a step of accumulated chunks replayed as a CUDA graph equals the eager accumulated step, bit for bit: float32 "
    "NCHW") {
  accumulated_chunks_graph(false);
}
TEST_CASE(
    "a step of accumulated chunks replayed as a CUDA graph equals the eager accumulated step, bit for bit: bf16 NHWC") {
  accumulated_chunks_graph(true);
}

TEST_CASE("a captured step of accumulated chunks holds one chunk's activations, and takes no memory from the system") {
  // The capture's pool reuses a chunk's freed activations for the next chunk. The device memory
  // each graph adds (its pool, less its input tensors) for: the batch of 4 at once, the batch
  // of 4 in chunks of 1, and a batch of 1. Were a chunk's blocks not reused, the chunks' graph
  // would hold 4 images' activations, as the batch of 4 does; reused, it holds what the batch
  // of 1 does. Replays take nothing from the system.
  SyntheticSegmentation data(64, 6);
  struct Run {
    std::vector<int64_t> rows;
    int64_t accumulate_rows;
    size_t added = 0;
  };
  Run runs[] = {{{0, 1, 2, 3}, 0}, {{0, 1, 2, 3}, 1}, {{0}, 0}};
  for (Run& run : runs) {
    CAPTURE(run.rows.size());
    CAPTURE(run.accumulate_rows);
    const Batch b = data.batch(run.rows);
    SingleDeviceStrategy s(gpu_model(true), Placement{{}, 0, true, run.accumulate_rows}, optimizer_factory({}),
                           LossKind::BCEDice);
    const PlacedBatch placed = s.place(b);
    for (int i = 0; i < 2; ++i) s.step(placed);  // the eager steps before the capture
    // Parameters, their gradients, the optimizer's state and the placed batch.
    cuda::synchronize(0);
    const size_t before = cuda::device_memory_stats(0).current_bytes;
    s.step(placed);  // the capture and its first replay
    REQUIRE(s.graph_captured());
    cuda::synchronize(0);
    cuda::reset_device_peak(0);  // the peak is now what tensors and the graph's pool hold
    const size_t inputs = b.images.nbytes() + b.masks.nbytes();
    run.added = cuda::device_memory_stats(0).peak_bytes - before - inputs;
    CHECK(system_allocations_after_warmup(s, b, 0, 3, [] { return cuda::device_memory_stats(0).system_allocations; }) ==
          0);
    MESSAGE("the graph added ", run.added, " bytes besides its inputs (", before, " before it)");
  }
  const double three_images = double(runs[0].added) - double(runs[2].added);
  REQUIRE(three_images > 0);
  CHECK(double(runs[1].added) - double(runs[2].added) < 0.25 * three_images);
}

namespace {

PipelineOptions two_stages(Device a, Device b, Schedule schedule, bool graphs) {
  PipelineOptions o;
  o.devices = {a, b};
  o.cuts = cli::parse_cuts("layer3");
  o.split_size = 2;
  o.schedule = schedule;
  o.cuda_graphs = graphs;
  return o;
}

// Where a pipeline's devices are: one GPU's two streams, and two GPUs where there are two.
std::vector<std::vector<Device>> pipeline_placements() {
  std::vector<std::vector<Device>> out = {{Device::cuda(0), Device::cuda(0)}};
  if (cuda_device_count() >= 2)
    out.push_back({Device::cuda(0), Device::cuda(1)});
  else
    MESSAGE("one GPU visible: the pipeline over two GPUs is not run");
  return out;
}

}  // namespace

namespace {

// 4 samples in micro-batches of 2; the short batch is one micro-batch of 2 (another shape:
// eager), between replays; validation (eval mode, eager, on the graph's weights) before it.
void pipeline_graph_equals_eager(const std::vector<Device>& devices, Schedule schedule, bool mixed) {
  CAPTURE(devices[1].str());
  CAPTURE(int(schedule));
  CAPTURE(mixed);
  SyntheticSegmentation data(64, 5);
  const Batch full = data.batch({0, 1, 2, 3}), other = data.batch({4, 5, 6, 7}), short_batch = data.batch({8, 9});
  const std::vector<const Batch*> order = {&full, &other, &full, &other, &short_batch, &full, &other};
  PipelineStrategy eager(gpu_model(mixed), two_stages(devices[0], devices[1], schedule, false),
                         optimizer_factory({}), LossKind::BCEDice);
  PipelineStrategy graph(gpu_model(mixed), two_stages(devices[0], devices[1], schedule, true),
                         optimizer_factory({}), LossKind::BCEDice);
  CHECK(graph.describe().find("CUDA graphs") != std::string::npos);
  int64_t replays = 0;
  for (size_t k = 0; k < order.size(); ++k) {
    CAPTURE(k);
    if (k == 4) {  // validation between replays: eval mode runs eagerly, on the graph's weights
      eager.set_training(false);
      graph.set_training(false);
      CHECK(same_bits(eager.infer(full.images), graph.infer(full.images)));
      eager.set_training(true);
      graph.set_training(true);
    }
    const double le = eager.step(eager.place(*order[k]));
    const double lg = graph.step(graph.place(*order[k]));
    CHECK(std::memcmp(&le, &lg, sizeof le) == 0);
    CHECK(graph.pipeline().graph_captured() == (k >= 2));  // captured, not fallen back
    if (k >= 2 && order[k] != &short_batch) ++replays;     // the short batch: eager
    CHECK(graph.pipeline().graph_replays() == replays);
    CHECK(graph.live_micro_batches() == eager.live_micro_batches());
    CHECK(graph.pipeline().transfers().size() == eager.pipeline().transfers().size());
  }
  check_same_state(eager.model(), graph.model());
}

}  // namespace

// Two stages on one GPU and, where two are visible, on two; GPipe in float32 NCHW and 1F1B in
// bf16 NHWC on each. A case each, each under the per-test time bound on the emulator.
TEST_CASE("a pipeline step replayed as a CUDA graph equals the eager pipeline step, bit for bit: one GPU") {
  const auto devices = pipeline_placements().at(0);
  pipeline_graph_equals_eager(devices, Schedule::GPipe, false);
}
TEST_CASE("a pipeline step replayed as a CUDA graph equals the eager pipeline step, bit for bit: one GPU, 1F1B") {
  const auto devices = pipeline_placements().at(0);
  pipeline_graph_equals_eager(devices, Schedule::OneFOneB, true);
}
TEST_CASE("a pipeline step replayed as a CUDA graph equals the eager pipeline step, bit for bit: two GPUs") {
  const auto placements = pipeline_placements();
  if (placements.size() > 1) pipeline_graph_equals_eager(placements[1], Schedule::GPipe, false);
}
TEST_CASE("a pipeline step replayed as a CUDA graph equals the eager pipeline step, bit for bit: two GPUs, 1F1B") {
  const auto placements = pipeline_placements();
  if (placements.size() > 1) pipeline_graph_equals_eager(placements[1], Schedule::OneFOneB, true);
}

TEST_CASE("a pipeline step replayed as a CUDA graph takes no GPU memory from the system") {
  SyntheticSegmentation data(64, 2);
  const Batch b = data.batch({0, 1, 2, 3});
  for (const auto& devices : pipeline_placements()) {
    CAPTURE(devices[1].str());
    PipelineStrategy s(gpu_model(true), two_stages(devices[0], devices[1], Schedule::GPipe, true),
                       optimizer_factory({}), LossKind::BCEDice);
    CHECK(system_allocations_after_warmup(s, b, 4, 5, [&] {
            size_t n = cuda::device_memory_stats(0).system_allocations;
            if (devices[1].index != 0) n += cuda::device_memory_stats(devices[1].index).system_allocations;
            return n;
          }) == 0);
    CHECK(s.pipeline().graph_captured());
  }
}

#ifdef UNETCU_CUDA_EMU
namespace {

// The CUDA emulator refuses the capture's N-th node (UNETCU_EMU_FAIL_CAPTURE_AT), as a driver
// refuses an operation a graph cannot hold: one stage thread's call fails inside the capture,
// the other's later calls into the invalidated capture fail too, and no stage may have run any
// of its work for real (the batch-norm statistics would show it).
void pipeline_capture_refused_at(const char* at) {
  CAPTURE(at);
  struct Unset {
    ~Unset() { unsetenv("UNETCU_EMU_FAIL_CAPTURE_AT"); }
  } unset;
  SyntheticSegmentation data(64, 5);
  const Batch full = data.batch({0, 1, 2, 3}), other = data.batch({4, 5, 6, 7});
  setenv("UNETCU_EMU_FAIL_CAPTURE_AT", at, 1);
  PipelineStrategy eager(gpu_model(false), two_stages(Device::cuda(0), Device::cuda(0), Schedule::GPipe, false),
                         optimizer_factory({}), LossKind::BCEDice);
  PipelineStrategy graph(gpu_model(false), two_stages(Device::cuda(0), Device::cuda(0), Schedule::GPipe, true),
                         optimizer_factory({}), LossKind::BCEDice);
  for (int k = 0; k < 5; ++k) {
    CAPTURE(k);
    const Batch& b = k % 2 ? other : full;
    const double le = eager.step(eager.place(b));
    const double lg = graph.step(graph.place(b));
    CHECK(std::memcmp(&le, &lg, sizeof le) == 0);
  }
  CHECK_FALSE(graph.pipeline().graph_captured());
  CHECK(graph.pipeline().graph_replays() == 0);
  CHECK(graph.describe().find("CUDA graphs") == std::string::npos);  // it says it runs eagerly
  check_same_state(eager.model(), graph.model());
}

}  // namespace

// At the first node, early in the first stage's forward, and deep in the step (a case each).
TEST_CASE("a pipeline capture refused midway says so, and training goes on eagerly with the eager bits: first node") {
  pipeline_capture_refused_at("1");
}
TEST_CASE("a pipeline capture refused midway says so, and training goes on eagerly with the eager bits: node 40") {
  pipeline_capture_refused_at("40");
}
TEST_CASE("a pipeline capture refused midway says so, and training goes on eagerly with the eager bits: node 300") {
  pipeline_capture_refused_at("300");
}
#endif

namespace {

Batch pinned(const Batch& b) {
  Batch p{Tensor::empty_pinned(b.images.shape(), b.images.dtype()),
          Tensor::empty_pinned(b.masks.shape(), b.masks.dtype())};
  p.images.copy_(b.images);
  p.masks.copy_(b.masks);
  return p;
}

// Whether everything queued on `stream` so far has run.
bool stream_idle(const cuda::Stream& stream) {
  cuda::Event e(stream.device());
  e.record(stream.get());
  const cudaError_t r = cudaEventQuery(e.get());
  cudaGetLastError();  // cudaErrorNotReady is an answer here, not an error
  return r == cudaSuccess;
}

}  // namespace

TEST_CASE("a pipeline's batch placed ahead uploads beside the step before it, which does not wait for it") {
  // A pipeline's batch may be placed before the step before it is queued (the epoch loop does
  // so for a pipeline across processes, whose step waits for its stage): the copies run beside
  // step s, and only step s+1's streams wait for them. Here the upload streams are held behind
  // a gate while step s runs: a step that waited
  // for the next batch's uploads would end only once the safeguard below opened the gate,
  // after 120 s. The batches are in pinned memory, as the loader makes them for a GPU (a copy
  // from pageable memory makes the host wait for it).
  SyntheticSegmentation data(64, 33);
  const Batch first = pinned(data.batch({0, 1, 2, 3})), second = pinned(data.batch({4, 5, 6, 7}));
  for (const auto& devices : pipeline_placements()) {
    CAPTURE(devices[1].str());
    const PipelineOptions o = two_stages(devices[0], devices[1], Schedule::OneFOneB, false);
    PipelineStrategy now(gpu_model(false), o, optimizer_factory({}), LossKind::BCEDice);
    const double want_first = now.step(now.place(first));
    const double want_second = now.step(now.place(second));

    PipelineStrategy ahead(gpu_model(false), o, optimizer_factory({}), LossKind::BCEDice);
    const PlacedBatch placed_first = ahead.place(first);
    StreamGate gate;
    OpenAtExit open_at_exit{gate};  // the upload streams live on (the device's own)
    for (const Device& d : devices) gate.hold(cuda::upload_stream(d.index));
    const PlacedBatch placed_second = ahead.place(second);
    double got_first = 0;
    bool stepped_while_held = false;
    {
      Safeguard safeguard({&gate}, 120);
      got_first = ahead.step(placed_first);
      stepped_while_held = !gate.open;
    }
    for (const Device& d : devices) {  // the gate's host functions have returned
      cuda::DeviceGuard on(d.index);
      CUDA_CHECK(cudaStreamSynchronize(cuda::upload_stream(d.index).get()));
    }
    CHECK(stepped_while_held);
    CHECK(got_first == want_first);  // the same kernels on the same data: the same bits
    CHECK(ahead.step(placed_second) == want_second);
    check_same_state(now.model(), ahead.model());
  }
}

TEST_CASE("a pipeline step is queued: it returns before its stages' streams run it, and reads of the model wait") {
  // The stages' streams are held behind a gate while two steps are queued (eagerly, and as
  // replays of the captured graph): each returns with its work still held. Reading the model
  // then waits for the streams (the gate opens a second later), and the losses, once read, and
  // the state equal a twin's that stepped through step() (whose loss, once read, finds every
  // stage's stream done: the last stage's stream joins the others'). A step that waited for
  // its stages would return only when the safeguard opened the gate, after 60 s; a model()
  // that did not wait would read the parameters before the held steps changed them.
  SyntheticSegmentation data(64, 35);
  std::vector<Batch> batches;
  for (int k = 0; k < 5; ++k) batches.push_back(pinned(data.batch({4 * k, 4 * k + 1, 4 * k + 2, 4 * k + 3})));
  // Eagerly on one GPU's two streams; replayed on two GPUs where there are two (the graph's
  // launch then waits for the other GPU's stream, and the last stage's for the first's).
  const auto placements = pipeline_placements();
  for (bool graphs : {false, true}) {
    const std::vector<Device>& devices = graphs ? placements.back() : placements.front();
    CAPTURE(graphs);
    CAPTURE(devices[1].str());
    const PipelineOptions o = two_stages(devices[0], devices[1], Schedule::OneFOneB, graphs);
    // Unheld first: cuDNN's algorithm search waits for its stream, and the graph's capture
    // (third step) for every stage's.
    const int unheld = graphs ? 3 : 1, steps = unheld + 2;
    PipelineStrategy twin(gpu_model(false), o, optimizer_factory({}), LossKind::BCEDice);
    std::vector<double> want;
    for (int k = 0; k < steps; ++k) {
      want.push_back(twin.step(twin.place(batches[size_t(k)])));
      for (int s = 0; s < 2; ++s) CHECK(stream_idle(*twin.pipeline().stream(s)));
    }

    StreamGate gate;  // outlives the streams (their host functions)
    PipelineStrategy queued(gpu_model(false), o, optimizer_factory({}), LossKind::BCEDice);
    OpenAtExit open_at_exit{gate};  // before the streams go
    CHECK_FALSE(queued.places_ahead());
    for (int k = 0; k < unheld; ++k) CHECK(queued.step(queued.place(batches[size_t(k)])) == want[size_t(k)]);
    CHECK(queued.pipeline().graph_captured() == graphs);
    std::vector<PlacedBatch> placed;
    for (int k = unheld; k < steps; ++k) placed.push_back(queued.place(batches[size_t(k)]));
    for (int s = 0; s < 2; ++s) gate.hold(*queued.pipeline().stream(s));
    std::vector<StepLoss> losses;
    bool queued_while_held = false;
    {
      Safeguard safeguard({&gate}, 60);
      for (const PlacedBatch& p : placed) losses.push_back(queued.step_async(p));
      queued_while_held = !gate.open;
      Safeguard later({&gate}, 1);  // opens it a second from now: model() waits for that
      check_same_state(twin.model(), queued.model());
    }
    CHECK(queued_while_held);
    for (size_t i = 0; i < losses.size(); ++i) CHECK(losses[i].get() == want[size_t(unheld) + i]);
    CHECK(queued.pipeline().graph_replays() == twin.pipeline().graph_replays());
  }
}

TEST_CASE("a replayed pipeline step's launch waits for every stage's stream") {
  // Three stages on one GPU's three streams: a replay runs every stage's nodes from the first
  // stage's stream, so it must wait for what the middle stage's stream still has queued (the
  // step before's optimizer). That stream is held behind a gate while a replay is queued: the
  // first stage's stream must not get past the launch until the gate opens (watched for 3 s;
  // a launch that waited only for the last stage's stream, where the masks are copied, runs
  // the whole replay meanwhile). Then the losses and the state equal a twin's.
  SyntheticSegmentation data(64, 37);
  std::vector<Batch> batches;
  for (int k = 0; k < 4; ++k) batches.push_back(pinned(data.batch({4 * k, 4 * k + 1, 4 * k + 2, 4 * k + 3})));
  PipelineOptions o = two_stages(Device::cuda(0), Device::cuda(0), Schedule::GPipe, true);
  o.devices.push_back(Device::cuda(0));
  o.cuts = cli::parse_cuts("layer2,layer4");
  PipelineStrategy twin(gpu_model(false), o, optimizer_factory({}), LossKind::BCEDice);
  std::vector<double> want;
  for (const Batch& b : batches) want.push_back(twin.step(twin.place(b)));

  StreamGate gate;  // outlives the streams (their host functions)
  PipelineStrategy held(gpu_model(false), o, optimizer_factory({}), LossKind::BCEDice);
  OpenAtExit open_at_exit{gate};  // before the streams go
  for (int k = 0; k < 3; ++k) CHECK(held.step(held.place(batches[size_t(k)])) == want[size_t(k)]);
  REQUIRE(held.pipeline().graph_captured());
  const PlacedBatch last = held.place(batches[3]);
  gate.hold(*held.pipeline().stream(1));
  const StepLoss loss = held.step_async(last);
  bool first_ran = false;
  for (int i = 0; i < 30 && !first_ran; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    first_ran = stream_idle(*held.pipeline().stream(0));
  }
  gate.open = true;
  CHECK_FALSE(first_ran);
  CHECK(loss.get() == want[3]);
  CHECK(held.pipeline().graph_replays() == twin.pipeline().graph_replays());
  check_same_state(twin.model(), held.model());
}

TEST_CASE("pinned memory freed while a capture uses it is held until the graph is gone") {
  // An upload from a pinned buffer captured into a graph, the buffer freed inside the capture
  // (as a loader's batch could be). An event recorded for it on the capturing stream would be
  // a node of the graph, and the pinned pool's next allocation would query it
  // (cudaErrorCapturedEvent); and every replay reads the buffer's address. So the block is
  // handed out again only once the graph is destroyed.
  const size_t bytes = 1 << 12;
  void* host = cuda::pinned_alloc(bytes);
  std::memset(host, 1, bytes);
  Tensor dev = Tensor::empty({int64_t(bytes / 4)}, DType::F32, Device::cuda(0));
  // Allocations of the same size take the pool's ready cached blocks first, oldest first.
  const auto next_block_is_host = [&] {
    cuda::synchronize(0);
    void* p = cuda::pinned_alloc(bytes);
    cuda::pinned_free(p);
    return p == host;
  };
  {
    cuda::Graph graph = cuda::Graph::capture(0, [&] {
      cuda::copy(dev.raw(), Device::cuda(0), host, Device::cpu(), bytes, /*src_pinned=*/true);
      cuda::pinned_free(host);
      void* during = cuda::pinned_alloc(bytes);  // the held block is not handed out
      CHECK(during != host);
      cuda::pinned_free(during);
    });
    REQUIRE(graph.valid());
    CHECK_FALSE(next_block_is_host());  // queries no captured event; the graph still reads it
    graph.launch();
    CHECK_FALSE(next_block_is_host());
  }
  // The graph is gone: the block is the pool's again, cached after the one used meanwhile.
  cuda::synchronize(0);
  void* first = cuda::pinned_alloc(bytes);
  void* second = cuda::pinned_alloc(bytes);
  CHECK((first == host || second == host));
  cuda::pinned_free(first);
  cuda::pinned_free(second);
}

namespace {

// Every block recomputed in its backward, eager and (after two eager steps) as a CUDA graph:
// the bits of the step that keeps every activation.
void recompute_equals_plain(bool mixed) {
  CAPTURE(mixed);
  SyntheticSegmentation data(64, 3);
  const Batch a = data.batch({0, 1, 2, 3}), b = data.batch({4, 5, 6, 7});
  UNetConfig again_cfg = gpu_model(mixed);
  again_cfg.recompute.assign(UNet::kBlocks, true);
  SingleDeviceStrategy plain(gpu_model(mixed), Placement{{}, 0, false, 0}, optimizer_factory({}), LossKind::BCEDice);
  SingleDeviceStrategy again(again_cfg, Placement{{}, 0, false, 0}, optimizer_factory({}), LossKind::BCEDice);
  SingleDeviceStrategy graph(again_cfg, Placement{{}, 0, true, 0}, optimizer_factory({}), LossKind::BCEDice);
  const Batch* order[] = {&a, &b, &a, &b};
  for (size_t k = 0; k < 4; ++k) {
    CAPTURE(k);
    const double lp = plain.step(plain.place(*order[k]));
    const double la = again.step(again.place(*order[k]));
    const double lg = graph.step(graph.place(*order[k]));
    CHECK(std::memcmp(&lp, &la, sizeof lp) == 0);
    CHECK(std::memcmp(&lp, &lg, sizeof lp) == 0);
    CHECK(graph.graph_captured() == (k >= 2));
  }
  check_same_state(plain.model(), again.model());
  check_same_state(plain.model(), graph.model());
}

}  // namespace

TEST_CASE("recomputed blocks give the step's bits on a GPU, eager and as a CUDA graph: float32 NCHW") {
  recompute_equals_plain(false);
}
TEST_CASE("recomputed blocks give the step's bits on a GPU, eager and as a CUDA graph: bf16 NHWC") {
  recompute_equals_plain(true);
}
