// Checkpoints: safetensors round trip, bit-exact resume, encoder-only loading, and a reader
// that refuses truncated, corrupt or lying files with a message instead of reading past them.
#include <sys/stat.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include "train/run.h"
#include "engine/checkpoint.h"
#include "data/synthetic.h"
#include "engine/random.h"
#include "models/unet.h"
#include "testing.h"
#include "train_runs.h"

using namespace unetcu;

namespace {

std::string temp_path(const std::string& name) { return "ckpt_test_" + name + ".safetensors"; }

using testing::slurp;

void spit(const std::string& path, const std::vector<char>& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), std::streamsize(bytes.size()));
}

UNetConfig small(uint64_t seed) {
  UNetConfig c;
  c.width_divisor = 16;
  c.seed = seed;
  return c;
}

}  // namespace

TEST_CASE("checkpoint: save and load give bit-identical state and outputs, SMP names") {
  UNet a(small(1)), b(small(2));
  a.train();
  SyntheticSegmentation data(64, 1);
  a.forward(data.batch({0, 1}).images);  // move the BN statistics and counters off their start
  const std::string path = temp_path("roundtrip");
  save_checkpoint(path, a, {}, 3);
  CHECK(load_checkpoint(path, b, {}) == 3);
  const auto sa = a.state(), sb = b.state();
  for (size_t i = 0; i < sa.size(); ++i) {
    CAPTURE(sa[i].name);
    if (sa[i].counter)
      CHECK(*sa[i].counter == *sb[i].counter);
    else
      CHECK(std::memcmp(sa[i].tensor.raw(), sb[i].tensor.raw(), sa[i].tensor.nbytes()) == 0);
  }
  a.eval(), b.eval();
  const Tensor x = data.batch({5}).images;
  CHECK(a.forward(x).to_vector() == b.forward(x).to_vector());
  const SafeTensors st = read_safetensors(path);
  CHECK(st.size() == a.state().size());
  CHECK(st.count("encoder.layer1.0.conv1.weight") == 1);
  CHECK(st.at("encoder.bn1.num_batches_tracked").dtype == "I64");
  std::remove(path.c_str());
  std::remove((path + ".train").c_str());
}

TEST_CASE("checkpoint: resuming after epoch 1 equals an uninterrupted run, bit for bit") {
  testing::check_resume_equals_whole(testing::cpu_run(2, 64, 16, 8, 16), "ckpt_test");
}

TEST_CASE("checkpoint: --init-encoder loads the encoder and nothing else") {
  UNet src(small(1)), dst(small(2)), ref(small(2));
  const std::string path = temp_path("encoder");
  write_safetensors(path, model_state(src));
  load_model_state(dst, read_safetensors(path), path, "encoder.");
  const auto s = src.state(), d = dst.state(), r = ref.state();
  int enc = 0, dec = 0;
  for (size_t i = 0; i < s.size(); ++i) {
    if (!s[i].tensor.defined()) continue;
    if (s[i].name.rfind("encoder.", 0) == 0) {
      CHECK(std::memcmp(s[i].tensor.raw(), d[i].tensor.raw(), s[i].tensor.nbytes()) == 0);
      ++enc;
    } else {
      CHECK(std::memcmp(r[i].tensor.raw(), d[i].tensor.raw(), r[i].tensor.nbytes()) == 0);
      ++dec;
    }
  }
  CHECK(enc > 100);
  CHECK(dec > 20);
  std::remove(path.c_str());
}

