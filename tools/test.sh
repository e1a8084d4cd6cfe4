#!/usr/bin/env bash
# Installs what the build needs, builds everything (CUDA parts for sm_90 only, to keep the
# build short; override with CUDA_ARCHS) and runs the whole test suite through ctest, then the
# CUDA suite on the CUDA emulator (tools/test_cuda_emu.sh). The cases run side by side, one per
# core (ctest -j; the ones that run several processes or wait on the clock run alone). It ends,
# pass or fail, with the build and suite times, the ten slowest tests and the wall time
# (docs/development.md has the figures).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
times=()  # "what: N s", in order
report() {
  local rc=$?
  set +e +o pipefail  # the report never changes the exit status (head closes sort's pipe early)
  [ ${#times[@]} -gt 0 ] || exit "$rc"
  echo
  echo "== tools/test.sh on $(nproc) cores ($(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1))"
  [ -f build-emu/times.txt ] && mapfile -t -O "${#times[@]}" times < build-emu/times.txt
  printf '  %s\n' "${times[@]}"
  local logs=()
  for f in build/ctest.log build-emu/ctest.log; do [ -f "$f" ] && logs+=("$f"); done
  if [ ${#logs[@]} -gt 0 ]; then
    echo "  the ten slowest tests:"
    # ctest's lines: "  3/64 Test  #3: NAME ......   Passed   12.34 sec"
    sed -nE 's/^ *[0-9]+\/[0-9]+ Test +#[0-9]+: (.*[^ .]) \.+ *[*A-Za-z ]+ +([0-9.]+) sec$/\2\t\1/p' "${logs[@]}" |
      sort -rn | head -10 | awk -F'\t' '{ printf "    %7.1f s  %s\n", $1, $2 }'
  fi
  echo "  total wall time: $((SECONDS - start)) s$([ "$rc" = 0 ] || echo " (failed, exit $rc)")"
  exit "$rc"
}
trap report EXIT
# matplotlib and torchvision too: tests/plot_test.sh renders every plot, and
# tests/encoder_export_test.sh checks the engine's encoder against torchvision's.
tools/setup.sh --plots --pytorch
rm -f build/ctest.log build-emu/ctest.log build-emu/times.txt  # the report reads this run's only
t=$SECONDS
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCHS:-90}" >/dev/null
cmake --build build -j"$(nproc)"
times+=("build: $((SECONDS - t)) s")
t=$SECONDS
ctest --test-dir build --output-on-failure -j"$(nproc)" 2>&1 | tee build/ctest.log
times+=("CPU suite: $((SECONDS - t)) s")
# The CUDA suite on the CUDA emulator (emulator/README.md): no GPU needed. It writes
# its own build and suite times.
tools/test_cuda_emu.sh
