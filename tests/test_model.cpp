// The UNet-ResNet34: size, names, shapes (full model), and contract 3: the whole model's
// gradients against finite differences at reduced width in float64.
#include <map>
#include <set>

#include "engine/tape.h"
#include "models/unet.h"
#include "testing.h"

using namespace unetcu;
using namespace unetcu::testing;

TEST_CASE("full UNet-ResNet34: parameter count and state_dict names of segmentation_models_pytorch") {
  UNet model(UNetConfig{});
  CHECK(model.parameter_count() == 24436369);
  const auto state = model.state();
  CHECK(state.size() == 278);
  std::set<std::string> names;
  for (const auto& e : state) names.insert(e.name);
  CHECK(names.size() == state.size());  // unique
  CHECK(state.front().name == "encoder.conv1.weight");
  CHECK(state.back().name == "segmentation_head.0.bias");
  // BN entries in PyTorch order: weight, bias, running_mean, running_var, num_batches_tracked.
  CHECK(state[1].name == "encoder.bn1.weight");
  CHECK(state[3].name == "encoder.bn1.running_mean");
  CHECK(state[5].name == "encoder.bn1.num_batches_tracked");
  CHECK(state[5].counter != nullptr);
  std::map<std::string, Shape> shapes;
  for (const auto& e : state)
    if (e.tensor.defined()) shapes[e.name] = e.tensor.shape();
  CHECK(shapes.at("encoder.conv1.weight") == Shape{64, 3, 7, 7});
  CHECK(shapes.at("encoder.layer1.2.conv2.weight") == Shape{64, 64, 3, 3});
  CHECK(shapes.at("encoder.layer2.0.downsample.0.weight") == Shape{128, 64, 1, 1});
  CHECK(shapes.at("encoder.layer3.5.bn2.running_var") == Shape{256});
  CHECK(shapes.at("encoder.layer4.2.conv1.weight") == Shape{512, 512, 3, 3});
  CHECK(shapes.at("decoder.blocks.0.conv1.0.weight") == Shape{256, 768, 3, 3});
  CHECK(shapes.at("decoder.blocks.0.conv1.1.running_mean") == Shape{256});
  CHECK(shapes.at("decoder.blocks.3.conv1.0.weight") == Shape{32, 128, 3, 3});
  CHECK(shapes.at("decoder.blocks.4.conv2.0.weight") == Shape{16, 16, 3, 3});
  CHECK(shapes.at("segmentation_head.0.weight") == Shape{1, 16, 3, 3});
  CHECK(shapes.at("segmentation_head.0.bias") == Shape{1});
  CHECK(names.count("encoder.layer1.0.downsample.0.weight") == 0);  // layer1 keeps 64 channels
  CHECK(names.count("encoder.fc.weight") == 0);                      // no classifier
  int bn = 0, counters = 0;
  for (const auto& e : state) {
    bn += e.name.size() > 12 && e.name.compare(e.name.size() - 12, 12, "running_mean") == 0;
    counters += e.counter != nullptr;
  }
  CHECK(bn == 46);  // 36 encoder + 10 decoder batch norms
  CHECK(counters == 46);

  // Blocks with skip edges, cuttable between any two.
  const auto& blocks = model.blocks();
  REQUIRE(blocks.size() == 11);
  CHECK(blocks[5].name == "decoder.blocks.0");
  CHECK(blocks[5].inputs == std::vector<int>{4, 3});
  CHECK(blocks[8].inputs == std::vector<int>{7, 0});
  CHECK(blocks[9].inputs == std::vector<int>{8});
}

