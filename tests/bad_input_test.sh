#!/usr/bin/env bash
# Every class of bad input, through both binaries: each case must end with a non-zero exit
# that is not a crash (no signal), one line of error on stderr, within a timeout (no hang), and
# leave no half-written file behind. Then Ctrl-C: finish the step, save, exit 130, resume.
# Usage: bad_input_test.sh UNET_TRAIN UNET_PREDICT UNET_SYNTHETIC_DATASET
set -u
train="$1" predict="$2" make_data="$3"
tests=$(cd "$(dirname "$0")" && pwd)  # the torch.save archives: tests/corpus/torch, tests/golden
d=$(mktemp -d)
trap 'rm -rf "$d"' EXIT
cd "$d" || exit 2
fail=0 cases=0 clean=0
small=(--image-size 64 --train-size 8 --val-size 4 --width-divisor 16 --no-progress)

# check "<text the error must contain>" program args...
check() {
  local want="$1"; shift
  cases=$((cases + 1))
  timeout 120 "$@" > out.txt 2> err.txt
  local rc=$? err
  err=$(grep -v '^Run with --help' err.txt)
  local leftovers
  leftovers=$(find . -name '*.tmp' -o -name '*.tmp.png' | head -3)
  if [ $rc -eq 124 ]; then
    echo "FAIL (hang): $*"; fail=1
  elif [ $rc -eq 0 ]; then
    echo "FAIL (exit 0): $*"; fail=1
  elif [ $rc -gt 128 ]; then
    echo "FAIL (crash, rc $rc): $*: $(tail -3 err.txt)"; fail=1
  elif ! grep -qF -- "$want" <<<"$err"; then
    echo "FAIL (message): $*: said '$err', expected '$want'"; fail=1
  elif [ "$(grep -c . <<<"$err")" -ne 1 ]; then
    echo "FAIL (not one line): $*: $err"; fail=1
  elif [ -n "$leftovers" ]; then
    echo "FAIL (half-written files left: $leftovers): $*"; fail=1
  else
    clean=$((clean + 1))
  fi
  rm -f out.txt err.txt
}

