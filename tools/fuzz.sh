#!/usr/bin/env bash
# Fuzzes the readers of untrusted files with clang's libFuzzer under ASan + UBSan:
#   safetensors  read_safetensors + load_model_state into a small UNet (checkpoints, --resume)
#   image        load_image (RGB and gray) + resize_bilinear / resize_nearest_mask (data sets)
#   train        load_checkpoint's <file>.train reader (optimizer state) with Adam, and the
#                run's record of its monitored metric (MetricMonitor::restore)
#   torch        read_torch_bytes: torch.save's zip archive (libzip) and its pickle (the
#                restricted unpickler), every tensor copied out (--encoder-weights FILE.pth)
#   npy          read_image_info + load_image_values on a NumPy .npy array (--in-channels)
# (tests/fuzz/targets.h says exactly what each does with an input.)
#
# Usage: tools/fuzz.sh [SECONDS] [TARGET...]   each target for SECONDS (default 60), all by default
#        tools/fuzz.sh --update-seeds          rewrite tests/corpus/<target>/seed_* for the
#                                              current model and writers, and the bad_* made
#                                              from them (needs python3; the torch seeds,
#                                              real torch.save outputs, need PyTorch)
# Environment: FUZZ_FLAGS adds libFuzzer flags (e.g. "-fork=0" to stop at the first finding).
#
# Builds in build-fuzz/ (clang, -DUNETCU_FUZZ=ON, CUDA off) and starts each fuzzer from fresh
# seeds, the regression corpus tests/corpus/<target>/ and what earlier runs found
# (build-fuzz/corpus/<target>/, kept between runs). Runs in libFuzzer's fork mode, so one
# finding does not end the run. A finding is a crash, a sanitizer report, an exception other
# than unetcu::Error, a leak, a timeout (10 s for one input) or one allocation over 256 MiB
# (-malloc_limit_mb: the fuzzed inputs are at most a few hundred KiB, so that is a reader
# trusting a size it read). Findings are grouped by signature (the kind and the first stack
# frame in our code, stb or nlohmann-json); the smallest input of each new signature is copied
# into tests/corpus/<target>/, which the ordinary test suite replays (tests/test_corpus.cpp),
# and the script exits 1. Signatures of tests/corpus/known_findings.txt are reported as known,
# not copied again. Prints the executions per target. Not part of CI: CI replays the corpus.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
build=build-fuzz
bin=$build/tests/fuzz  # the fuzzer programs and the seed writer
all_targets=(safetensors image train torch npy)
limits=(-timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=256)

seconds=60
update_seeds=0
targets=()
for arg in "$@"; do
  case "$arg" in
    --update-seeds) update_seeds=1 ;;
    -h|--help) sed -n "2,25p" "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    ''|*[!0-9]*)
      [[ " ${all_targets[*]} " == *" $arg "* ]] || { echo "fuzz.sh: unknown target or flag '$arg'" >&2; exit 2; }
      targets+=("$arg") ;;
    *) seconds=$arg ;;
  esac
