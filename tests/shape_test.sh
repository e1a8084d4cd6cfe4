#!/usr/bin/env bash
# The code keeps the shape the project agreed on (docs/development.md, "Shape"):
#  - apps/ only parses: at most 1,200 lines in all, no function over 80 lines, no main over 60;
#  - the training-strategy seam stays narrow: TrainingStrategy has at most 12 virtual methods
#    (its destructor not counted);
#  - the prose a reader meets first stays short: README.md at most 150 lines, docs/design.md at
#    most 250 lines and no line of it over 120 characters.
# Each breach is printed; exit 1 if any, else 0 with the figures.
#
#   tests/shape_test.sh SOURCE_DIR
set -euo pipefail
root=${1:?usage: tests/shape_test.sh SOURCE_DIR}
cd "$root"
fail=0
breach() { echo "FAIL: $*"; fail=1; }

apps_lines=$(cat apps/*.cpp apps/*.h | wc -l)
[ "$apps_lines" -le 1200 ] || breach "apps/ has $apps_lines lines (at most 1200)"

# A function: from a line that starts a definition at column 0 (a name, a parenthesis, no
# semicolon) to the next "}" at column 0.
longest=$(awk '
  /^[A-Za-z][^;]*\(/ && !/^(namespace|using|struct|class|enum|#)/ { if (!start) { start = FNR; name = $0 } }
  /^}/ && start {
    n = FNR - start + 1
    limit = (name ~ /^int main\(/) ? 60 : 80
    if (n > limit) printf "%s:%d: %d lines (at most %d): %s\n", FILENAME, start, n, limit, name
    start = 0
  }' apps/*.cpp)
[ -z "$longest" ] || breach "functions too long in apps/:
$longest"

header=train/strategy.h
virtuals=$(awk '/^class TrainingStrategy /,/^};/' "$header" | grep -c '^ *virtual ' || true)
destructor=$(awk '/^class TrainingStrategy /,/^};/' "$header" | grep -c 'virtual ~' || true)
virtuals=$((virtuals - destructor))
[ "$virtuals" -gt 0 ] || breach "no TrainingStrategy class with virtual methods found in $header"
[ "$virtuals" -le 12 ] || breach "TrainingStrategy has $virtuals virtual methods (at most 12)"

readme=$(wc -l < README.md)
[ "$readme" -le 150 ] || breach "README.md has $readme lines (at most 150)"
design=$(wc -l < docs/design.md)
[ "$design" -le 250 ] || breach "docs/design.md has $design lines (at most 250)"
wide=$(awk 'length($0) > 120 { printf "docs/design.md:%d: %d characters\n", NR, length($0) }' docs/design.md)
[ -z "$wide" ] || breach "lines over 120 characters:
$wide"

[ "$fail" = 0 ] || exit 1
echo "shape: apps/ $apps_lines lines, TrainingStrategy $virtuals virtual methods, README.md $readme lines," \
     "docs/design.md $design lines"
