#!/usr/bin/python3
"""Writes the seeds of the torch fuzz target (tests/corpus/torch/seed_*.pth): real torch.save
outputs, small, covering what engine/torch_file.cpp reads. Needs PyTorch:

    /usr/bin/python3 tests/corpus/make_torch_seeds.py

  seed_conv_bn.pth       a module's state_dict (OrderedDict with _metadata; float32 weights,
                         running statistics, num_batches_tracked int64 scalars)
  seed_views.pth         tensors sharing one storage at offsets, a transposed (strided) one, an
                         empty one, a 0-d one
  seed_dtypes.pth        float64, float16, bfloat16, int64, int32, uint8 and bool tensors
  seed_checkpoint.pth    a training checkpoint: {"epoch": 3, "state_dict": ..., "lr": 0.1}
  seed_parameters.pth    nn.Parameter values (torch._utils._rebuild_parameter)
  seed_big_endian.pth    seed_conv_bn.pth with a "byteorder" record of "big" and every storage
                         byte-swapped (PyTorch writes it on big-endian machines)
The malformed ones (bad_*) come from these: tests/corpus/make_malformed.py."""
import collections
import io
import os
import pickle
import zipfile

import torch
import torch.nn as nn

out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch")
os.makedirs(out, exist_ok=True)
torch.manual_seed(0)


def save(name, obj):
    torch.save(obj, os.path.join(out, name))
    print("wrote", name)


save("seed_conv_bn.pth", nn.Sequential(nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d(4)).state_dict())
base = torch.arange(24, dtype=torch.float32)
save("seed_views.pth", collections.OrderedDict([
    ("a", base[2:8].view(2, 3)), ("b", base[10:14]), ("t", torch.randn(3, 5).t()),
    ("empty", torch.zeros(0, 3)), ("scalar", torch.tensor(2.5))]))
save("seed_dtypes.pth", {
    "f64": torch.randn(2, 3, dtype=torch.float64), "f16": torch.randn(4, dtype=torch.float16),
    "bf16": torch.randn(4, dtype=torch.bfloat16), "i64": torch.tensor(7), "i32": torch.arange(3, dtype=torch.int32),
    "u8": torch.arange(5, dtype=torch.uint8), "bool": torch.tensor([True, False])})
save("seed_checkpoint.pth", {"epoch": 3, "state_dict": nn.Linear(2, 3).state_dict(), "lr": 0.1})
save("seed_parameters.pth", dict(nn.Linear(3, 2).named_parameters()))

# A big-endian archive: the same records, the byteorder record, every storage element swapped.
src = zipfile.ZipFile(os.path.join(out, "seed_conv_bn.pth"))
prefix = next(n for n in src.namelist() if n.endswith("/data.pkl"))[:-len("data.pkl")]
sizes = {}  # storage key -> element size, from the pickle's persistent ids


class Storages(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        return name if name.endswith("Storage") else (lambda *args: None)

    def persistent_load(self, pid):
        sizes[pid[2]] = {"FloatStorage": 4, "LongStorage": 8}[pid[1]]


Storages(io.BytesIO(src.read(prefix + "data.pkl"))).load()
with zipfile.ZipFile(os.path.join(out, "seed_big_endian.pth"), "w", zipfile.ZIP_STORED) as dst:
    for name in src.namelist():
        data = src.read(name)
        key = name[len(prefix + "data/"):] if name.startswith(prefix + "data/") else None
        if key is not None:
            n = sizes[key]
            data = b"".join(data[k:k + n][::-1] for k in range(0, len(data), n))
        dst.writestr(name, data)
    dst.writestr(prefix + "byteorder", b"big")
print("wrote seed_big_endian.pth")
