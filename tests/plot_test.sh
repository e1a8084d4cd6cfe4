#!/usr/bin/env bash
# tools/plot.py renders each plot from a small fixture: the curves of two runs (CSV and JSON
# Lines; with a third panel where a run's learning rate varies), the epoch-time bars and the split-size x cut heat map of a bench.json; every PNG must
# decode with the size its figure asks for. Skipped (77) without matplotlib, with the reason.
set -u
root="$1"
. "$(dirname "$0")/python_test_lib.sh"
need_python "matplotlib, PIL" matplotlib "tools/setup.sh --plots installs python3-matplotlib"
"$py" "$root/tools/plot.py" metrics "$root/tests/fixtures/metrics.csv" "$root/tests/fixtures/metrics.jsonl" \
  --labels adam,sgd --out "$d/curves.png" || { echo "FAIL: metrics plot"; fail=1; }
"$py" "$root/tools/plot.py" bench "$root/tests/fixtures/bench.json" --out-dir "$d" || { echo "FAIL: bench plots"; fail=1; }
check() {  # file, width, height
  "$py" - "$1" "$2" "$3" <<'PY' || { echo "FAIL: $1"; fail=1; }
import sys
from PIL import Image
im = Image.open(sys.argv[1]); im.load()
want = (int(sys.argv[2]), int(sys.argv[3]))
assert im.size == want, f"{sys.argv[1]}: {im.size}, expected {want}"
assert len(set(im.convert("L").getdata())) > 10, "an empty picture"
PY
}
check "$d/curves.png" 1000 400
# A run whose learning rate varies (here 0.001, 0.002, 0.003) adds a third panel, its rate per epoch.
sed -E 's/^(epoch,([0-9]),.*),0\.001,/\1,0.00\2,/' "$root/tests/fixtures/metrics.csv" > "$d/sched.csv"
grep -q '^epoch,2,.*,0\.002,' "$d/sched.csv" || { echo "FAIL: the scheduled fixture"; fail=1; }
"$py" "$root/tools/plot.py" metrics "$root/tests/fixtures/metrics.csv" "$d/sched.csv" --out "$d/sched.png" ||
  { echo "FAIL: metrics plot with a schedule"; fail=1; }
check "$d/sched.png" 1500 400
check "$d/table2.png" 700 400
check "$d/table1.png" 760 600
# A file that is not a metrics log is refused with a message.
out=$("$py" "$root/tools/plot.py" metrics "$root/tests/fixtures/bench.json" --out "$d/x.png" 2>&1) && { echo "FAIL: bad file accepted"; fail=1; }
grep -q "no epoch rows" <<<"$out" || { echo "FAIL: message: $out"; fail=1; }
[ -e "$d/x.png" ] && { echo "FAIL: a half-made plot was left"; fail=1; }
exit $fail
