#!/usr/bin/env python3
"""Writes the hand-made malformed inputs of the regression corpus (tests/corpus/<target>/bad_*)
from the valid seeds beside them (seed_*, written by `tools/fuzz.sh --update-seeds`).

Each file is one way a checkpoint, an image or a torch.save archive can be broken; the corpus replay
(tests/test_corpus.cpp) requires each to end in success or unetcu::Error. Standard library only;
deterministic, so running it again rewrites the same bytes.

    python3 tests/corpus/make_malformed.py
"""
import io
import json
import os
import struct
import zipfile
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))


def read(target, name):
    with open(os.path.join(HERE, target, name), "rb") as f:
        return f.read()


def write(target, name, data):
    with open(os.path.join(HERE, target, name), "wb") as f:
        f.write(data)


# ---- safetensors: 8-byte little-endian header length, JSON header, data ------------------

def split(st):
    n = struct.unpack("<Q", st[:8])[0]
    return json.loads(st[8:8 + n]), st[8 + n:]


def join(header, data, raw_header=None):
    text = raw_header if raw_header is not None else json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def tensors(header):
    return [k for k in header if k != "__metadata__"]


def without_checksums(header):
    """The header without its "checksum.<name>" metadata: checksums are optional, and without
    them changed bytes reach the checks behind the checksum (finite values, counter ranges)."""
    h = json.loads(json.dumps(header))
    meta = h.get("__metadata__", {})
    for k in [k for k in meta if k.startswith("checksum.")]:
        del meta[k]
    return h


def first_with(header, pred):
    return next(k for k in tensors(header) if pred(header[k]))


