# Sourced by the tests that check against Python (PyTorch, torchvision, matplotlib):
#   need_python "MODULES" "WHAT" "WHERE FROM"
# sets py=/usr/bin/python3 when it imports MODULES (a comma-separated import list), else prints
# "SKIPPED: no WHAT for /usr/bin/python3 (WHERE FROM)" and exits 77; then makes a scratch folder
# $d, removed at exit, and sets fail=0.
need_python() {
  py=/usr/bin/python3
  if ! "$py" -c "import $1" 2>/dev/null; then
    echo "SKIPPED: no $2 for $py ($3)"
    exit 77
  fi
  d=$(mktemp -d)
  trap 'rm -rf "$d"' EXIT
  fail=0
}
