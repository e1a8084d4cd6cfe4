#!/usr/bin/env bash
# Fails when a source file includes a header from a layer above its own, listing file:line for
# each such include. The layers are those of the CMake targets, linked downward only; this test
# catches what the linker cannot (a header-only use of a higher layer).
# Usage: layering_test.sh [source root]   (default: the checkout this script is in)
set -u
root="${1:-$(cd "$(dirname "$0")/.." && pwd)}"
cd "$root" || exit 2

# The layers, bottom up: a rank, then the folders (or single files) at that rank. A file may
# include what is at its own rank or below. The longest matching prefix decides (a file or
# subfolder may be named apart from its folder). A new folder is one line (or one word) here;
# an include from a folder missing here fails the test. Two lines of the same rank are
# siblings that may not include each other (apps/ and bench/: what both need is in cli/ or
# below); folders on one line may.
LAYERS='
0 bodies
1 runtime
2 kernels
3 engine
4 models data
5 parallel
6 planning
7 train
8 cli
9 apps
9 bench
10 tools tests emulator
'
# Folders whose files include only each other and the C++ standard library (<cmath>, not
# <cuda_runtime.h>): the bodies that g++ and nvcc both compile.
STD_ONLY='bodies'

# Prints "rank folder line" for a path under a folder of the table (line: the table's line
# that names it), nothing otherwise.
layer_of() {
  local path="$1" best="" best_folder="" best_line="" rank folders f n=0
  while read -r rank folders; do
    n=$((n + 1))
    for f in $folders; do
      if [[ "$path" == "$f" || "$path" == "$f"/* ]] && ((${#f} > ${#best_folder})); then
        best=$rank best_folder=$f best_line=$n
      fi
    done
  done <<<"$LAYERS"
  [ -n "$best" ] && echo "$best $best_folder $best_line"
}

is_std_only() {
  local f
  for f in $STD_ONLY; do [[ "$1" == "$f"/* ]] && return 0; done
  return 1
}

fail=0
checked=0
folders=$(awk 'NF > 1 { for (i = 2; i <= NF; ++i) print $i }' <<<"$LAYERS")
files=$(for f in $folders; do
  [ -e "$f" ] && find "$f" -type f \( -name '*.h' -o -name '*.hpp' -o -name '*.cpp' \
    -o -name '*.cc' -o -name '*.cu' -o -name '*.cuh' \)
done | sort -u)

for file in $files; do
  read -r own own_folder own_line < <(layer_of "$file")
  checked=$((checked + 1))
  # #include "..." lines: the project's own headers (or a file beside this one).
  while IFS=: read -r line text; do
    inc=$(sed -E 's/^[[:space:]]*#[[:space:]]*include[[:space:]]*"([^"]+)".*/\1/' <<<"$text")
    target=$(layer_of "$inc")
    if [ -z "$target" ]; then  # relative to the including file?
      rel=$(realpath -m --relative-to=. "$(dirname "$file")/$inc")
      [ -e "$rel" ] && target=$(layer_of "$rel") && inc=$rel
    fi
    if [ -z "$target" ]; then
      top=${inc%%/*}
      if [[ "$inc" == */* && "$top" != . && "$top" != .. && -d "$top" ]]; then
        echo "$file:$line: includes \"$inc\" from $top/, a folder missing from the layer table"
        fail=1
      elif is_std_only "$file"; then
        echo "$file:$line: includes \"$inc\", outside $own_folder and the standard library"
        fail=1
      fi
      continue
    fi
    read -r rank folder table_line <<<"$target"
    if ((rank > own)); then
      echo "$file:$line: includes \"$inc\" ($folder, layer $rank) from $own_folder (layer $own)"
      fail=1
    elif ((rank == own && table_line != own_line)); then
      echo "$file:$line: includes \"$inc\" ($folder) from its sibling $own_folder (both layer $own)"
      fail=1
    fi
  done < <(grep -nE '^[[:space:]]*#[[:space:]]*include[[:space:]]*"' "$file")
  # #include <...> in the std-only folders: standard headers have no extension.
  if is_std_only "$file"; then
    while IFS=: read -r line text; do
      echo "$file:$line: ${text#"${text%%[![:space:]]*}"} is not a C++ standard header" \
           "($own_folder includes only the standard library)"
      fail=1
    done < <(grep -nE '^[[:space:]]*#[[:space:]]*include[[:space:]]*<[^>]*\.[^>]*>' "$file")
  fi
done

if [ "$checked" -eq 0 ]; then
  echo "FAIL: no source files found under $root"
  exit 1
fi
if [ "$fail" -ne 0 ]; then
  echo "FAIL: includes above their layer or from a sibling (the order is the table at the top of $0)"
  exit 1
fi
echo "ok: $checked files include only their own layer or those below"
