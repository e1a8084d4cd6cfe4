// Checkpoints in the safetensors format (the format PyTorch's safetensors package reads):
// an 8-byte little-endian header length, a JSON header naming each tensor's dtype, shape and
// byte range, then the raw little-endian data.
//
//  - The model file holds the model's state with segmentation_models_pytorch's names (278
//    entries for Unet('resnet34'): parameters, BN running statistics, num_batches_tracked as
//    int64 scalars), so `model.load_state_dict(safetensors.torch.load_file(path))` works.
//  - The training state (optimizer moments and step counts, the next epoch) goes to a second
//    file, `<path>.train`, so the model file stays a plain state_dict.
//  - Files are written to `<path>.tmp` and renamed: a crash never leaves half a checkpoint.
//  - The reader checks everything it reads (header length, JSON, dtypes, shapes, byte ranges
//    within the file, the names the model expects) and refuses a bad file with a message
//    naming the file and the problem.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "engine/module.h"
#include "engine/optim.h"

namespace unetcu {

struct SafeTensor {
  std::string dtype;  // "F32", "F64" or "I64"
  Shape shape;
  std::vector<char> data;
};

using SafeTensors = std::map<std::string, SafeTensor>;

void write_safetensors(const std::string& path, const SafeTensors& tensors,
                       const std::map<std::string, std::string>& metadata = {});
// Throws unetcu::Error for a missing, truncated or malformed file.
SafeTensors read_safetensors(const std::string& path,
                             std::map<std::string, std::string>* metadata = nullptr);

// The model's state (parameters, buffers, counters) as safetensors entries, and back. Loading
// requires exactly the model's names and shapes (strict, like load_state_dict), unless
// `prefix` is given: then only entries starting with it are loaded, and all of the model's
// entries with that prefix must be present.
SafeTensors model_state(const Module& model);
void load_model_state(Module& model, const SafeTensors& tensors, const std::string& file,
                      const std::string& prefix = "");

// Model to `path`; the training state to `path + ".train"`: the epoch, the step (steps done
// into the next epoch when a run stopped mid-epoch, else 0) and every optimizer's state, each
// entry named "<optimizer>.<statistic>.<parameter name>" (e.g. "adam.m.encoder.conv1.weight").
// Keyed by name, not position, the state loads into any strategy that trains the same model:
// one device, data parallel (rank 0's optimizer; the others are equal) or pipeline stages
// (each stage's optimizer holds its own parameters). Every optimizer parameter must be a
// parameter of `model`. Each tensor's checksum is in the metadata; the pair of files is
// replaced so that a reader always finds a complete, matching pair (see load_checkpoint).
// `run` holds values of the run kept with the training state (the trainer's record of the
// monitored metric, train/monitor.h): key k is written as "run.k" in the .train file's
// metadata.
using RunRecord = std::map<std::string, std::string>;
// `settings`: how the run was trained (classes, class names, width divisor, image or crop
// size, normalisation, ignore index; apps/ writes them), each a key of the model file's
// metadata beside format, producer, epoch, step, save_id and the checksums (which they may
// not name). PyTorch's safetensors loader ignores metadata.
using CheckpointSettings = std::map<std::string, std::string>;
void save_checkpoint(const std::string& path, const Module& model,
                     const std::vector<Optimizer*>& optimizers, int epoch, int64_t step = 0,
                     const RunRecord& run = {}, const CheckpointSettings& settings = {});
// The settings of a model file (empty for a file written before they were recorded). Throws
// unetcu::Error for a file that cannot be read as safetensors.
CheckpointSettings read_checkpoint_settings(const std::string& path);
// Loads the model and, for each optimizer, the state of each of its parameters; returns the
// epoch stored with the checkpoint (0 when there is no training state file) and the step in
// *step, and the run's values in *run (as written; the reader of each checks it). Everything
// read is checked (checksums, ranges of the epoch, step and counters,
// shapes, finite values) before the model or an optimizer is written. A save that stopped
// between its two renames is completed from its temporary model file.
int load_checkpoint(const std::string& path, Module& model,
                    const std::vector<Optimizer*>& optimizers, int64_t* step = nullptr,
                    RunRecord* run = nullptr);

// Tests: called with 1..4 as save_checkpoint passes each stage (model written to .tmp, .train
// written to .tmp, .train renamed, model renamed); a hook that throws stops the save there,
// as a crash would.
void set_checkpoint_save_hook(std::function<void(int)> hook);

}  // namespace unetcu