# Files made here: a small model checkpoint to damage, image folders, FIFOs, crafted images.
"$train" "${small[@]}" --epochs 1 --checkpoint good.safetensors > /dev/null || { echo "FAIL: setup training"; exit 1; }
"$make_data" data --count 6 --image-size 64 > /dev/null || { echo "FAIL: setup dataset"; exit 1; }
mkfifo fifo fifo2
mkdir adir
python3 - <<'PY'
import struct, json
good = open("good.safetensors", "rb").read()
n = struct.unpack("<Q", good[:8])[0]
header = json.loads(good[8:8 + n])
def write(name, header, data):
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    open(name, "wb").write(struct.pack("<Q", len(text)) + text + data)
data = good[8 + n:]
open("flipped.safetensors", "wb").write(good[:-5] + bytes([good[-5] ^ 0x40]) + good[-4:])
open("short_header.safetensors", "wb").write(struct.pack("<Q", n - 1) + good[8:])
open("truncated.safetensors", "wb").write(good[: len(good) // 2])
open("huge_header.safetensors", "wb").write(struct.pack("<Q", 1 << 60) + good[8:])
# The .train files beside copies of the model: an epoch out of range.
train = open("good.safetensors.train", "rb").read()
tn = struct.unpack("<Q", train[:8])[0]
th = json.loads(train[8:8 + tn])
for name, epoch in (("epoch_max", "2147483647"), ("epoch_neg", "-5")):
    open(name + ".safetensors", "wb").write(good)
    h = dict(th); h["__metadata__"] = dict(th["__metadata__"], epoch=epoch)
    write(name + ".safetensors.train", h, train[8 + tn:])
# A damaged record of the monitored metric (the run's best so far, epochs without improvement)
# or of the run's length.
assert th["__metadata__"]["run.monitor"] == "val_iou" and "run.total_steps" in th["__metadata__"], th["__metadata__"]
for name, key, value in (("record_nan", "run.best", "nan"), ("record_stale", "run.stale", "7"),
                         ("record_long", "run.note", "x" * 200), ("record_steps", "run.total_steps", "-3")):
    open(name + ".safetensors", "wb").write(good)
    h = dict(th); h["__metadata__"] = dict(th["__metadata__"], **{key: value})
    write(name + ".safetensors.train", h, train[8 + tn:])
# Images: a JPEG whose Huffman table counts sum to more than 256 (stb 2.27 writes out of
# bounds on it), a BMP header claiming 40000 x 40000, a JPEG claiming 20000 x 20000.
def seg(marker, payload):
    return b"\xff" + bytes([marker]) + struct.pack(">H", len(payload) + 2) + payload
sof = seg(0xC0, b"\x08" + struct.pack(">HH", 16, 16) + b"\x01\x01\x11\x00")
dqt = seg(0xDB, b"\x00" + bytes(range(1, 65)))
dht = seg(0xC4, b"\x00" + bytes([255] * 16) + bytes(255 * 16 % 1000))
sos = seg(0xDA, b"\x01\x01\x00\x00\x3f\x00")
open("dht.jpg", "wb").write(b"\xff\xd8" + dqt + sof + dht + sos + b"\x00" * 64 + b"\xff\xd9")
bmp = b"BM" + struct.pack("<IHHI", 54, 0, 0, 54) + struct.pack("<IiiHHIIiiII", 40, 40000, 40000, 1, 24, 0, 0, 0, 0, 0, 0)
open("bomb.bmp", "wb").write(bmp)
sof_big = seg(0xC0, b"\x08" + struct.pack(">HH", 20000, 20000) + b"\x01\x01\x11\x00")
open("bomb.jpg", "wb").write(b"\xff\xd8" + dqt + sof_big + b"\xff\xd9")
PY
mkdir -p bad_jpeg/images bad_jpeg/masks bomb/images bomb/masks mismatch/images mismatch/masks
cp data/images/0000[0-3].png bad_jpeg/images/; cp data/masks/0000[0-4].png bad_jpeg/masks/
cp dht.jpg bad_jpeg/images/00004.jpg
cp data/images/0000[0-3].png bomb/images/; cp data/masks/0000[0-4].png bomb/masks/
cp bomb.bmp bomb/images/00004.bmp
cp data/images/*.png mismatch/images/; cp data/masks/*.png mismatch/masks/
"$make_data" other --count 1 --image-size 32 > /dev/null && cp other/masks/00000.png mismatch/masks/00002.png

# Sizes past their bounds and numbers that used to wrap around.
check "--image-size must be a multiple of 32 in 32..8192" "$train" --image-size 536870912
check "--image-size must be a multiple of 32 in 32..8192" "$train" --image-size 2147483616
check "--threads must be in 0..1024" "$train" --threads 100000
check "--train-size must be in 1.." "$train" --train-size 9223372036854775807 --val-size 9223372036854775807
check "--seed: '-1' is not a whole number" "$train" --seed -1
check "--split: '99999999999' is not a block" "$train" --mode mp --devices cpu:0,cpu:1 --split 99999999999
check "--image-size must be a multiple of 32 in 32..8192" "$predict" data/images --checkpoint good.safetensors --width-divisor 16 --image-size 536870912
# Files that are not regular files, or damaged.
cp good.safetensors.train fifo.train 2> /dev/null; rm -f fifo.train; mkfifo fifo.train
check "is not a regular file" "$train" "${small[@]}" --resume fifo
check "is not a regular file" "$train" "${small[@]}" --init-encoder fifo
check "is not a regular file" "$train" "${small[@]}" --init-encoder /dev/zero
check "is not a regular file" "$train" "${small[@]}" --init-encoder adir
check "is a FIFO (named pipe), not a regular file" "$train" "${small[@]}" --data data --data-list fifo2 --batch-size 2
check "is a folder, not a regular file" "$train" "${small[@]}" --data data --data-list adir --batch-size 2
check "is a FIFO (named pipe), not a regular file" "$predict" fifo --checkpoint good.safetensors --width-divisor 16
check "is a FIFO (named pipe), not a regular file" "$predict" data/images --checkpoint fifo --width-divisor 16
check "is damaged" "$train" "${small[@]}" --init-encoder flipped.safetensors
check "checkpoint 'short_header.safetensors'" "$train" "${small[@]}" --init-encoder short_header.safetensors
check "truncated" "$train" "${small[@]}" --init-encoder truncated.safetensors
# torch.save archives for --encoder-weights: a pickle that would run a command, a truncated
# zip, the legacy format, the weights of another depth.
torch="$tests/corpus/torch"
check "names the global 'os.system', which no state_dict needs; refused without running anything" \
  "$train" "${small[@]}" --encoder-weights "$torch/bad_global_os_system.pth"
check "is not a readable zip archive" "$train" "${small[@]}" --encoder-weights "$torch/bad_truncated_half.pth"
check "is in the legacy torch.save format (before PyTorch 1.6); re-save it" \
  "$train" "${small[@]}" --encoder-weights "$torch/bad_legacy_format.pth"
# An .npy array of 2 channels for --in-channels 4: one line naming it.
mkdir -p npy/images npy/masks
/usr/bin/python3 -c "
import struct
h = \"{'descr': '|u1', 'fortran_order': False, 'shape': (64, 64, 2), }\"
h += ' ' * ((64 - (10 + len(h) + 1) % 64) % 64) + '\n'
open('npy/images/a.npy', 'wb').write(b'\x93NUMPY\x01\x00' + struct.pack('<H', len(h)) + h.encode() + bytes(64 * 64 * 2))"
cp data/masks/00000.png npy/masks/a.png
cp -r npy/images/a.npy npy/images/b.npy && cp npy/masks/a.png npy/masks/b.png
check "has 2 channels, not the 4 of --in-channels (arrays are never converted)" "$train" "${small[@]}" --data npy \
  --in-channels 4 --batch-size 1
check "has no tensor 'layer1.2.conv1.weight', which --encoder resnet34 needs with shape [4, 4, 3, 3]; its layers are those of resnet18" \
  "$train" "${small[@]}" --encoder resnet34 --encoder-weights "$tests/golden/resnet18_w16.pth"
check "runs past the end of the file" "$predict" data/images --checkpoint huge_header.safetensors --width-divisor 16
check "outside 0..10000000" "$train" "${small[@]}" --resume epoch_max.safetensors
check "outside 0..10000000" "$train" "${small[@]}" --resume epoch_neg.safetensors
check "monitored metric has a best that is not a finite number: 'nan'" "$train" "${small[@]}" --epochs 3 \
  --early-stop 2 --resume record_nan.safetensors
check "has stale '7', not a whole number in 0..0" "$train" "${small[@]}" --epochs 3 --resume record_stale.safetensors
check "has a run value 'run.note' that is empty or too long" "$train" "${small[@]}" --epochs 3 \
  --resume record_long.safetensors
check "has total_steps '-3', not a whole number >= 1" "$train" "${small[@]}" --epochs 3 --resume record_steps.safetensors
# Images: an out-of-bounds JPEG, decompression bombs, masks of another size.
check "dht.jpg" "$predict" dht.jpg --checkpoint good.safetensors --width-divisor 16 --out pred
check "00004.jpg" "$train" "${small[@]}" --data bad_jpeg --val-fraction 0.2 --batch-size 2
check "pixels" "$predict" bomb.bmp --checkpoint good.safetensors --width-divisor 16 --out pred
check "pixels" "$predict" bomb.jpg --checkpoint good.safetensors --width-divisor 16 --out pred
check "pixels" "$train" "${small[@]}" --data bomb --val-fraction 0.2 --batch-size 2
check "is 32x32 but its image" "$train" "${small[@]}" --data mismatch --val-fraction 0.2 --batch-size 2
# Values that cannot train, and outputs that cannot be written (refused before training).
check "validation loss is not finite" "$train" --lr 16 --epochs 3 --image-size 32 --train-size 16 \
  --val-size 8 --width-divisor 16 --no-progress --checkpoint nonfinite.safetensors
[ -e nonfinite.safetensors ] && { echo "FAIL: a non-finite model was saved"; fail=1; }
check "cannot write the profile trace" "$train" "${small[@]}" --profile /nonexistent/trace.json
check "cannot write the checkpoint" "$train" "${small[@]}" --checkpoint adir
check "is larger than the 5 training images of data" "$train" "${small[@]}" --data data --val-fraction 0.2
# Masks as users have them: a value that is no class, an RGB mask without colours, a colour
# missing from the table; an empty output name; a data folder entry named like an image that
# is none (a dangling link, a folder).
"$make_data" cls --count 6 --size 64 --classes 3 > /dev/null || { echo "FAIL: setup 3-class dataset"; exit 1; }
check "holds 2, not one of the 2 classes (0..1) and no ignore index is set" "$train" "${small[@]}" --data cls \
  --classes 2 --val-fraction 0.2 --batch-size 2
mkdir -p rgb/images rgb/masks && cp data/images/* rgb/images/ && cp data/images/* rgb/masks/
check "is an RGB image; with 3 classes give a class colour table" "$train" "${small[@]}" \
  --data rgb --classes 3 --val-fraction 0.2 --batch-size 2
printf '0,0,0,background\n1,2,3,one\n4,5,6,two\n' > colors.txt
check "is not in the class colour table" "$train" "${small[@]}" --data rgb --class-colors colors.txt \
  --val-fraction 0.2 --batch-size 2
check "--class-colors lists 3 colours for --classes 2" "$train" "${small[@]}" --data rgb --class-colors colors.txt \
  --classes 2 --val-fraction 0.2 --batch-size 2
check "--checkpoint: is empty" "$train" "${small[@]}" --checkpoint ''
check "--log: is empty" "$train" "${small[@]}" --log ''
cp -r data dangling && ln -s nowhere.png dangling/images/00009.png
check "dangling/images/00009.png' cannot be opened" "$train" "${small[@]}" --data dangling --val-fraction 0.2 --batch-size 2
cp -r data withdir && mkdir withdir/masks/00007.png
check "withdir/masks/00007.png' is a folder, not a regular file" "$train" "${small[@]}" --data withdir \
  --val-fraction 0.2 --batch-size 2

# Ctrl-C: the step finishes, the checkpoint is written, exit 130; a resume continues.
cases=$((cases + 1))
"$train" --epochs 1000 --image-size 32 --train-size 64 --val-size 4 --width-divisor 16 \
  --batch-size 4 --no-progress --checkpoint int.safetensors > int.out 2> int.err &
pid=$!
for _ in $(seq 200); do grep -q '^epoch 1/' int.out 2> /dev/null && break; sleep 0.1; done
kill -INT $pid
wait $pid
rc=$?
if [ $rc -ne 130 ] || ! grep -q "interrupted .* checkpoint written to int.safetensors" int.err \
   || [ ! -e int.safetensors ]; then
  echo "FAIL: Ctrl-C: rc $rc: $(cat int.err)"; fail=1
else
  # One more epoch than the interrupted one, wherever the signal landed.
  e=$(sed -nE 's/.*interrupted (at|after) epoch ([0-9]+).*/\2/p' int.err)
  out=$(timeout 120 "$train" --epochs $((e + 1)) --image-size 32 --train-size 64 --val-size 4 --width-divisor 16 \
        --batch-size 4 --no-progress --resume int.safetensors 2>&1)
  if [ $? -ne 0 ] || ! grep -q "resumed from int.safetensors after epoch" <<<"$out"; then
    echo "FAIL: resume after Ctrl-C: $out"; fail=1
  else
    clean=$((clean + 1))
  fi
fi

echo "bad input: $cases cases, $clean ended cleanly"
[ $fail -eq 0 ] && echo "ok"
exit $fail
