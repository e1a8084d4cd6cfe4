#!/usr/bin/env bash
# Installs the Debian packages the build needs, only those missing. Safe to run again.
# ccache is optional to the build (CMakeLists.txt uses it when present) and keeps rebuilds short.
# --plots also installs matplotlib for tools/plot.py (and unet_bench --plot); --pytorch installs
# PyTorch and torchvision for tools/pytorch_reference.py (export-encoder, bench, golden) and
# bench/cpu_vs_pytorch.py.
set -euo pipefail
pkgs=(cmake g++ make ccache libopenblas-openmp-dev libdnnl-dev openmpi-bin libopenmpi-dev libgloo-dev doctest-dev libstb-dev nlohmann-json3-dev libcli11-dev libzip-dev)
for arg in "$@"; do
  case "$arg" in
    --plots) pkgs+=(python3-matplotlib) ;;
    --pytorch) pkgs+=(python3-torch python3-torchvision) ;;
    *) echo "setup: unknown option '$arg' (--plots, --pytorch)" >&2; exit 2 ;;
  esac
done
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all build packages present"
  exit 0
fi
echo "setup: installing ${missing[*]}"
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