TEST_CASE("every encoder depth: parameter count, state_dict size and shapes of SMP's Unet(name)") {
  // Counts from segmentation_models_pytorch's Unet(name, classes=1) (tools/pytorch_reference.py
  // builds the same modules; torchvision's resnetN state_dict is its encoder's, fc dropped).
  struct Case {
    EncoderKind kind;
    const char* name;
    int64_t params;
    size_t entries, batch_norms;
    Shape decoder0, last_conv;  // decoder.blocks.0.conv1.0.weight, layer4's last conv
    const char* last_conv_name;
  };
  const Case cases[] = {
      {EncoderKind::ResNet18, "resnet18", 14328209, 182, 30, {256, 768, 3, 3}, {512, 512, 3, 3},
       "encoder.layer4.1.conv2.weight"},
      {EncoderKind::ResNet34, "resnet34", 24436369, 278, 46, {256, 768, 3, 3}, {512, 512, 3, 3},
       "encoder.layer4.2.conv2.weight"},
      {EncoderKind::ResNet50, "resnet50", 32521105, 380, 63, {256, 3072, 3, 3}, {2048, 512, 1, 1},
       "encoder.layer4.2.conv3.weight"},
      {EncoderKind::ResNet101, "resnet101", 51513233, 686, 114, {256, 3072, 3, 3}, {2048, 512, 1, 1},
       "encoder.layer4.2.conv3.weight"},
      {EncoderKind::ResNet152, "resnet152", 67156881, 992, 165, {256, 3072, 3, 3}, {2048, 512, 1, 1},
       "encoder.layer4.2.conv3.weight"},
  };
  for (const Case& k : cases) {
    CAPTURE(k.name);
    CHECK(parse_named(kEncoderNames, "encoder", k.name) == k.kind);
    CHECK(std::string(encoder_name(k.kind)) == k.name);
    UNetConfig cfg;
    cfg.encoder = k.kind;
    UNet model(cfg);
    CHECK(model.parameter_count() == k.params);
    const auto state = model.state();
    CHECK(state.size() == k.entries);
    std::map<std::string, Shape> shapes;
    size_t counters = 0;
    for (const auto& e : state) {
      if (e.tensor.defined()) shapes[e.name] = e.tensor.shape();
      counters += e.counter != nullptr;
    }
    CHECK(counters == k.batch_norms);
    CHECK(shapes.at("decoder.blocks.0.conv1.0.weight") == k.decoder0);
    CHECK(shapes.at(k.last_conv_name) == k.last_conv);
    CHECK(model.blocks().size() == 11);  // the same blocks: cuts and recompute sets are named alike
  }
  // A Bottleneck layer1 changes the channels, so its first block has a downsample.
  UNetConfig r50;
  r50.encoder = EncoderKind::ResNet50;
  r50.width_divisor = 16;
  std::set<std::string> names;
  for (const auto& e : UNet(r50).state()) names.insert(e.name);
  CHECK(names.count("encoder.layer1.0.downsample.0.weight") == 1);
  CHECK(names.count("encoder.layer1.1.downsample.0.weight") == 0);
}

TEST_CASE("initialisation follows torchvision / SMP") {
  UNet model(UNetConfig{});
  std::map<std::string, Tensor> p;
  for (auto& [n, t] : model.named_parameters()) p[n] = t;
  auto stddev = [](const Tensor& t) {
    double s = 0, s2 = 0;
    for (int64_t i = 0; i < t.numel(); ++i) s += t.at(i), s2 += t.at(i) * t.at(i);
    const double m = s / t.numel();
    return std::sqrt(s2 / t.numel() - m * m);
  };
  // Encoder: kaiming normal, fan_out: std sqrt(2 / (512*9)).
  CHECK(stddev(p["encoder.layer4.0.conv2.weight"]) ==
        doctest::Approx(std::sqrt(2.0 / (512 * 9))).epsilon(0.01));
  // Decoder: kaiming uniform, fan_in: bound sqrt(6 / (768*9)), std bound/sqrt(3).
  CHECK(stddev(p["decoder.blocks.0.conv1.0.weight"]) ==
        doctest::Approx(std::sqrt(6.0 / (768 * 9)) / std::sqrt(3.0)).epsilon(0.01));
  CHECK(p["encoder.bn1.weight"].at(5) == 1.0);
  CHECK(p["segmentation_head.0.bias"].at(0) == 0.0);
}

TEST_CASE("full model output shapes at 512x512 and at a non-square size, bad sizes refused") {
  UNet model(UNetConfig{});
  model.eval();
  CHECK(model.forward(Tensor::zeros({1, 3, 512, 512})).shape() == Shape{1, 1, 512, 512});
  CHECK(model.forward(Tensor::zeros({2, 3, 96, 160})).shape() == Shape{2, 1, 96, 160});
  CHECK_THROWS_WITH(model.forward(Tensor::zeros({1, 3, 100, 96})),
                    doctest::Contains("multiples of 32"));
  CHECK_THROWS_WITH(model.forward(Tensor::zeros({1, 1, 64, 64})), doctest::Contains("channels"));
}

TEST_CASE("contract 3: whole UNet gradients against finite differences (width/16, float64)") {
  UNetConfig cfg;
  cfg.width_divisor = 16;
  cfg.dtype = DType::F64;
  cfg.seed = 11;
  UNet model(cfg);
  Rng rng(12);
  Tensor x = random_tensor({2, 3, 64, 64}, rng).set_requires_grad(true);
  // A random subset of parameters, across the encoder, decoder and head.
  std::vector<Tensor> inputs = {x};
  std::vector<std::string> checked;
  const auto params = model.named_parameters();
  for (size_t i = 0; i < params.size(); i += 9) {
    inputs.push_back(params[i].second);
    checked.push_back(params[i].first);
  }
  inputs.push_back(params.back().second);  // the head bias
  CHECK(checked.size() >= 10);
  GradcheckOptions opt;
  opt.max_checks_per_input = 4;
  // The stem's weights move every activation; with ~10^5 relu and max-pool decisions a few
  // perturbations straddle a kink. Skip those, but never more than 10%.
  opt.max_kink_fraction = 0.1;
  const int n = gradcheck([&](const std::vector<Tensor>&) { return model.forward(x); }, inputs, opt);
  CHECK(n >= 40);
}
