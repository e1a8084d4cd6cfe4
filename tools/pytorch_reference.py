#!/usr/bin/env python3
"""The UNet-ResNet (resnet18 to resnet152) of segmentation_models_pytorch, written out in plain PyTorch with SMP's
module names, to check unetcu against PyTorch.

  pytorch_reference.py golden OUT.safetensors [--width-divisor 16] [--seed 0]
                       [--classes 1] [--ignore-index K] [--encoder resnet34]
      Builds the model (float64, random weights), runs one training forward and backward on a
      fixed random batch with the engine's loss (BCE-with-logits mean + soft Dice over the
      batch, smooth 1) and writes a golden file: the weights under their state_dict names, and
      golden.* entries (input, target, logits, loss, a running mean after the forward, every
      parameter's gradient and every parameter after one torch.optim.Adam step, lr 1e-3).
      tests/test_golden.cpp checks the engine against it. --encoder: resnet18, 34, 50, 101
      or 152 (tests/golden/unet_r18_w16.safetensors and unet_r50_w16.safetensors; the older
      unet_w16.safetensors, resnet34, holds the gradients of six parameters).
      --classes N (N >= 2): a head of N classes, the loss CrossEntropyLoss + SMP's multiclass
      DiceLoss (from logits, smooth 0, eps 1e-7), both with ignore_index K when --ignore-index
      is given. The target's classes are drawn from 0..N-2, so class N-1 is absent from the
      batch (its Dice term is zeroed, SMP's rule); with K, rows 0..3 of image 0 and a random
      ~5% of the pixels are ignored. golden.target is float64 [2,1,H,W]: the class index, -1
      where ignored (the engine's form, whatever K is).
      tests/golden/unet_w16_c3.safetensors: --classes 3 --ignore-index 255.
  pytorch_reference.py check CHECKPOINT.safetensors [--width-divisor 1] [--image-size 64]
                       [--classes N] [--encoder NAME]
      Loads an engine checkpoint into the PyTorch model (strict: every name and shape must
      match) and prints the logits' statistics on a fixed input. The model has N classes: from
      --classes, else from the "classes" entry of the checkpoint's __metadata__, else 1; and
      its encoder from --encoder, else the checkpoint's "encoder", else resnet34.
  pytorch_reference.py export-encoder OUT [--random] [--seed 0] [--dtype float32]
                       [--encoder resnet34] [--format smp|torchvision|pth] [--width-divisor 1]
                       [--golden GOLDEN.safetensors --image-size 64 --in-channels 3]
      Writes torchvision's ResNet weights (--encoder: resnet18 to resnet152; ImageNet, when
      torchvision has them cached or can download them; --random: randomly initialised, no
      download) for unet_train --encoder-weights: --format smp, safetensors under SMP's
      encoder.* names (the fc layer dropped); torchvision, safetensors under torchvision's names
      (fc dropped: the model.safetensors SMP hosts); pth, torch.save of torchvision's
      state_dict, fc included (as torchvision's .pth files). --golden also writes a fixed input
      and torchvision's five encoder feature maps for it (eval mode), the reference
      tests/encoder_check compares the engine's encoder with; with --in-channels N the first
      convolution is adapted first as SMP's patch_first_conv does, and the input has N channels.
      --width-divisor N (with --random): the encoder at width / N (this file's Encoder, under
      torchvision's names): tests/golden/resnet18_w16.pth, for the engine's tests without
      PyTorch.
  pytorch_reference.py bench --batch 4 --size 128 [--threads 2] [--warmup 2] [--steps 7]
                       [--precision fp32|bf16] [--memory-format nchw|nhwc]
      Times the training step the engine's bench_cpu_step times (forward, BCE+Dice, backward,
      Adam 1e-3) on the synthetic-like random batch and prints one JSON line:
      {"batch", "size", "threads", "precision", "memory_format", "steps": [seconds...],
      "median"}. bf16 is autocast bf16 on the CPU with the loss in float32 (as unetcu's
      --precision bf16); nhwc is channels_last.
  pytorch_reference.py bench --device cuda --batch 14 --size 512
                       [--modes fp32,tf32,bf16,bf16-compile] [--warmup 5] [--steps 20]
                       [--compile-timeout 240]
      The same step on the GPU (random batch resident there, cudnn.benchmark on), one mode after
      another in this process: fp32 (eager, TF32 off everywhere), tf32 (eager, TF32 on in cuDNN
      and matmuls), bf16 (autocast bf16, channels_last, eager; the loss in float32; what stays
      float32 has PyTorch's default TF32 settings: on in cuDNN, off in matmuls), bf16-compile
      (bf16 under torch.compile; a failure or a compile past --compile-timeout seconds is
      reported as "compile failed: <reason>", not raised). Per mode: one JSON line
      {"device", "mode", "batch", "size", "status", "steps": [seconds...], "median",
      "images_per_s", "peak_mem_mib", "tflops", "peak_tflops", "fraction_of_peak", ...} and one
      line for people. Step times are CUDA events around each step after the warm-up; the
      median gives images/s; peak memory is torch.cuda.max_memory_allocated over the mode; the
      fraction of peak counts 188 GFLOP per image per step at 512x512 (scaled by (size/512)^2)
      against the dense peak of the mode's arithmetic on an H100 SXM or H200 (the same for
      both: fp32 67, TF32 494, bf16 989 TFLOP/s). status is "ok", "skipped: no CUDA",
      "failed: <reason>" or "compile failed: <reason>". Exit status: 0 when every mode ran or
      only the compile failed, 1 when a mode failed, 77 when PyTorch sees no CUDA device (every
      mode then says "skipped: no CUDA").

Needs PyTorch (Debian: python3-torch; run it with /usr/bin/python3) and nothing else: the
safetensors format is read and written here directly."""
import argparse
import json
import struct

