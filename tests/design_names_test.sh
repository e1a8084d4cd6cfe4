#!/usr/bin/env bash
# A design page names only what exists, so it cannot drift silently from the code it describes.
#
#   tests/design_names_test.sh DOCFILE SOURCE_DIR
#
# Every `backticked` span of DOCFILE outside ``` fences is read as one of:
#  - a path (it contains "/", or a name ends in .h .cpp .cu .cuh .md .sh .py .txt; a bare
#    extension such as ".cu" is no path): it must exist under SOURCE_DIR. A trailing "/" names a
#    folder; "a/{b,c}.h" names a/b.h and a/c.h; in a pattern such as "engine/ops/<op>.cpp" the
#    folder before the "<" must exist;
#  - a C++ name: a CamelCase word (a class, struct or enum), "name()" or "name(args)" (a function),
#    or "A::B" (a qualified name, also with "()"): it must occur as a word in the code, the *.h,
#    *.cpp, *.cu and *.cuh files under SOURCE_DIR outside docs/, tests/, build*/ and .git/.
# Everything else is not checked: flags (--x), commands and prose (a span with a space that is no
# call), numbers, URLs, lower-case words, ALL_CAPS macros and variables, templates (<...>).
# Each missing name is printed with its line, and the test exits 1; else it prints how many
# spans it checked and exits 0.
set -euo pipefail
export LC_ALL=C

if [ $# -ne 2 ]; then
  echo "usage: $0 DOCFILE SOURCE_DIR" >&2
  exit 2
fi
doc=$1 root=$2
[ -r "$doc" ] || { echo "design_names: cannot read $doc" >&2; exit 2; }
[ -d "$root" ] || { echo "design_names: no folder $root" >&2; exit 2; }
[ "$root" = / ] || root=${root%/}

# The code, once, as one text to search.
code=$(mktemp)
trap 'rm -f "$code"' EXIT
find "$root" \( -path "$root/docs" -o -path "$root/tests" -o -path "$root/build*" -o -name .git \) -prune \
  -o -type f \( -name '*.h' -o -name '*.cpp' -o -name '*.cu' -o -name '*.cuh' \) -print0 |
  xargs -0 cat > "$code"
[ -s "$code" ] || { echo "design_names: no source files under $root" >&2; exit 2; }

# "LINE<TAB>SPAN" for every backticked span outside fenced blocks.
spans() {
  awk '/^[[:space:]]*```/ { fenced = !fenced; next }
       !fenced {
         line = $0
         while (match(line, /`[^`]+`/)) {
           printf "%d\t%s\n", NR, substr(line, RSTART + 1, RLENGTH - 2)
           line = substr(line, RSTART + RLENGTH)
         }
       }' "$doc"
}

path_exists() {
  local p=$1
  if [[ $p == *"<"* ]]; then                  # a pattern: its folder
    p=${p%%<*}
    p=${p%/*}
    [ -d "$root/$p" ]
    return
  fi
  if [[ $p =~ ^(.*)\{([^{}]*)\}(.*)$ ]]; then  # a/{b,c}.h: each
    local head=${BASH_REMATCH[1]} alts=${BASH_REMATCH[2]} tail=${BASH_REMATCH[3]} alt
    IFS=, read -ra alts <<< "$alts"
    for alt in "${alts[@]}"; do path_exists "$head$alt$tail" || return 1; done
    return 0
  fi
  if [[ $p == */ ]]; then [ -d "$root/$p" ]; else [ -e "$root/$p" ]; fi
}

ident='[A-Za-z_][A-Za-z0-9_]*'
checked=0 missing=0
while IFS=$'\t' read -r line span; do
  kind="" name=""
  if [[ $span == -* || $span == *://* || $span =~ ^[0-9.,/x×]+$ ]]; then
    continue                                                  # flag, URL, number
  elif [[ $span =~ ^($ident(::~?$ident)*)\(.*\)$ ]]; then
    kind=function name=${BASH_REMATCH[1]}                      # name() or A::b(args)
  elif [[ $span == *" "* ]]; then
    continue                                                  # a command or prose
  elif [[ $span == */* || $span =~ ^[^.].*\.(h|cpp|cu|cuh|md|sh|py|txt)$ ]]; then
    kind=path name=$span
  elif [[ $span =~ ^$ident(::$ident)+$ ]]; then
    kind=name name=$span                                      # A::B
  elif [[ $span =~ ^[A-Z][A-Za-z0-9]*$ && $span =~ [a-z] ]]; then
    kind=class name=$span                                     # CamelCase
  else
    continue
  fi
  checked=$((checked + 1))
  if [ "$kind" = path ]; then
    path_exists "$name" && continue
    echo "$doc:$line: no file or folder $name under $root"
  else
    grep -qwF -- "$name" "$code" && continue
    echo "$doc:$line: $kind $name is not in the code under $root"
  fi
  missing=$((missing + 1))
done < <(spans)

if [ "$missing" -gt 0 ]; then
  echo "design_names: $missing of $checked names in $doc do not exist"
  exit 1
fi
echo "design_names: all $checked paths and names in $doc exist"