TEST_CASE("checkpoint: bad files are refused with a message, never read out of bounds") {
  UNet model(small(1));
  const std::string good = temp_path("good"), badp = temp_path("bad");
  save_checkpoint(good, model, {}, 1);
  const std::vector<char> bytes = slurp(good);
  auto refused = [&](const std::vector<char>& b, const char* why) {
    spit(badp, b);
    CAPTURE(why);
    CHECK_THROWS_AS(load_model_state(model, read_safetensors(badp), badp), Error);
  };
  // Truncated anywhere.
  for (size_t cut : {size_t(0), size_t(5), size_t(8), size_t(20), bytes.size() / 3, bytes.size() - 1})
    refused(std::vector<char>(bytes.begin(), bytes.begin() + std::ptrdiff_t(cut)), "truncated");
  // A header length pointing past the end.
  std::vector<char> b = bytes;
  b[6] = 0x7f;
  refused(b, "huge header length");
  // Not JSON.
  b = bytes;
  b[8] = '[';
  b[9] = '}';
  refused(b, "bad JSON");
  // Lying headers: rewrite one entry.
  auto with_header = [&](const std::string& from, const std::string& to) {
    std::string text(bytes.begin() + 8, bytes.end());
    const auto pos = text.find(from);
    REQUIRE(pos != std::string::npos);
    text.replace(pos, from.size(), to);
    uint64_t n = 0;
    for (int i = 0; i < 8; ++i) n |= uint64_t(static_cast<unsigned char>(bytes[i])) << (8 * i);
    n += to.size() - from.size();
    std::string all;
    for (int i = 0; i < 8; ++i) all += char((n >> (8 * i)) & 0xFF);
    all += text;
    return std::vector<char>(all.begin(), all.end());
  };
  refused(with_header("\"dtype\":\"F32\"", "\"dtype\":\"BF16\""), "unsupported dtype");
  refused(with_header("\"shape\":[1]", "\"shape\":[2]"), "bytes disagree with the shape");
  refused(with_header("\"data_offsets\":[0,", "\"data_offsets\":[99999999999,"), "offsets out of range");
  refused(with_header("encoder.conv1.weight", "encoder.conv1.wheat"), "a name the model lacks");
  // Random corruption: every outcome is either a load or an Error, never a crash.
  Rng rng(5);
  int refusals = 0;
  for (int trial = 0; trial < 300; ++trial) {
    b = bytes;
    const int flips = 1 + int(rng.below(4));
    for (int k = 0; k < flips; ++k) b[size_t(rng.below(int64_t(std::min<size_t>(b.size(), 4096))))] ^= char(1 + rng.below(255));
    spit(badp, b);
    try {
      load_model_state(model, read_safetensors(badp), badp);
    } catch (const Error&) {
      ++refusals;
    }
  }
  CHECK(refusals > 0);
  CHECK_THROWS_WITH(read_safetensors("no_such_file.safetensors"), doctest::Contains("cannot be opened"));
  // A shape whose element count overflows 64 bits is refused, not wrapped around.
  refused(with_header("\"shape\":[1]", "\"shape\":[4294967296,4294967296]"), "shape overflow");
  // A model file and a .train file from different epochs (a save interrupted between the two
  // renames) are refused.
  save_checkpoint(good, model, {}, 2);
  const std::vector<char> train2 = slurp(good + ".train");
  save_checkpoint(good, model, {}, 3);
  spit(good + ".train", train2);
  CHECK_THROWS_WITH(load_checkpoint(good, model, {}), doctest::Contains("an interrupted save"));
  for (const auto& p : {good, good + ".train", badp}) std::remove(p.c_str());
}

TEST_CASE("checkpoint: a save stopped at any stage leaves a complete pair (old or new)") {
  const std::string path = temp_path("crash");
  auto clean = [&] {
    for (const auto& p : {path, path + ".train", path + ".tmp", path + ".train.tmp"}) std::remove(p.c_str());
  };
  for (int stage = 1; stage <= 4; ++stage) {
    CAPTURE(stage);
    clean();
    UNet model(small(1));
    auto opt = optimizer_factory({})(model.parameters());
    const double before = model.parameters()[0].at(0);
    save_checkpoint(path, model, {opt.get()}, 1);  // a complete pair from epoch 1
    model.parameters()[0].set(0, 42.0);             // what the next save holds
    // The save of epoch 2 stops after `stage`, as a kill there would leave it.
    set_checkpoint_save_hook([stage](int s) {
      if (s == stage) throw std::runtime_error("killed");
    });
    CHECK_THROWS_AS(save_checkpoint(path, model, {opt.get()}, 2), std::runtime_error);
    set_checkpoint_save_hook({});
    UNet loaded(small(9));
    auto lopt = optimizer_factory({})(loaded.parameters());
    int epoch = -1;
    try {
      epoch = load_checkpoint(path, loaded, {lopt.get()});
    } catch (const Error& e) {
      FAIL("a stopped save left no loadable pair: ", e.what());
    }
    if (stage <= 2) {  // nothing renamed yet: the old pair
      CHECK(epoch == 1);
      CHECK(loaded.parameters()[0].at(0) == before);
    } else {  // stage 3: the new .train beside the old model; the model rolled forward
      CHECK(epoch == 2);
      CHECK(loaded.parameters()[0].at(0) == 42.0);
    }
  }
  clean();
}

