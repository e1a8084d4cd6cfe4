#!/usr/bin/env python3
"""strip_settings.py IN OUT: IN's safetensors file without the run's settings in its metadata
(what a checkpoint written before they were recorded looks like); the tensors are unchanged."""
import json
import struct
import sys

raw = open(sys.argv[1], "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
header = json.loads(raw[8:8 + n])
keep = ("format", "producer", "epoch", "step", "save_id")
meta = header.get("__metadata__", {})
header["__metadata__"] = {k: v for k, v in meta.items() if k in keep or k.startswith("checksum.")}
text = json.dumps(header).encode()
text += b" " * (-len(text) % 8)
with open(sys.argv[2], "wb") as f:
    f.write(struct.pack("<Q", len(text)) + text + raw[8 + n:])
