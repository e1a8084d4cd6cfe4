#!/usr/bin/env bash
# Gathers the header-only build dependencies (CLI11, doctest, nlohmann-json, with their CMake files)
# from this machine's Debian packages into .deps/usr, for the GPU machine, which has no Debian
# packages of its own. Pass `.deps` in the device tool's carry list; tools/gpu_check.sh finds it.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh >/dev/null
rm -rf .deps
for pkg in libcli11-dev doctest-dev nlohmann-json3-dev libstb-dev; do
  dpkg -L "$pkg" | while read -r f; do
    case "$f" in *.so*|*.a) continue ;; esac  # headers and CMake files only
    if [ -f "$f" ]; then install -D -m 644 "$f" ".deps$f"; fi
  done
done
du -sh .deps