TEST_CASE("checkpoint: damage is found and named, stored values are range-checked") {
  UNet model(small(1));
  auto opt = optimizer_factory({})(model.parameters());
  const std::string path = temp_path("damage");
  save_checkpoint(path, model, {opt.get()}, 3);
  const std::vector<char> good = slurp(path);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(static_cast<unsigned char>(good[i])) << (8 * i);
  auto refused_with = [&](std::vector<char> bytes, const char* why) {
    spit(path, bytes);
    CHECK_THROWS_WITH(load_model_state(model, read_safetensors(path), path), doctest::Contains(why));
  };
  // A flipped bit in a tensor's bytes: the tensor is named.
  std::vector<char> b = good;
  b[b.size() - 3] ^= 0x10;
  refused_with(b, "is damaged");
  // A header length one byte short: the data would shift by a byte.
  b = good;
  const uint64_t shorter = n - 1;
  for (int i = 0; i < 8; ++i) b[i] = char((shorter >> (8 * i)) & 0xFF);
  spit(path, b);
  CHECK_THROWS_AS(read_safetensors(path), Error);
  // Overlapping and gapped offsets.
  {
    SafeTensors t;
    t["a"] = {"F32", {2}, std::vector<char>(8, 0)};
    t["b"] = {"F32", {2}, std::vector<char>(8, 0)};
    write_safetensors(path, t);
    std::vector<char> bytes = slurp(path);
    std::string text(bytes.begin(), bytes.end());
    const std::string second = "\"data_offsets\":[8,16]";
    const auto pos = text.find(second);
    REQUIRE(pos != std::string::npos);
    std::string overlap = text, gap = text;
    overlap.replace(pos, second.size(), "\"data_offsets\":[4,12]");
    spit(path, std::vector<char>(overlap.begin(), overlap.end()));
    CHECK_THROWS_WITH(read_safetensors(path), doctest::Contains("overlaps"));
    gap += "12345678";  // bytes after the last entry
    spit(path, std::vector<char>(gap.begin(), gap.end()));
    CHECK_THROWS_WITH(read_safetensors(path), doctest::Contains("cover 16 of the 24"));
  }
  // Not a regular file: refused without reading (a FIFO would block, /dev/zero never ends).
  CHECK_THROWS_WITH(read_safetensors("/dev/zero"), doctest::Contains("not a regular file"));
  CHECK_THROWS_WITH(read_safetensors("."), doctest::Contains("not a regular file"));
  const std::string fifo = temp_path("fifo");
  std::remove(fifo.c_str());
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  CHECK_THROWS_WITH(read_safetensors(fifo), doctest::Contains("not a regular file"));
  std::remove(fifo.c_str());
  // Stored values out of range: epoch, counters.
  for (const char* epoch : {"2147483647", "-5", "x"}) {
    CAPTURE(epoch);
    write_safetensors(path, model_state(model));
    write_safetensors(path + ".train", {}, {{"epoch", epoch}});
    CHECK_THROWS_AS(load_checkpoint(path, model, {}), Error);
  }
  SafeTensors st = model_state(model);
  const int64_t minus_one = -1;
  std::memcpy(st.at("encoder.bn1.num_batches_tracked").data.data(), &minus_one, 8);
  write_safetensors(path, st);
  std::remove((path + ".train").c_str());
  CHECK_THROWS_WITH(load_checkpoint(path, model, {}), doctest::Contains("impossible count"));
  // A refused file leaves the model as it was.
  const auto before = model.parameters()[0].to_vector();
  SafeTensors nan_state = model_state(model);
  float nan = std::nanf("");
  std::memcpy(nan_state.at("segmentation_head.0.bias").data.data(), &nan, 4);
  write_safetensors(path, nan_state);
  CHECK_THROWS_WITH(load_checkpoint(path, model, {}), doctest::Contains("not finite"));
  CHECK(model.parameters()[0].to_vector() == before);
  for (const auto& p : {path, path + ".train"}) std::remove(p.c_str());
}

TEST_CASE("checkpoint: the run's settings travel in the model file's metadata, 256 class names included") {
  UNet a(small(1));
  const std::string path = temp_path("settings");
  std::string names;
  for (int c = 0; c < 256; ++c) names += (c ? "," : "") + std::string("class_name_") + std::to_string(c);
  const CheckpointSettings settings{{"classes", "256"}, {"class_names", names}, {"width_divisor", "16"}};
  save_checkpoint(path, a, {}, 1, 0, {}, settings);
  CHECK(read_checkpoint_settings(path) == settings);
  UNet b(small(2));
  CHECK(load_checkpoint(path, b, {}) == 1);  // the settings are metadata only
  CHECK_THROWS_WITH(save_checkpoint(path, a, {}, 1, 0, {}, {{"epoch", "9"}}), doctest::Contains("is reserved"));
}