def broken_files(seed):
    """(name suffix, bytes) for every generic breakage of a safetensors file."""
    header, data = split(seed)
    n = struct.unpack("<Q", seed[:8])[0]
    out = {}
    out["empty"] = b""
    out["five_bytes"] = seed[:5]
    out["header_only_length"] = seed[:8]
    out["truncated_in_header"] = seed[:8 + 200]
    out["truncated_half"] = seed[:len(seed) // 2]
    out["truncated_last_bytes"] = seed[:-4]
    # The length is judged before the header is read: 200 bytes of it are enough.
    out["header_len_max"] = struct.pack("<Q", 2**64 - 1) + seed[8:208]
    out["header_len_past_end"] = struct.pack("<Q", 201) + seed[8:208]
    out["header_len_zero"] = struct.pack("<Q", 0) + seed[8:208]
    text = seed[8:8 + n]
    out["json_cut"] = join(None, b"", raw_header=text[: len(text) // 3])
    out["json_not_object"] = join(None, b"", raw_header=b"[1,2,3]")
    out["json_null"] = join(None, b"", raw_header=b"null")
    # Nesting deep enough to overflow the stack of a recursive parser or destructor.
    out["json_deep_arrays"] = join(None, b"", raw_header=b"[" * 100000 + b"]" * 100000)
    out["json_deep_objects"] = join(None, b"", raw_header=b'{"a":' * 20000 + b"1" + b"}" * 20000)
    small = json.dumps({k: header[k] for k in tensors(header)[:3]}).encode()
    out["json_bad_utf8"] = join(None, b"", raw_header=small.replace(b'"', b'"\xff\xfe', 1))
    out["json_nul_in_key"] = join(None, b"", raw_header=small.replace(b'"', b'"\\u0000', 1))
    return header, data, out


def subset(header, data, names):
    """A smaller valid file: only the named entries, their data packed again."""
    h, packed = {}, b""
    for k in names:
        a, b = header[k]["data_offsets"]
        h[k] = dict(header[k], data_offsets=[len(packed), len(packed) + b - a])
        packed += data[a:b]
    return h, packed


def entry_files(full_header, full_data):
    """(name suffix, bytes) for broken entries. The reader's own checks are exercised on a
    three-entry file (a 4-d F32 weight, another F32 tensor, two I64 counters), which keeps the
    corpus small; what only loading into the model can refuse uses the whole file."""
    out = {}
    f32 = first_with(full_header, lambda e: e["dtype"] == "F32" and len(e["shape"]) == 4)
    f32b = [k for k in tensors(full_header) if full_header[k]["dtype"] == "F32" and k != f32][0]
    i64s = [k for k in tensors(full_header) if full_header[k]["dtype"] == "I64"][:2]
    i64 = i64s[0]
    header, data = subset(full_header, full_data, [f32, f32b] + i64s)
    if "__metadata__" in full_header:
        header["__metadata__"] = full_header["__metadata__"]

    def edit(fn, whole=False):  # whole files without checksums, but for the checksum cases
        h = json.loads(json.dumps(without_checksums(full_header) if whole else header))
        fn(h)
        return join(h, full_data if whole else data)

    out["offsets_reversed"] = edit(lambda h: h[f32].update(data_offsets=h[f32]["data_offsets"][::-1]))
    out["offsets_past_end"] = edit(lambda h: h[f32].update(data_offsets=[len(data) - 4, len(data) + 4]))
    out["offsets_huge"] = edit(lambda h: h[f32].update(data_offsets=[2**64 - 8, 2**64 - 1]))
    out["offsets_negative"] = edit(lambda h: h[f32].update(data_offsets=[-8, 0]))
    out["offsets_float"] = edit(lambda h: h[f32].update(data_offsets=[0.5, 8]))
    out["offsets_three"] = edit(lambda h: h[f32].update(data_offsets=[0, 4, 8]))
    out["offsets_string"] = edit(lambda h: h[f32].update(data_offsets=["0", "8"]))
    # Two entries reading the same bytes (safetensors forbids it; the values are still sane).
    def overlap(h):
        h[i64]["data_offsets"] = list(h[first_with(h, lambda e: e["dtype"] == "I64" and e is not h[i64])]["data_offsets"])
    out["offsets_overlap_counters"] = edit(overlap, whole=True)
    def overlap_weights(h):
        a = h[f32]["data_offsets"]
        b = h[f32b]["data_offsets"]
        size_b = b[1] - b[0]
        h[f32b]["data_offsets"] = [a[0], a[0] + size_b] if a[1] - a[0] >= size_b else b
    out["offsets_overlap_weights"] = edit(overlap_weights, whole=True)
    out["shape_product_overflow"] = edit(lambda h: h[f32].update(shape=[2**32, 2**32, 2**32]))
    out["shape_zero_then_huge"] = edit(lambda h: h[f32].update(shape=[0, 2**64 - 1], data_offsets=[0, 0]))
    out["shape_negative"] = edit(lambda h: h[f32].update(shape=[-1] + h[f32]["shape"][1:]))
    out["shape_not_array"] = edit(lambda h: h[f32].update(shape=7))
    out["shape_transposed"] = edit(lambda h: h[f32].update(shape=h[f32]["shape"][::-1]), whole=True)
    out["shape_scalar_counter_as_vector"] = edit(lambda h: h[i64].update(shape=[1]))
    out["dtype_bf16"] = edit(lambda h: h[f32].update(dtype="BF16"))
    out["dtype_f64_with_f32_bytes"] = edit(lambda h: h[f32].update(dtype="F64"))
    out["dtype_counter_f32"] = edit(lambda h: h[i64].update(dtype="F32", shape=[2]))
    numel = 1
    for d in header[f32]["shape"]:
        numel *= d
    out["dtype_weight_i64"] = edit(lambda h: h[f32].update(dtype="I64", shape=[numel // 2]))  # same bytes
    out["dtype_not_string"] = edit(lambda h: h[f32].update(dtype=4))
    out["entry_not_object"] = edit(lambda h: h.update({f32: [1, 2]}))
    out["entry_missing_dtype"] = edit(lambda h: h[f32].pop("dtype"))
    out["entry_missing"] = edit(lambda h: h.pop(f32), whole=True)
    out["entry_extra"] = edit(lambda h: h.update({"decoder.extra.weight": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}), whole=True)
    out["entry_empty_name"] = edit(lambda h: h.update({"": {"dtype": "F32", "shape": [], "data_offsets": [0, 4]}}))
    out["metadata_not_object"] = edit(lambda h: h.update(__metadata__=[1, 2]))
    out["metadata_not_strings"] = edit(lambda h: h.update(__metadata__={"epoch": 3, "format": None}), whole=True)
    out["no_tensors"] = join({"__metadata__": full_header.get("__metadata__", {})}, b"")
    out["only_three_entries"] = join(header, data)
    # Values the reader refuses: NaN weights, counters below zero or past any real count.
    a, b = full_header[f32]["data_offsets"]
    nan = bytearray(full_data)
    nan[a:b] = struct.pack("<f", float("nan")) * ((b - a) // 4)
    out["values_nan"] = join(without_checksums(full_header), bytes(nan))
    out["values_nan_checksummed"] = join(full_header, bytes(nan))
    inf = bytearray(full_data)
    inf[a:a + 4] = struct.pack("<f", float("-inf"))
    out["values_one_inf"] = join(without_checksums(full_header), bytes(inf))
    c0, c1 = full_header[i64]["data_offsets"]
    for name, v in [("counter_negative", -1), ("counter_huge", 2**62)]:
        d = bytearray(full_data)
        d[c0:c1] = struct.pack("<q", v)
        out["values_" + name] = join(without_checksums(full_header), bytes(d))
    # Checksums: one byte flipped, one entry's checksum missing, one checksum not hex.
    flipped = bytearray(full_data)
    flipped[a] ^= 0x01
    out["checksum_flipped_byte"] = join(full_header, bytes(flipped))
    sums = [k for k in full_header.get("__metadata__", {}) if k.startswith("checksum.")]
    if sums:
        h = json.loads(json.dumps(full_header))
        h["__metadata__"].pop(sums[0])
        out["checksum_missing_one"] = join(h, full_data)
        h["__metadata__"][sums[0]] = "zz"
        out["checksum_garbage"] = join(h, full_data)
    return out


def make_safetensors():
    seed = read("safetensors", "seed_unet_w64.safetensors")
    # A second seed, without checksums: a fuzzer that changes a data byte of the first meets
    # only the checksum; with this one it reaches the value checks.
    h, d = split(seed)
    write("safetensors", "seed_unet_w64_no_checksums.safetensors", join(without_checksums(h), d))
    header, data, generic = broken_files(seed)
    for name, b in {**generic, **entry_files(header, data)}.items():
        write("safetensors", "bad_" + name + ".safetensors", b)


# ---- .train: the same format, keyed "adam.<stat>.<parameter>", epoch in the metadata ---------

def make_train():
    seed = read("train", "seed_unet_w64_adam.train")
    h, d = split(seed)
    write("train", "seed_unet_w64_adam_no_checksums.train", join(without_checksums(h), d))
    header, data, generic = broken_files(seed)
    # The reader is the safetensors one, broken every way in safetensors/: a few here.
    out = {k: generic[k] for k in ["empty", "truncated_in_header", "header_len_max", "json_null"]}

    def meta(**kv):  # the epoch and optimizer are judged before any entry: no entries needed
        h = {"__metadata__": dict(without_checksums(header)["__metadata__"])}
        for k, v in kv.items():
            if v is None:
                h["__metadata__"].pop(k, None)
            else:
                h["__metadata__"][k] = v
        return join(h, b"")

    out["epoch_other"] = meta(epoch="2")
    out["epoch_missing"] = meta(epoch=None)
    out["epoch_not_number"] = meta(epoch="one")
    out["epoch_overflow"] = meta(epoch="99999999999999999999")
    out["epoch_trailing_text"] = meta(epoch="1abc")
    out["epoch_negative"] = meta(epoch="-1")
    out["epoch_past_limit"] = meta(epoch="10000001")
    out["epoch_plus_sign"] = meta(epoch="+1")
    out["epoch_spaces"] = meta(epoch=" 1")
    out["step_negative"] = meta(step="-1")
    out["step_huge"] = meta(step="99999999999999999999999")
    out["step_exponent"] = meta(step="1e3")
    out["save_id_other"] = meta(save_id="not-the-model-file-save")
    out["optimizer_sgd"] = meta(optimizer="sgd")
    out["optimizer_missing"] = meta(optimizer=None)
    # The older format: state by parameter position, no optimizer name.
    h = {"__metadata__": {"epoch": "1", "producer": "unetcu"}}
    m = next(k for k in tensors(header) if k.startswith("adam.m."))
    h["adam.m.0"] = dict(header[m], data_offsets=[0, header[m]["data_offsets"][1] - header[m]["data_offsets"][0]])
    a, b = header[m]["data_offsets"]
    out["positional_keys"] = join(h, data[a:b])
    out["no_entries"] = meta()
    step = next(k for k in tensors(header) if k.startswith("adam.step."))

    def edit(fn):
        h = without_checksums(header)
        fn(h)
        return join(h, data)

    out["moment_missing"] = edit(lambda h: h.pop(m))
    out["moment_shape"] = edit(lambda h: h[m].update(shape=[h[m]["shape"][0] * 2] + h[m]["shape"][1:],
                                                     data_offsets=[0, 2 * (h[m]["data_offsets"][1] - h[m]["data_offsets"][0])]))
    out["moment_f64"] = edit(lambda h: h[m].update(dtype="F64", shape=[1], data_offsets=[0, 8]))
    out["step_missing"] = edit(lambda h: h.pop(step))
    out["step_f32"] = edit(lambda h: h[step].update(dtype="F32", shape=[2]))
    out["step_vector"] = edit(lambda h: h[step].update(shape=[1]))
    # Values behind the checksums (so without them): a NaN moment, a negative step count.
    a, b = header[m]["data_offsets"]
    nan = bytearray(data)
    nan[a:a + 4] = struct.pack("<f", float("nan"))
    out["moment_nan"] = join(without_checksums(header), bytes(nan))
    s0, s1 = header[step]["data_offsets"]
    neg = bytearray(data)
    neg[s0:s1] = struct.pack("<q", -5)
    out["step_count_negative"] = join(without_checksums(header), bytes(neg))
    # The run's record of its monitored metric (train/monitor.h), as a run writes it after
    # epoch 1: a seed that carries one, and the records the resume refuses.
    record = {"run.monitor": "val_iou", "run.best": "0.5", "run.best_epoch": "1",
              "run.reference": "0.5", "run.stale": "0"}

    def with_record(**kv):  # the whole file, checksums kept; None drops a key
        h = json.loads(json.dumps(header))
        h["__metadata__"].update(record)
        for k, v in kv.items():
            if v is None:
                h["__metadata__"].pop(k, None)
            else:
                h["__metadata__"][k] = v
        return join(h, data)

    write("train", "seed_unet_w64_adam_record.train", with_record())
    out["record_best_nan"] = with_record(**{"run.best": "nan"})
    out["record_best_overflow"] = with_record(**{"run.best": "1e999"})
    out["record_best_trailing_text"] = with_record(**{"run.best": "0.5x"})
    out["record_best_epoch_future"] = with_record(**{"run.best_epoch": "2"})
    out["record_best_epoch_zero"] = with_record(**{"run.best_epoch": "0"})
    out["record_stale_past_epochs"] = with_record(**{"run.stale": "1"})
    out["record_stale_negative"] = with_record(**{"run.stale": "-1"})
    out["record_stale_missing"] = with_record(**{"run.stale": None})
    out["record_reference_better"] = with_record(**{"run.reference": "0.9"})
    out["record_value_long"] = with_record(**{"run.best": "0." + "5" * 100})
    out["record_key_empty"] = with_record(**{"run.": "x"})
    for name, b in out.items():
        write("train", "bad_" + name + ".train", b)


# ---- images --------------------------------------------------------------------------------

def png_chunks(png):
    pos, out = 8, []
    while pos + 8 <= len(png):
        n, kind = struct.unpack(">I4s", png[pos:pos + 8])
        out.append((kind, png[pos + 8:pos + 8 + n]))
        pos += 12 + n
    return out


def png(chunks):
    out = b"\x89PNG\r\n\x1a\n"
    for kind, body in chunks:
        out += struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    return out


def jpeg_segments(jpg):
    """[(marker, payload)] up to SOS; then ('rest', bytes from SOS on)."""
    pos, out = 2, []
    while pos < len(jpg):
        marker = jpg[pos + 1]
        if marker == 0xDA:
            out.append(("rest", jpg[pos:]))
            break
        n = struct.unpack(">H", jpg[pos + 2:pos + 4])[0]
        out.append((marker, jpg[pos + 4:pos + 2 + n]))
        pos += 2 + n
    return out


def jpeg(segments):
    out = b"\xff\xd8"
    for marker, payload in segments:
        out += payload if marker == "rest" else bytes([0xFF, marker]) + struct.pack(">H", len(payload) + 2) + payload
    return out


def make_images():
    out = {}
    p = read("image", "seed_rgb.png")
    chunks = png_chunks(p)
    ihdr = dict(chunks)[b"IHDR"]
    w, h = struct.unpack(">II", ihdr[:8])

    def with_ihdr(**kv):
        fields = dict(zip(["w", "h", "depth", "color", "comp", "filter", "interlace"],
                          struct.unpack(">IIBBBBB", ihdr)))
        fields.update(kv)
        body = struct.pack(">IIBBBBB", *[fields[k] for k in ["w", "h", "depth", "color", "comp", "filter", "interlace"]])
        return png([(b"IHDR", body) if k == b"IHDR" else (k, v) for k, v in chunks])

    out["empty.img"] = b""
    out["png_signature_only.png"] = p[:8]
    out["png_truncated.png"] = p[: len(p) // 2]
    out["png_zero_width.png"] = with_ihdr(w=0)
    out["png_dims_over_limit.png"] = with_ihdr(w=1 << 25, h=1 << 25)
    out["png_dims_overflow_int.png"] = with_ihdr(w=0x7FFFFFFF, h=0x7FFFFFFF)
    out["png_more_pixels_than_data.png"] = with_ihdr(w=w * 4, h=h * 4)
    out["png_bad_depth.png"] = with_ihdr(depth=3)
    out["png_bad_color_type.png"] = with_ihdr(color=5)
    out["png_interlaced_claim.png"] = with_ihdr(interlace=1)
    out["png_16bit_claim.png"] = with_ihdr(depth=16)
    out["png_palette_without_plte.png"] = with_ihdr(color=3, depth=8)
    out["png_no_idat.png"] = png([(k, v) for k, v in chunks if k != b"IDAT"])
    out["png_bad_zlib.png"] = png([(k, b"\x78\x9c" + b"\xff" * 40 if k == b"IDAT" else v) for k, v in chunks])
    out["png_bad_crc.png"] = p[:-5] + bytes([p[-5] ^ 0xFF]) + p[-4:]
    out["png_huge_chunk_length.png"] = p[:8] + struct.pack(">I", 0xFFFFFFF0) + p[12:]

    b = read("image", "seed_rgb.bmp")
    def bmp_with(offset, fmt, value):
        return b[:offset] + struct.pack(fmt, value) + b[offset + struct.calcsize(fmt):]
    out["bmp_truncated.bmp"] = b[: len(b) // 2]
    out["bmp_header_only.bmp"] = b[:54]
    out["bmp_top_down.bmp"] = bmp_with(22, "<i", -struct.unpack("<i", b[22:26])[0])
    out["bmp_height_min_int.bmp"] = bmp_with(22, "<i", -(2**31))
    out["bmp_width_huge.bmp"] = bmp_with(18, "<i", 1 << 24)
    out["bmp_width_zero.bmp"] = bmp_with(18, "<i", 0)
    out["bmp_height_zero.bmp"] = bmp_with(22, "<i", 0)
    out["bmp_width_negative.bmp"] = bmp_with(18, "<i", -13)
    out["bmp_zero_bpp.bmp"] = bmp_with(28, "<H", 0)
    out["bmp_4bpp_no_palette.bmp"] = bmp_with(28, "<H", 4)
    out["bmp_palette_huge.bmp"] = bmp_with(28, "<H", 8)[:46] + struct.pack("<I", 0xFFFFFFFF) + b[50:]
    out["bmp_data_offset_past_end.bmp"] = bmp_with(10, "<I", 0xFFFFFF00)
    out["bmp_header_size_odd.bmp"] = bmp_with(14, "<I", 0xFFFFFFFF)
    out["bmp_bitfields_zero_masks.bmp"] = bmp_with(30, "<I", 3)

    j = read("image", "seed_rgb.jpg")
    segs = jpeg_segments(j)
    out["jpeg_truncated.jpg"] = j[: len(j) // 2]
    out["jpeg_soi_only.jpg"] = j[:2]
    out["jpeg_no_eoi.jpg"] = j[:-2]
    sof = next(i for i, (m, _) in enumerate(segs) if m == 0xC0)
    def with_sof(payload):
        return jpeg(segs[:sof] + [(0xC0, payload)] + segs[sof + 1:])
    sp = segs[sof][1]
    out["jpeg_zero_height.jpg"] = with_sof(sp[:1] + b"\x00\x00" + sp[3:])
    out["jpeg_dims_max.jpg"] = with_sof(sp[:1] + b"\xff\xff\xff\xff" + sp[5:])
    out["jpeg_five_components.jpg"] = with_sof(sp[:5] + b"\x05" + sp[6:] + sp[6:9] * 2)
    out["jpeg_sampling_zero.jpg"] = with_sof(sp[:7] + b"\x00" + sp[8:])
    out["jpeg_sampling_odd.jpg"] = with_sof(sp[:7] + b"\x33" + sp[8:])
    out["jpeg_quant_table_missing.jpg"] = with_sof(sp[:8] + b"\x03" + sp[9:])
    out["jpeg_progressive_claim.jpg"] = jpeg(segs[:sof] + [(0xC2, sp)] + segs[sof + 1:])
    out["jpeg_12bit.jpg"] = with_sof(b"\x0c" + sp[1:])
    # A DHT segment whose 16 code-length counts sum past 256 (here 16 x 255 = 4080): stb_image
    # 2.27 writes that many entries into its 257-byte size[] and 256-byte values[] tables.
    counts = bytes([255] * 16)
    out["jpeg_dht_counts_over_256.jpg"] = jpeg([(0xC4, b"\x13" + counts + bytes(4080))] + segs)
    out["jpeg_dht_counts_257.jpg"] = jpeg([(0xC4, b"\x00" + bytes([0] * 7 + [255, 2] + [0] * 7) + bytes(257))] + segs)
    out["jpeg_dht_bad_class.jpg"] = jpeg([(0xC4, b"\x24" + bytes(16))] + segs)
    out["jpeg_dqt_bad_id.jpg"] = jpeg([(0xDB, b"\x07" + bytes(64))] + segs)
    out["jpeg_restart_zero_length.jpg"] = jpeg([(0xDD, b"")] + segs)
    out["jpeg_app_length_one.jpg"] = j[:2] + b"\xff\xe0\x00\x01" + j[2:]
    sos = segs[-1][1]
    out["jpeg_sos_components_zero.jpg"] = jpeg(segs[:-1] + [("rest", sos[:4] + b"\x00" + sos[5:])])
    out["jpeg_sos_huffman_table_3.jpg"] = jpeg(segs[:-1] + [("rest", sos[:6] + b"\x33" + sos[7:])])
    out["jpeg_entropy_garbage.jpg"] = jpeg(segs[:-1] + [("rest", sos[:14] + bytes((i * 37) & 0xFF for i in range(len(sos) - 16)) + b"\xff\xd9")])
    for name, data in out.items():
        write("image", "bad_" + name, data)


# ---- torch.save archives: a zip of <name>/data.pkl (the pickled state_dict) and data/<key> --

def zip_of(records, method=zipfile.ZIP_STORED):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", method) as z:
        for name, data in records:
            z.writestr(zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0)), data, compress_type=method)
    return buf.getvalue()


def make_torch():
    """Each must be refused (tests/test_corpus.cpp): seed_conv_bn.pth broken one way each."""
    seed = read("torch", "seed_conv_bn.pth")
    z = zipfile.ZipFile(io.BytesIO(seed))
    records = [(n, z.read(n)) for n in z.namelist()]
    prefix = next(n for n, _ in records if n.endswith("/data.pkl"))[:-len("data.pkl")]
    pkl = dict(records)[prefix + "data.pkl"]

    def with_pickle(p):
        return zip_of([(n, p if n == prefix + "data.pkl" else d) for n, d in records])

    out = {}
    out["truncated_half.pth"] = seed[:len(seed) // 2]
    out["truncated_directory.pth"] = seed[:-30]  # the central directory's end record cut
    out["empty_zip.pth"] = zip_of([])
    # A pickle that would run a command or evaluate code: the global is refused when read.
    out["global_os_system.pth"] = with_pickle(b"\x80\x02cos\nsystem\nq\x00X\x02\x00\x00\x00idq\x01\x85q\x02Rq\x03.")
    out["global_builtins_eval.pth"] = with_pickle(b"\x80\x02cbuiltins\neval\nX\x03\x00\x00\x001+1\x85R.")
    out["global_torch_load.pth"] = with_pickle(b"\x80\x02ctorch\nload\nX\x01\x00\x00\x00x\x85R.")
    # The legacy (before PyTorch 1.6) format: pickle protocol 2 and its magic number, no zip.
    out["legacy_format.pth"] = b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19.\x80\x02M\xe9\x03.\x80\x02}q\x00."
    out["no_data_pkl.pth"] = zip_of([(n, d) for n, d in records if not n.endswith("data.pkl")])
    out["two_data_pkl.pth"] = zip_of(records + [("other/data.pkl", pkl)])
    out["compressed.pth"] = zip_of(records, zipfile.ZIP_DEFLATED)
    out["torchscript.pth"] = zip_of(records + [(prefix + "constants.pkl", b"\x80\x02).")])
    out["byteorder_middle.pth"] = zip_of(records + [(prefix + "byteorder", b"middle")])
    storages = [n for n, _ in records if n.startswith(prefix + "data/")]
    out["storage_missing.pth"] = zip_of([(n, d) for n, d in records if n != storages[0]])
    out["storage_short.pth"] = zip_of([(n, d[:-4] if n == storages[0] else d) for n, d in records])
    out["storage_long.pth"] = zip_of([(n, d + b"\0" * 4 if n == storages[0] else d) for n, d in records])
    # The conv weight's size (4, 3, 3, 3) grown to (5, 3, 3, 3): more than its storage holds.
    size = b"K\x04K\x03K\x03K\x03"
    assert size in pkl
    out["tensor_past_storage.pth"] = with_pickle(pkl.replace(size, b"K\x05K\x03K\x03K\x03", 1))
    out["stride_past_storage.pth"] = with_pickle(pkl.replace(b"K\x1bK\tK\x03K\x01", b"K\x1bK\tK\x03K\x02", 1))
    out["pickle_no_stop.pth"] = with_pickle(pkl[:-1])
    out["pickle_cut.pth"] = with_pickle(pkl[:len(pkl) // 2])
    out["pickle_unknown_opcode.pth"] = with_pickle(pkl[:2] + b"i" + pkl[2:])
    out["pickle_protocol_9.pth"] = with_pickle(b"\x80\x09" + pkl[2:])
    out["pickle_memo_unset.pth"] = with_pickle(pkl.replace(b"h\x03", b"h\xf3", 1))
    out["pickle_not_a_dict.pth"] = with_pickle(b"\x80\x02K\x07.")
    out["pickle_pops_empty.pth"] = with_pickle(b"\x80\x02s.")
    # A list that holds itself (memo 0 appended to itself), and an empty file: the first fuzz
    # runs found both leaking (reference cycles; the archive not released when refused).
    out["pickle_self_list.pth"] = with_pickle(b"\x80\x02]q\x00h\x00a.")
    out["empty_file.pth"] = b""
    for name, data in out.items():
        write("torch", "bad_" + name, data)


# ---- NumPy .npy: "\x93NUMPY", version, header length, a dict literal header, the data --------

def npy(descr, shape, data, version=1, fortran=False, raw_header=None):
    h = raw_header if raw_header is not None else (
        "{'descr': '%s', 'fortran_order': %s, 'shape': %s, }" % (descr, "True" if fortran else "False", shape))
    lenb = 2 if version == 1 else 4
    h += " " * ((64 - (8 + lenb + len(h) + 1) % 64) % 64) + "\n"
    return b"\x93NUMPY" + bytes([version, 0]) + len(h).to_bytes(lenb, "little") + h.encode() + data


def make_npy():
    """Seeds (each must load) and breakages (each must be refused) of the .npy reader."""
    os.makedirs(os.path.join(HERE, "npy"), exist_ok=True)
    seeds = {
        "u8_hw.npy": npy("|u1", "(4, 3)", bytes(range(12))),
        "u16_hwc.npy": npy("<u2", "(2, 2, 3)", struct.pack("<12H", *range(0, 12 * 5461, 5461))),
        "f32_hwc4.npy": npy("<f4", "(2, 1, 4)", struct.pack("<8f", *[0.5 * i for i in range(8)]), version=2),
    }
    bad = {
        "magic.npy": b"\x93NUMPZ" + seeds["u8_hw.npy"][6:],
        "version_9.npy": seeds["u8_hw.npy"][:6] + b"\x09" + seeds["u8_hw.npy"][7:],
        "header_past_end.npy": seeds["u8_hw.npy"][:8] + b"\xff\x7f" + seeds["u8_hw.npy"][10:40],
        "f64.npy": npy("<f8", "(1, 1)", bytes(8)),
        "big_endian.npy": npy(">u2", "(1, 1)", bytes(2)),
        "fortran.npy": npy("<f4", "(1, 2)", bytes(8), fortran=True),
        "one_dim.npy": npy("|u1", "(4,)", bytes(4)),
        "four_dims.npy": npy("|u1", "(1, 1, 1, 1)", bytes(1)),
        "zero_dim.npy": npy("|u1", "(0, 3)", b""),
        "huge_dim.npy": npy("|u1", "(99999999999, 1)", bytes(8)),
        "short_data.npy": npy("<u2", "(2, 2)", bytes(6)),
        "long_data.npy": npy("|u1", "(2, 2)", bytes(5)),
        "no_shape.npy": npy("", "", b"", raw_header="{'descr': '|u1', 'fortran_order': False, }"),
        "no_descr.npy": npy("", "", b"", raw_header="{'fortran_order': False, 'shape': (1, 1), }"),
        "nan.npy": npy("<f4", "(1, 1)", struct.pack("<f", float("nan"))),
        "65_channels.npy": npy("|u1", "(1, 1, 65)", bytes(65)),
    }
    for name, data in seeds.items():
        write("npy", "seed_" + name, data)
    for name, data in bad.items():
        write("npy", "bad_" + name, data)


if __name__ == "__main__":
    make_safetensors()
    make_train()
    make_images()
    make_torch()
    make_npy()
