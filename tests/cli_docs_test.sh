#!/usr/bin/env bash
# docs/cli.md lists every flag of every program, and no flag that is gone.
#
#   tests/cli_docs_test.sh DOC PROGRAM...
#
# For each PROGRAM (a path to a binary) it runs `PROGRAM --help` and takes the long flags
# (`--name`) from its option lines, --help itself left out. In DOC, the program's flags are the
# first table after the heading `## NAME` (NAME: the binary's file name): each row whose first
# cell begins with a backticked flag (`| \`--name VALUE\` | ...`) names that flag; other rows
# (group titles, positional arguments) and everything after the table (prose, more tables,
# examples) do not count. Every flag of the help missing from the table, every flag of the
# table missing from the help, and every flag listed twice is printed with the program's name,
# and the test exits 1; else it prints the count and exits 0. A program that is not built (the
# sanitizer build builds only what its other tests run) is named and not checked.
set -euo pipefail
export LC_ALL=C  # one collation for sort, comm and uniq

if [ $# -lt 2 ]; then
  echo "usage: $0 DOC PROGRAM..." >&2
  exit 2
fi
doc=$1
shift
[ -r "$doc" ] || { echo "cli_docs: cannot read $doc" >&2; exit 2; }

# The long flags of a CLI11 help text: option lines start with a few spaces and a dash
# ("  -h,--help ...", "  --epochs INT=10 ..."); descriptions and their wrapped lines never do.
help_flags() {
  awk 'match($0, /^ +-/) && RLENGTH <= 5 {
         n = split($1, names, ",")
         for (i = 1; i <= n; i++)
           if (names[i] ~ /^--[A-Za-z0-9]/ && names[i] != "--help") print names[i]
       }' | sort
}

# The flags of the first table under "## NAME" in the doc, one per row, duplicates kept.
doc_flags() {
  awk -v name="$1" '
    /^## / { in_section = ($0 == "## " name); in_table = 0; table_done = 0; next }
    !in_section || table_done { next }
    /^\|/ { in_table = 1
            split($0, cells, "|")
            cell = cells[2]
            if (match(cell, /^ *`--[A-Za-z0-9][A-Za-z0-9-]*/)) {
              flag = substr(cell, RSTART, RLENGTH)
              sub(/^ *`/, "", flag)
              print flag
            }
            next }
    in_table { table_done = 1 }
  ' "$doc" | sort
}

fail=0
checked=0
flags_total=0
for prog in "$@"; do
  name=$(basename "$prog")
  if [ ! -x "$prog" ]; then
    echo "$name: not built here ($prog), not checked"
    continue
  fi
  if ! help=$("$prog" --help 2>&1); then
    echo "$name: '$name --help' failed:"
    printf '%s\n' "$help" | sed -n 1,5p
    fail=1
    continue
  fi
  from_help=$(printf '%s\n' "$help" | help_flags)
  from_doc=$(doc_flags "$name")
  if [ -z "$from_doc" ] && ! grep -qx "## $name" "$doc"; then
    echo "$name: no '## $name' section with a flag table in $doc"
  fi
  missing=$(comm -23 <(printf '%s\n' "$from_help" | sort -u) <(printf '%s\n' "$from_doc" | sort -u) | sed '/^$/d')
  stale=$(comm -13 <(printf '%s\n' "$from_help" | sort -u) <(printf '%s\n' "$from_doc" | sort -u) | sed '/^$/d')
  twice=$(printf '%s\n' "$from_doc" | sed '/^$/d' | uniq -d)
  for f in $missing; do echo "$name: $f is in --help but not in $doc"; fail=1; done
  for f in $stale; do echo "$name: $f is in $doc but not in --help (stale)"; fail=1; done
  for f in $twice; do echo "$name: $f has more than one row in $doc"; fail=1; done
  checked=$((checked + 1))
  flags_total=$((flags_total + $(printf '%s\n' "$from_help" | sed '/^$/d' | wc -l)))
done

if [ "$checked" -eq 0 ]; then
  echo "cli_docs: none of the programs is built"
  exit 1
fi
if [ "$fail" -ne 0 ]; then
  echo "cli_docs: $doc differs from the programs' --help (above)"
  exit 1
fi
programs="programs"
[ "$checked" -eq 1 ] && programs="program"
echo "cli_docs: $flags_total flags of $checked $programs, each with one row in $doc"