import torch
import torch.nn as nn
import torch.nn.functional as F


def width(c, d):
    return max(1, c // d)


class Residual(nn.Module):
    """torchvision's residual tail: relu(h + x), x through a 1x1/stride conv + BN where the shape
    changes (made last, as torchvision's blocks register it)."""

    def add_downsample(self, cin, cout, stride):
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def residual(self, h, x):
        return F.relu(h + (self.downsample(x) if self.downsample is not None else x))


class BasicBlock(Residual):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.add_downsample(cin, cout, stride)

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        return self.residual(self.bn2(self.conv2(h)), x)


class Bottleneck(Residual):
    """torchvision's Bottleneck (ResNet v1.5: the stride on the 3x3); `planes` is its inner width."""

    def __init__(self, cin, planes, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, 4 * planes, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(4 * planes)
        self.add_downsample(cin, 4 * planes, stride)

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        h = F.relu(self.bn2(self.conv2(h)))
        return self.residual(self.bn3(self.conv3(h)), x)


# SMP's ResNet encoders: residual blocks per layer, and whether they are Bottlenecks.
ENCODERS = {"resnet18": ((2, 2, 2, 2), False), "resnet34": ((3, 4, 6, 3), False),
            "resnet50": ((3, 4, 6, 3), True), "resnet101": ((3, 4, 23, 3), True),
            "resnet152": ((3, 8, 36, 3), True)}


def encoder_channels(encoder, d):
    """The five features' channels (stem, layer1..layer4) at width divisor d."""
    x = 4 if ENCODERS[encoder][1] else 1
    return [width(64, d)] + [x * width(c, d) for c in (64, 128, 256, 512)]


class Encoder(nn.Module):
    def __init__(self, d, encoder="resnet34", in_channels=3):
        super().__init__()
        counts, bottleneck = ENCODERS[encoder]
        out = encoder_channels(encoder, d)
        self.conv1 = nn.Conv2d(in_channels, out[0], 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(out[0])
        for l in range(4):
            planes = width(64 << l, d)
            stride = 1 if l == 0 else 2
            blocks = [Bottleneck(out[l] if i == 0 else out[l + 1], planes, stride if i == 0 else 1) if bottleneck
                      else BasicBlock(out[l] if i == 0 else planes, planes, stride if i == 0 else 1)
                      for i in range(counts[l])]
            setattr(self, f"layer{l + 1}", nn.Sequential(*blocks))

    def forward(self, x):
        f1 = F.relu(self.bn1(self.conv1(x)))
        f2 = self.layer1(F.max_pool2d(f1, 3, 2, 1))
        f3 = self.layer2(f2)
        f4 = self.layer3(f3)
        return [f1, f2, f3, f4, self.layer4(f4)]


def conv_bn_relu(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())


class DecoderBlock(nn.Module):
    def __init__(self, cin, skip, cout):
        super().__init__()
        self.conv1 = conv_bn_relu(cin + skip, cout)
        self.conv2 = conv_bn_relu(cout, cout)

    def forward(self, x, skip):
        x = F.interpolate(x, scale_factor=2, mode="nearest")
        if skip is not None:
            x = torch.cat([x, skip], dim=1)
        return self.conv2(self.conv1(x))


class Decoder(nn.Module):
    def __init__(self, d, encoder="resnet34"):
        super().__init__()
        enc = encoder_channels(encoder, d)[::-1]
        dec = [width(v, d) for v in (256, 128, 64, 32, 16)]
        self.blocks = nn.ModuleList(
            [DecoderBlock(enc[0] if i == 0 else dec[i - 1], enc[i + 1] if i < 4 else 0, dec[i]) for i in range(5)])

    def forward(self, feats):
        f1, f2, f3, f4, x = feats
        for block, skip in zip(self.blocks, [f4, f3, f2, f1, None]):
            x = block(x, skip)
        return x


class Unet(nn.Module):
    """segmentation_models_pytorch.Unet(encoder, classes=classes, in_channels=in_channels) without
    its pretrained weights."""

    def __init__(self, d=1, classes=1, encoder="resnet34", in_channels=3):
        super().__init__()
        self.encoder = Encoder(d, encoder, in_channels)
        self.decoder = Decoder(d, encoder)
        self.segmentation_head = nn.Sequential(nn.Conv2d(width(16, d), classes, 3, 1, 1))

    def forward(self, x):
        return self.segmentation_head[0](self.decoder(self.encoder(x)))


def loss_fn(logits, target):
    """The engine's bce+dice: mean BCE-with-logits plus soft Dice over the batch, smooth 1."""
    p = torch.sigmoid(logits)
    inter, card = (p * target).sum(), p.sum() + target.sum()
    return F.binary_cross_entropy_with_logits(logits, target) + 1 - (2 * inter + 1) / (card + 1)


def multiclass_dice(logits, target, ignore_index=None, smooth=0.0, eps=1e-7):
    """SMP's DiceLoss(mode='multiclass', from_logits=True) as segmentation_models_pytorch/losses/
    dice.py computes it: target [bs,H,W] of class indices; Dice over the whole batch per class;
    a class absent from the (non-ignored) target contributes 0 and still counts in the mean."""
    bs, c = logits.shape[:2]
    y_pred = logits.log_softmax(dim=1).exp().view(bs, c, -1)
    y_true = target.view(bs, -1)
    if ignore_index is not None:
        mask = y_true != ignore_index
        y_pred = y_pred * mask.unsqueeze(1)
        y_true = F.one_hot((y_true * mask).long(), c).permute(0, 2, 1) * mask.unsqueeze(1)
    else:
        y_true = F.one_hot(y_true, c).permute(0, 2, 1)
    y_true = y_true.type_as(y_pred)
    inter, card = (y_pred * y_true).sum(dim=(0, 2)), (y_pred + y_true).sum(dim=(0, 2))
    loss = 1.0 - (2.0 * inter + smooth) / (card + smooth).clamp_min(eps)
    loss = loss * (y_true.sum(dim=(0, 2)) > 0).to(loss.dtype)
    return loss.mean()


DTYPES = {torch.float32: "F32", torch.float64: "F64", torch.int64: "I64"}
TORCH = {v: k for k, v in DTYPES.items()}


def write_safetensors(path, tensors):
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        data = t.numpy().tobytes()
        header[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":"))
    text += " " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text.encode())
        for b in blobs:
            f.write(b)


def read_safetensors(path):
    with open(path, "rb") as f:
        raw = f.read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        b, end = e["data_offsets"]
        out[name] = torch.frombuffer(bytearray(raw[8 + n + b:8 + n + end]), dtype=TORCH[e["dtype"]]).reshape(e["shape"])
    return out


def read_metadata(path):
    """The header's __metadata__ (a JSON object of strings), {} when there is none."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n)).get("__metadata__", {})


def golden_model(args, classes):
    """The golden runs' model: float64, training mode, seeded, with non-trivial batch-norm affine
    parameters and running statistics; and a copy of its initial state."""
    torch.manual_seed(args.seed)
    model = Unet(args.width_divisor, classes, args.encoder).double().train()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            nn.init.uniform_(m.weight, 0.5, 1.5)
            nn.init.uniform_(m.bias, -0.2, 0.2)
            m.running_mean.uniform_(-0.1, 0.1)
            m.running_var.uniform_(0.8, 1.2)
    return model, {k: v.clone() for k, v in model.state_dict().items()}


def golden(args):
    if args.classes >= 2:
        return golden_multiclass(args)
    if args.ignore_index is not None:
        raise SystemExit("golden: --ignore-index needs --classes 2 or more")
    model, state = golden_model(args, 1)
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64)
    target = (torch.rand(2, 1, 64, 64, dtype=torch.float64) < 0.4).double()
    logits = model(x)
    loss = loss_fn(logits, target)
    loss.backward()
    out = dict(state)
    out["golden.input"], out["golden.target"] = x, target
    out["golden.logits"], out["golden.loss"] = logits, loss.reshape(())
    out["golden.after.encoder.layer1.1.bn1.running_mean"] = model.encoder.layer1[1].bn1.running_mean
    params = add_gradients_and_adam(model, out)
    write_safetensors(args.path, out)
    print(f"wrote {args.path}: {len(state)} state entries, {len(params)} parameters ({args.encoder}), "
          f"loss {loss.item():.12f}")


def add_gradients_and_adam(model, out):
    """Every parameter's gradient (golden.grad.<name>), then every parameter after one
    torch.optim.Adam step on them (golden.adam.<name>: lr 1e-3, betas 0.9/0.999, eps 1e-8)."""
    params = dict(model.named_parameters())
    for name, p in params.items():
        out["golden.grad." + name] = p.grad.clone()
    torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0).step()
    for name, p in params.items():
        out["golden.adam." + name] = p.detach().clone()
    return params


def golden_multiclass(args):
    n, k = args.classes, args.ignore_index
    if k is not None and 0 <= k < n:
        raise SystemExit(f"golden: --ignore-index {k} is a class of --classes {n}")
    model, state = golden_model(args, n)
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64)
    target = torch.randint(0, n - 1, (2, 1, 64, 64))  # 0..n-2: class n-1 is absent
    ignored = torch.zeros(2, 1, 64, 64, dtype=torch.bool)
    if k is not None:
        ignored[0, :, 0:4, :] = True
        ignored |= torch.rand(2, 1, 64, 64) < 0.05
        target[ignored] = k
    logits = model(x)
    ce = nn.CrossEntropyLoss(ignore_index=-100 if k is None else k)(logits, target[:, 0])
    dice = multiclass_dice(logits, target[:, 0], k)
    loss = ce + dice
    loss.backward()
    out = dict(state)
    out["golden.input"] = x
    out["golden.target"] = torch.where(ignored, -1.0, target.double())
    out["golden.logits"], out["golden.loss"] = logits, loss.reshape(())
    out["golden.after.encoder.layer1.1.bn1.running_mean"] = model.encoder.layer1[1].bn1.running_mean
    params = add_gradients_and_adam(model, out)
    write_safetensors(args.path, out)
    print(f"wrote {args.path}: {len(out)} entries ({len(state)} state, {len(params)} parameters), {n} classes, "
          f"{int(ignored.sum())} ignored pixels, loss {loss.item():.12f} (ce {ce.item():.12f}, "
          f"dice {dice.item():.12f})")


def check(args):
    meta = read_metadata(args.path)
    classes = args.classes or int(meta.get("classes", 1))
    encoder = args.encoder or meta.get("encoder", "resnet34")
    model = Unet(args.width_divisor, classes, encoder).float().eval()
    model.load_state_dict(read_safetensors(args.path), strict=True)
    torch.manual_seed(0)
    with torch.no_grad():
        y = model(torch.randn(1, 3, args.image_size, args.image_size))
    print(f"loaded {args.path} strictly (classes {classes}, {encoder}); logits mean {y.mean().item():.6f} "
          f"std {y.std().item():.6f}")


def patch_first_conv(conv, in_channels):
    """SMP's encoders/_utils.patch_first_conv on a pretrained 3-channel convolution: 1 channel
    sums the three; N channels repeat them cyclically, scaled by 3 / N."""
    weight = conv.weight.detach()
    conv.in_channels = in_channels
    if in_channels == 1:
        new = weight.sum(1, keepdim=True)
    else:
        new = torch.empty(weight.shape[0], in_channels, *weight.shape[2:], dtype=weight.dtype)
        for i in range(in_channels):
            new[:, i] = weight[:, i % 3]
        new = new * (3 / in_channels)
    conv.weight = nn.Parameter(new)


def export_encoder(args):
    import torchvision
    torch.manual_seed(args.seed)
    make = getattr(torchvision.models, args.encoder)
    if args.width_divisor > 1:  # torchvision has no narrow ResNets: this file's Encoder, same names
        if not args.random or args.golden:
            raise SystemExit("export-encoder: --width-divisor goes with --random and without --golden")
        net = Encoder(args.width_divisor, args.encoder)
    if args.random:
        net = make(weights=None) if args.width_divisor == 1 else net
        for m in net.modules():  # non-trivial batch-norm statistics, as trained ones are
            if isinstance(m, nn.BatchNorm2d):
                nn.init.uniform_(m.weight, 0.5, 1.5)
                nn.init.uniform_(m.bias, -0.2, 0.2)
                m.running_mean.uniform_(-0.1, 0.1)
                m.running_var.uniform_(0.8, 1.2)
    else:
        try:
            net = make(weights="IMAGENET1K_V1")
        except Exception as e:  # no cache and no network
            raise SystemExit(f"export-encoder: torchvision could not provide the ImageNet weights ({e}); "
                             f"--random exports a randomly initialised {args.encoder}")
    dtype = {"float32": torch.float32, "float64": torch.float64}[args.dtype]
    net = net.to(dtype).eval()
    if args.format == "pth":  # torch.save of torchvision's state_dict, fc included, as torchvision hosts it
        torch.save(net.state_dict(), args.path)
        what = "torch.save archive, torchvision's names"
    elif args.format == "torchvision":  # SMP's hosted model.safetensors: torchvision's names, no fc
        write_safetensors(args.path, {k: v for k, v in net.state_dict().items() if not k.startswith("fc.")})
        what = "safetensors, torchvision's names"
    else:
        write_safetensors(args.path, {"encoder." + k: v for k, v in net.state_dict().items() if not k.startswith("fc.")})
        what = "safetensors, SMP's encoder.* names"
    print(f"wrote {args.path}: {args.encoder} ({what}, {args.dtype})")
    if args.golden:
        if args.in_channels != 3:
            patch_first_conv(net.conv1, args.in_channels)
        x = torch.randn(1, args.in_channels, args.image_size, args.image_size, dtype=dtype)
        with torch.no_grad():
            f1 = net.relu(net.bn1(net.conv1(x)))
            f2 = net.layer1(net.maxpool(f1))
            f3 = net.layer2(f2)
            f4 = net.layer3(f3)
            f5 = net.layer4(f4)
        out = {"golden.input": x}
        for i, f in enumerate([f1, f2, f3, f4, f5]):
            out[f"golden.feature.{i}"] = f
        write_safetensors(args.golden, out)
        print(f"wrote {args.golden}: the input ({args.in_channels} channels) and torchvision's 5 feature maps")


def bench(args):
    if args.device == "cuda":
        raise SystemExit(bench_gpu(args))
    import time
    torch.set_num_threads(args.threads or 2)
    torch.manual_seed(0)
    fmt = torch.channels_last if args.memory_format == "nhwc" else torch.contiguous_format
    model = Unet(1).float().train().to(memory_format=fmt)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(args.batch, 3, args.size, args.size).contiguous(memory_format=fmt)
    target = (torch.rand(args.batch, 1, args.size, args.size) < 0.4).float()

    def forward_loss():
        if args.precision == "fp32":
            return loss_fn(model(x), target)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x)
        return loss_fn(logits.float(), target)  # the loss and its reductions in float32

    warmup = 2 if args.warmup is None else args.warmup
    steps = 7 if args.steps is None else args.steps
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = forward_loss()
        loss.backward()
        opt.step()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    med = sorted(times)[len(times) // 2]
    print(json.dumps({"batch": args.batch, "size": args.size, "threads": args.threads or 2,
                      "precision": args.precision, "memory_format": args.memory_format, "steps": times,
                      "median": med, "torch": torch.__version__}))


# One training step of Unet('resnet34') at 512x512 costs 188 GFLOP per image: its convolutions
# take 62.5 GFLOP forward (counted from the layer shapes), and backward twice that (gradients of
# the inputs and of the weights). Other layers are a few percent and are not counted.
GFLOP_PER_IMAGE_512 = 188.0
# Peak rates of the H100 SXM and the H200 (the same figures in NVIDIA's datasheets of both),
# dense: the datasheets give the tensor-core rates with sparsity (TF32 989, BF16 1,979 TFLOP/s),
# twice the dense ones; plain fp32 (no tensor cores) is 67.
PEAK_TFLOPS = {"fp32": 67.0, "tf32": 494.0, "bf16": 989.0}
# mode: (what it is, the arithmetic whose peak it is measured against)
GPU_MODES = {
    "fp32": ("fp32 eager, TF32 off", "fp32"),
    "tf32": ("fp32 eager, TF32 on (cuDNN and matmuls)", "tf32"),
    "bf16": ("bf16 autocast + channels_last, eager", "bf16"),
    "bf16-compile": ("bf16 autocast + channels_last, torch.compile", "bf16"),
}


class CompileFailed(Exception):
    """torch.compile is missing, failed or took too long: a result to report, not an error."""


def set_tf32(matmul, conv):
    m, c = torch.backends.cuda.matmul, torch.backends.cudnn
    try:  # an older PyTorch's matmul settings answer an unknown name with an AssertionError
        new_api = isinstance(m.fp32_precision, str) and isinstance(c.conv.fp32_precision, str)
    except (AttributeError, AssertionError):
        new_api = False
    if new_api:
        # PyTorch 2.9 on: the allow_tf32 flags are deprecated, and mixing them with the new
        # settings is an error where the compiler reads them.
        m.fp32_precision = "tf32" if matmul else "ieee"
        c.conv.fp32_precision = "tf32" if conv else "ieee"
    else:
        m.allow_tf32 = matmul
        c.allow_tf32 = conv


def first_line(e):
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]


def gpu_mode(mode, args, gflop):
    """Trains a fresh model in one mode; returns the fields of its JSON line."""
    import signal
    import time
    dev = torch.device(args.device)
    # fp32: no TF32 anywhere; tf32: TF32 in matmuls and convolutions; under autocast, what stays
    # float32 gets PyTorch's defaults (TF32 in cuDNN convolutions, not in matmuls).
    set_tf32(matmul=mode == "tf32", conv=mode != "fp32")
    amp = mode.startswith("bf16")
    fmt = torch.channels_last if amp else torch.contiguous_format
    torch.manual_seed(0)
    model = Unet(1).float().train().to(dev, memory_format=fmt)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(args.batch, 3, args.size, args.size, device=dev).contiguous(memory_format=fmt)
    target = (torch.rand(args.batch, 1, args.size, args.size, device=dev) < 0.4).float()

    def forward_loss(x, target):
        if not amp:
            return loss_fn(model(x), target)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
        return loss_fn(logits.float(), target)  # the loss and its reductions in float32

    if mode == "bf16-compile":
        if not hasattr(torch, "compile"):
            raise CompileFailed(f"torch.compile is not in PyTorch {torch.__version__}")
        forward_loss = torch.compile(forward_loss)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = forward_loss(x, target)
        loss.backward()
        opt.step()
        return loss

    # The first step runs cuDNN's algorithm search (and, compiled, the compilation): timed alone.
    t0 = time.perf_counter()
    if mode == "bf16-compile":
        timed_out = []

        def on_alarm(signum, frame):
            timed_out.append(True)
            raise CompileFailed(f"not finished within {args.compile_timeout} s")
        old = signal.signal(signal.SIGALRM, on_alarm)
        signal.alarm(args.compile_timeout)
        try:
            step()
            torch.cuda.synchronize()
        except Exception as e:  # the compiler may wrap the alarm's exception in its own
            if timed_out:
                raise CompileFailed(f"not finished within {args.compile_timeout} s") from e
            raise CompileFailed(f"{type(e).__name__}: {first_line(e)}") from e
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)
    else:
        step()
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    for _ in range(max(0, args.warmup - 1)):
        step()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(args.steps)]
    t0 = time.perf_counter()
    for start, end in events:
        start.record()
        loss = step()
        end.record()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / args.steps
    if not torch.isfinite(loss).item():
        raise RuntimeError(f"the loss is not finite ({loss.item()})")
    times = [start.elapsed_time(end) / 1e3 for start, end in events]
    med = sorted(times)[len(times) // 2]
    ips = args.batch / med
    tflops = ips * gflop / 1e3
    peak = PEAK_TFLOPS[GPU_MODES[mode][1]]
    return {"status": "ok", "steps": times, "median": med, "wall_per_step": wall, "first_step_s": first,
            "images_per_s": ips, "peak_mem_mib": torch.cuda.max_memory_allocated() / 2**20,
            "gflop_per_image": gflop, "tflops": tflops, "peak_tflops": peak, "fraction_of_peak": tflops / peak,
            "loss": loss.item()}


def bench_gpu(args):
    """Every mode of --modes in turn; returns the exit status (see the file's top)."""
    import gc
    modes = args.modes.split(",")
    bad = [m for m in modes if m not in GPU_MODES]
    if bad:
        return f"bench: unknown mode(s) {','.join(bad)}; known: {','.join(GPU_MODES)}"
    gflop = GFLOP_PER_IMAGE_512 * (args.size / 512) ** 2
    cuda = torch.cuda.is_available()
    args.warmup = 5 if args.warmup is None else args.warmup
    args.steps = 20 if args.steps is None else args.steps
    if args.steps < 1:
        return "bench: --steps must be at least 1"
    if cuda:
        if args.threads:
            torch.set_num_threads(args.threads)
        torch.backends.cudnn.benchmark = True  # the engine searches cuDNN's algorithms too
    rc = 0
    for mode in modes:
        what, arith = GPU_MODES[mode]
        rec = {"device": "cuda", "gpu": torch.cuda.get_device_name() if cuda else None, "mode": mode,
               "what": what, "batch": args.batch, "size": args.size, "torch": torch.__version__}
        if not cuda:
            rec["status"] = "skipped: no CUDA"
            rc = 77
        else:
            torch.cuda.reset_peak_memory_stats()
            try:
                rec.update(gpu_mode(mode, args, gflop))
            except CompileFailed as e:
                rec["status"] = f"compile failed: {first_line(e)}"
            except Exception as e:  # out of memory, say: reported, and the next mode runs
                rec["status"] = f"failed: {type(e).__name__}: {first_line(e)}"
                rc = rc or 1
            if mode == "bf16-compile" and hasattr(torch, "_dynamo"):
                torch._dynamo.reset()
            gc.collect()
            torch.cuda.empty_cache()
        print(json.dumps(rec), flush=True)
        head = f"{mode} ({what}), batch {args.batch}, {args.size}x{args.size}:"
        if rec["status"] != "ok":
            print(f"{head} {rec['status']}", flush=True)
        else:
            print(f"{head} median {rec['median'] * 1e3:.1f} ms/step (first {rec['first_step_s']:.1f} s), "
                  f"{rec['images_per_s']:.1f} img/s, peak {rec['peak_mem_mib']:.0f} MiB, {rec['tflops']:.1f} "
                  f"TFLOP/s = {100 * rec['fraction_of_peak']:.1f}% of the {arith} peak "
                  f"({rec['peak_tflops']:.0f} TFLOP/s)", flush=True)
    return rc


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    # golden and check: a model file, its width and encoder, its classes (check: the file's).
    g, c = sub.add_parser("golden"), sub.add_parser("check")
    for sp, width_default, encoder_default, classes_default in ((g, 16, "resnet34", 1), (c, 1, None, None)):
        sp.add_argument("path")
        sp.add_argument("--width-divisor", type=int, default=width_default)
        sp.add_argument("--encoder", choices=list(ENCODERS), default=encoder_default,
                        help=None if encoder_default else "default: the checkpoint's \"encoder\", else resnet34")
        sp.add_argument("--classes", type=int, default=classes_default,
                        help=None if classes_default else "default: the checkpoint's __metadata__ \"classes\", else 1")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--ignore-index", type=int, help="--classes 2 or more: the ignored target value (e.g. 255)")
    c.add_argument("--image-size", type=int, default=64)
    e = sub.add_parser("export-encoder")
    e.add_argument("path")
    e.add_argument("--random", action="store_true")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    e.add_argument("--golden")
    e.add_argument("--encoder", choices=list(ENCODERS), default="resnet34")
    e.add_argument("--format", choices=["smp", "torchvision", "pth"], default="smp")
    e.add_argument("--width-divisor", type=int, default=1,
                   help="with --random: a narrow encoder (every channel count / N), torchvision's names")
    e.add_argument("--in-channels", type=int, default=3,
                   help="--golden: the features of SMP's patch_first_conv for this many input channels")
    e.add_argument("--image-size", type=int, default=64)
    b = sub.add_parser("bench")
    b.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    b.add_argument("--batch", type=int, default=4)
    b.add_argument("--size", type=int, default=128)
    b.add_argument("--threads", type=int, help="CPU threads (default 2 on the CPU, PyTorch's own with --device cuda)")
    b.add_argument("--warmup", type=int, help="untimed steps first (default 2 on the CPU, 5 on CUDA)")
    b.add_argument("--steps", type=int, help="timed steps (default 7 on the CPU, 20 on CUDA)")
    b.add_argument("--modes", default=",".join(GPU_MODES), help="--device cuda: the modes, in order (default: all)")
    b.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                   help="--device cpu: float32, or autocast bf16 with the loss in float32")
    b.add_argument("--memory-format", choices=["nchw", "nhwc"], default="nchw",
                   help="--device cpu: contiguous, or channels_last")
    b.add_argument("--compile-timeout", type=int, default=240,
                   help="--device cuda: seconds the bf16-compile mode's first step (the compilation) may take")
    a = ap.parse_args()
    {"golden": golden, "check": check, "bench": bench, "export-encoder": export_encoder}[a.cmd](a)
