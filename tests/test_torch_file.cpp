// The torch.save reader (engine/torch_file.h) on real torch.save outputs (tests/corpus/torch/
// seed_*.pth, written by PyTorch 1.13: tests/corpus/make_torch_seeds.py), and the encoder
// weights loader (models/encoder_weights.h): names, shapes, SMP's first-convolution adaptation
// and its messages. The malformed archives' refusals: tests/corpus/torch/bad_* (replayed by
// tests/test_corpus.cpp), the messages of a few here.
#include <cstring>
#include <filesystem>
#include <string>

#include "engine/torch_file.h"
#include "models/encoder_weights.h"
#include "testing.h"

using namespace unetcu;

namespace {

std::string corpus(const std::string& name) { return std::string(UNETCU_SOURCE_DIR) + "/tests/corpus/torch/" + name; }

std::vector<double> values(const SafeTensor& t) {
  std::vector<double> out;
  const size_t n = t.dtype == "F64" || t.dtype == "I64" ? 8 : t.dtype == "F32" || t.dtype == "I32" ? 4 : 1;
  for (size_t i = 0; i + n <= t.data.size(); i += n) {
    const char* p = t.data.data() + i;
    if (t.dtype == "F32") {
      float v;
      std::memcpy(&v, p, 4);
      out.push_back(v);
    } else if (t.dtype == "F64") {
      double v;
      std::memcpy(&v, p, 8);
      out.push_back(v);
    } else if (t.dtype == "I64") {
      int64_t v;
      std::memcpy(&v, p, 8);
      out.push_back(double(v));
    } else if (t.dtype == "I32") {
      int32_t v;
      std::memcpy(&v, p, 4);
      out.push_back(v);
    } else {
      out.push_back(uint8_t(*p));
    }
  }
  return out;
}

}  // namespace

TEST_CASE("torch.save archives: a module's state_dict, views of one storage, every dtype, big-endian") {
  // A Conv2d(3, 4, 3) + BatchNorm2d(4) state_dict: names in order, shapes, the counter.
  const SafeTensors m = read_torch_file(corpus("seed_conv_bn.pth"));
  REQUIRE(m.size() == 6);
  CHECK(m.at("0.weight").shape == Shape{4, 3, 3, 3});
  CHECK(m.at("0.weight").dtype == "F32");
  CHECK(m.at("1.num_batches_tracked").dtype == "I64");
  CHECK(m.at("1.num_batches_tracked").shape.empty());
  CHECK(values(m.at("1.running_var")) == std::vector<double>{1, 1, 1, 1});
  // The same archive written big-endian (byteorder "big", every element swapped): equal.
  const SafeTensors big = read_torch_file(corpus("seed_big_endian.pth"));
  REQUIRE(big.size() == m.size());
  for (const auto& [name, t] : m) {
    CAPTURE(name);
    CHECK(big.at(name).data == t.data);
  }
  // Views: a = base[2:8].view(2, 3), b = base[10:14] of base = arange(24); t = x.t(), strided.
  const SafeTensors v = read_torch_file(corpus("seed_views.pth"));
  CHECK(values(v.at("a")) == std::vector<double>{2, 3, 4, 5, 6, 7});
  CHECK(v.at("a").shape == Shape{2, 3});
  CHECK(values(v.at("b")) == std::vector<double>{10, 11, 12, 13});
  CHECK(v.at("t").shape == Shape{5, 3});
  CHECK(v.at("empty").shape == Shape{0, 3});
  CHECK(v.at("empty").data.empty());
  CHECK(v.at("scalar").shape.empty());
  CHECK(values(v.at("scalar")) == std::vector<double>{2.5});
  // Every dtype: float16 and bfloat16 widened to float32 exactly; integers keep their bytes.
  const SafeTensors d = read_torch_file(corpus("seed_dtypes.pth"));
  CHECK(d.at("f64").dtype == "F64");
  CHECK(d.at("f16").dtype == "F32");
  CHECK(d.at("bf16").dtype == "F32");
  CHECK(values(d.at("i64")) == std::vector<double>{7});
  CHECK(values(d.at("i32")) == std::vector<double>{0, 1, 2});
  CHECK(values(d.at("u8")) == std::vector<double>{0, 1, 2, 3, 4});
  CHECK(d.at("bool").dtype == "BOOL");
  // A training checkpoint gives its state_dict; parameters (_rebuild_parameter) their values.
  const SafeTensors c = read_torch_file(corpus("seed_checkpoint.pth"));
  CHECK(c.size() == 2);
  CHECK(c.at("weight").shape == Shape{3, 2});
  const SafeTensors p = read_torch_file(corpus("seed_parameters.pth"));
  CHECK(p.at("weight").shape == Shape{2, 3});
  CHECK(p.at("bias").shape == Shape{2});
}

TEST_CASE("torch.save archives refused with one line: a forbidden global, legacy, truncated, TorchScript") {
  CHECK_THROWS_WITH(read_torch_file(corpus("bad_global_os_system.pth")),
                    doctest::Contains("names the global 'os.system', which no state_dict needs; refused without "
                                      "running anything"));
  CHECK_THROWS_WITH(read_torch_file(corpus("bad_global_builtins_eval.pth")),
                    doctest::Contains("'builtins.eval'"));
  CHECK_THROWS_WITH(read_torch_file(corpus("bad_legacy_format.pth")),
                    doctest::Contains("legacy torch.save format (before PyTorch 1.6); re-save it"));
  CHECK_THROWS_WITH(read_torch_file(corpus("bad_truncated_half.pth")),
                    doctest::Contains("is not a readable zip archive"));
  CHECK_THROWS_WITH(read_torch_file(corpus("bad_torchscript.pth")), doctest::Contains("TorchScript"));
  CHECK_THROWS_WITH(read_torch_file(corpus("bad_tensor_past_storage.pth")),
                    doctest::Contains("past the end of its storage"));
  CHECK_THROWS_WITH(read_torch_file(corpus("bad_compressed.pth")), doctest::Contains("is compressed"));
  CHECK_THROWS_WITH(read_torch_file(corpus("bad_storage_short.pth")), doctest::Contains("bytes, its storage"));
  CHECK_THROWS_WITH(read_torch_file(corpus("nonexistent.pth")), doctest::Contains("cannot be opened"));
}

TEST_CASE("SMP's patch_first_conv: 1 channel sums the three, N channels cycle them scaled by 3 / N") {
  SafeTensor w{"F64", {2, 3, 1, 1}, std::vector<char>(6 * 8)};
  const double in[6] = {1, 2, 3, 10, 20, 30};
  std::memcpy(w.data.data(), in, sizeof in);
  CHECK(values(adapt_first_conv(w, 1)) == std::vector<double>{6, 60});
  CHECK(adapt_first_conv(w, 1).shape == Shape{2, 1, 1, 1});
  // 4 channels: 0, 1, 2, 0 of each output, times 3 / 4.
  CHECK(values(adapt_first_conv(w, 4)) == std::vector<double>{0.75, 1.5, 2.25, 0.75, 7.5, 15, 22.5, 7.5});
  CHECK(values(adapt_first_conv(w, 2)) == std::vector<double>{1.5, 3, 15, 30});
}