done
[ ${#targets[@]} -gt 0 ] || targets=("${all_targets[@]}")

# ---- dependencies: the build's packages, then clang with libFuzzer and its OpenMP --------
tools/setup.sh
probe_dir=$(mktemp -d)
trap 'rm -rf "$probe_dir"' EXIT
toolchain_works() {
  command -v clang++ >/dev/null 2>&1 || return 1
  printf '%s\n' '#include <omp.h>' \
    'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return omp_get_max_threads() > 0 ? 0 : 1; }' \
    >"$probe_dir/probe.cpp"
  clang++ -fopenmp -fsanitize=fuzzer,address,undefined "$probe_dir/probe.cpp" -o "$probe_dir/probe" \
    >/dev/null 2>&1
}
if ! toolchain_works; then
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  # clang and its OpenMP runtime; libFuzzer is in libclang-rt-dev where the distribution splits
  # it out (Debian 12), else in clang's own packages.
  pkgs=(clang libomp-dev)
  apt-cache show libclang-rt-dev >/dev/null 2>&1 && pkgs+=(libclang-rt-dev)
  echo "fuzz: installing ${pkgs[*]}"
  $SUDO apt-get install -y -qq --no-install-recommends "${pkgs[@]}"
  toolchain_works || { echo "fuzz: clang++ -fsanitize=fuzzer -fopenmp still fails to link" >&2; exit 1; }
fi

# ---- build ------------------------------------------------------------------------------
CC=clang CXX=clang++ cmake -S . -B "$build" -DUNETCU_FUZZ=ON -DUNETCU_CUDA=OFF \
  -DUNETCU_BUILD_TESTS=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$build" -j"$(nproc)" --target unetcu_fuzz_seeds $(printf 'fuzz_%s ' "${all_targets[@]}")

if [ "$update_seeds" -eq 1 ]; then
  # The seeds, then the hand-made breakages of them (tests/corpus/make_malformed.py).
  rm -f tests/corpus/{safetensors,image,train}/seed_* tests/corpus/*/bad_*
  "$bin/unetcu_fuzz_seeds" tests/corpus
  if /usr/bin/python3 -c "import torch" 2>/dev/null; then
    rm -f tests/corpus/torch/seed_*
    /usr/bin/python3 tests/corpus/make_torch_seeds.py
  else
    echo "fuzz: no PyTorch for /usr/bin/python3: the torch seeds stay as they are"
  fi
  python3 tests/corpus/make_malformed.py
  exit 0
fi
rm -rf "$build/seeds"
"$bin/unetcu_fuzz_seeds" "$build/seeds" >/dev/null
# Targets whose seeds the seed writer does not make (torch: real torch.save outputs, in the
# regression corpus) start from an empty folder here.
for t in "${all_targets[@]}"; do mkdir -p "$build/seeds/$t"; done
# The targets' scratch files (and libFuzzer's) under build-fuzz/tmp/, removed at the end: a
# crashing input leaves its process no chance to remove its own.
export TMPDIR="$root/$build/tmp"
rm -rf "$TMPDIR" && mkdir -p "$TMPDIR"
trap 'rm -rf "$probe_dir" "$TMPDIR"' EXIT

# ---- findings: one signature per bug ------------------------------------------------------
# "kind@file:line": the kind of report and the first stack frame in our sources, stb or
# nlohmann-json (not libc, the C++ library or the sanitizer runtime). A timeout is not rerun
# (it takes the whole timeout, and its stack is the waiting thread's): "timeout:" and the
# input's first bytes, which name its format.
signature() {  # target file
  local t=$1 f=$2 out kind frame
  case "$(basename "$f")" in
    timeout-*) echo "timeout:$(head -c 4 "$f" | od -An -tx1 | tr -d ' \n')"; return ;;
  esac
  if out=$(timeout 120 "$bin/fuzz_$t" -runs=1 "${limits[@]}" "$f" 2>&1); then
    echo "does-not-reproduce"
    return
  fi
  if grep -q 'runtime error:' <<<"$out"; then kind=ubsan
  elif grep -q 'ERROR: AddressSanitizer: [A-Za-z]' <<<"$out"; then
    kind=asan-$(grep -oE 'ERROR: AddressSanitizer: [A-Za-z-]+' <<<"$out" | head -1 | awk '{print $3}')
  elif grep -q 'ERROR: LeakSanitizer' <<<"$out"; then kind=leak
  elif grep -q 'out-of-memory' <<<"$out"; then kind=oom
  elif grep -q 'timeout after' <<<"$out"; then kind=timeout
  elif grep -q 'uncaught' <<<"$out"; then kind=uncaught-exception
  else kind=crash
  fi
  frame=$(grep -E '^ *#[0-9]+ 0x[0-9a-f]+ in ' <<<"$out" | grep -v ' in stbi__malloc' |
    grep -oE "($root/|/usr/include/(stb|nlohmann)/)[^ :]*:[0-9]+" | head -1 || true)
  echo "$kind@${frame#"$root"/}"
}

# ---- fuzz -------------------------------------------------------------------------------
# Inputs of tests/corpus/known_findings.txt (a fix pending elsewhere) stay out of the start
# corpus: their findings are known.
known=$(grep -v '^[[:space:]]*\(#\|$\)' tests/corpus/known_findings.txt 2>/dev/null | awk '{print $1}' || true)
summary=()
found=0
for t in "${targets[@]}"; do
  work="$build/corpus/$t" regress="$build/regress/$t" findings="$build/findings/$t" log="$build/fuzz_$t.log"
  mkdir -p "$work" "$findings"
  rm -rf "$regress" && mkdir -p "$regress"
  for f in tests/corpus/"$t"/*; do
    [ -f "$f" ] || continue
    grep -qxF "$t/$(basename "$f")" <<<"$known" || cp "$f" "$regress/"
  done
  rm -f "$findings"/*
  dict=()
  [ -f "tests/fuzz/$t.dict" ] && dict=(-dict="tests/fuzz/$t.dict")
  echo "fuzz: $t for ${seconds}s (log: $log)"
  rc=0
  # shellcheck disable=SC2086  # FUZZ_FLAGS is a list of flags
  "$bin/fuzz_$t" -fork=1 -ignore_crashes=1 -ignore_timeouts=1 -ignore_ooms=1 \
    -max_total_time="$seconds" "${limits[@]}" -print_final_stats=1 -artifact_prefix="$findings/" \
    "${dict[@]}" ${FUZZ_FLAGS:-} "$work" "$build/seeds/$t" "$regress" >"$log" 2>&1 || rc=$?
  # Executions: the fork mode's last status line ("#N: cov: ..."), else the final stats.
  execs=$(grep -oE '^#[0-9]+: cov' "$log" | tail -1 | grep -oE '[0-9]+' || true)
  [ -n "$execs" ] || execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | awk '{s += $2} END {print s + 0}')
  rate=$(awk -v n="$execs" -v s="$seconds" 'BEGIN {printf "%.0f", n / s}')

  # Group the findings by signature, smallest input first; known signatures are not copied.
  declare -A known_sig=() seen=()
  for k in $(grep "^$t/" <<<"$known" || true); do
    [ -f "tests/corpus/$k" ] && known_sig[$(signature "$t" "tests/corpus/$k")]=$k
  done
  new=() known_hits=() stray=0
  while read -r a; do
    [ -n "$a" ] || continue
    case "$(basename "$a")" in slow-unit-*) continue ;; esac  # slow, not wrong
    sig=$(signature "$t" "$a")
    if [ "$sig" = does-not-reproduce ]; then stray=$((stray + 1)); continue; fi
    [ -z "${seen[$sig]:-}" ] || continue
    seen[$sig]=$a
    if [ -n "${known_sig[$sig]:-}" ]; then
      known_hits+=("$sig (as ${known_sig[$sig]})")
    else
      cp "$a" "tests/corpus/$t/"
      new+=("tests/corpus/$t/$(basename "$a"): $sig")
    fi
  done < <(ls -Sr "$findings" 2>/dev/null | sed "s|^|$findings/|")
  line="$t: $execs executions (~$rate/s), corpus $(ls "$work" | wc -l) inputs"
  [ ${#known_hits[@]} -eq 0 ] || line+="; known: ${known_hits[*]}"
  [ "$stray" -eq 0 ] || line+="; $stray finding(s) that do not reproduce alone (see $findings)"
  if [ ${#new[@]} -gt 0 ]; then
    found=1
    line+="; NEW: ${new[*]}"
  elif [ "$rc" -ne 0 ] && [ -z "$(ls "$findings")" ]; then  # fork mode exits 1 after any finding
    found=1
    line+="; the fuzzer failed (exit $rc), see $log"
    tail -20 "$log"
  else
    line+="; no new findings"
  fi
  summary+=("$line")
  unset known_sig seen
done

echo
echo "fuzz summary (${seconds}s per target):"
printf '  %s\n' "${summary[@]}"
if [ "$found" -ne 0 ]; then
  echo "New findings are now regression files under tests/corpus/ (replayed by unetcu_tests);"
  echo "see one with: $bin/fuzz_<target> FILE"
  exit 1
fi
