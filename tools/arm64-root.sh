#!/usr/bin/env bash
# An aarch64 Python with torch, for running edgellm's NEON kernels end to end under qemu-user on an
# x86-64 machine (tests/kernels/test_neon_python.py). No binfmt_misc or root-only chroot is needed:
# debootstrap's first stage unpacks Debian's arm64 base, the packages below are unpacked over it,
# and the Python wheels are installed for aarch64 with pip's --platform. qemu's -L maps the root's
# files over the host's, so /proc/cpuinfo here is a Cortex-A76-like one: qemu-user shows the host's.
# Usage: tools/arm64-root.sh [DIR]   (default .arm64root; ~1.3 GB, a few minutes of downloads)
set -euo pipefail
root="$(realpath -m "${1:-.arm64root}")"
pip="${PIP:-python3 -m pip}"
command -v debootstrap >/dev/null || apt-get install -y -q debootstrap >/dev/null
if [ ! -x "$root/usr/bin/python3.11" ]; then
  debootstrap --foreign --arch=arm64 --variant=minbase --include=python3,libgomp1 bookworm "$root" \
    http://deb.debian.org/debian >/dev/null
  for deb in "$root"/var/cache/apt/archives/*.deb; do dpkg-deb -x "$deb" "$root"; done
fi
wheels="$root/var/cache/wheels"
mkdir -p "$wheels"
platforms=(--platform manylinux_2_28_aarch64 --platform manylinux_2_27_aarch64 --platform manylinux_2_17_aarch64
           --platform manylinux2014_aarch64 --platform any)
fetch=(download -q --only-binary=:all: --python-version 3.11 --implementation cp "${platforms[@]}" -d "$wheels")
# torch 2.9.1 is the newest aarch64 CPU build on PyPI (later aarch64 wheels are CUDA builds)
$pip "${fetch[@]}" --no-deps torch==2.9.1
$pip "${fetch[@]}" numpy tokenizers jinja2 psutil rich safetensors llguidance typing-extensions sympy networkx \
  filelock fsspec
$pip install -q --no-deps --no-index --upgrade --target "$root/opt/site" --only-binary=:all: --python-version 3.11 \
  --implementation cp "${platforms[@]}" "$wheels"/*.whl
mkdir -p "$root/proc"
features="fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp"
for cpu in 0 1; do
  printf 'processor\t: %s\nFeatures\t: %s\nCPU implementer\t: 0x41\nCPU architecture: 8\nCPU part\t: 0xd0b\n\n' \
    "$cpu" "$features"
done > "$root/proc/cpuinfo"
echo "$root"
