#!/usr/bin/env bash
# Clear .whl/ and fetch exactly the wheels in dev/gpu_wheels.txt for the GPU image (CPython 3.12, manylinux x86-64),
# without their dependencies; lines marked "# sdist" have no wheel on PyPI and are built here (pure Python).
# Needs PyPI. Run from anywhere: dev/fetch_gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
list=dev/gpu_wheels.txt
rm -rf .whl && mkdir .whl
tmp=$(mktemp -d) && trap 'rm -rf "$tmp"' EXIT
grep -E '^[A-Za-z0-9]' "$list" | grep -v '# sdist' | sed 's/#.*//' >"$tmp/bin.txt"
grep -E '^[A-Za-z0-9].*# sdist' "$list" | sed 's/#.*//' >"$tmp/src.txt"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d .whl -r "$tmp/bin.txt"
python3 -m pip wheel -q --no-deps -w .whl -r "$tmp/src.txt"
rm -f .whl/*.tar.gz .whl/*.zip
want=$(grep -cE '^[A-Za-z0-9]' "$list")
got=$(find .whl -type f -name '*.whl' | wc -l)
notany=$(find .whl -type f -name '*.whl' ! -name '*-none-any.whl' ! -name '*-cp312-*manylinux*x86_64*.whl' ! -name '*-py312-none-any.whl')
[ "$got" -eq "$want" ] || { echo "expected $want wheels, got $got" >&2; exit 1; }
[ -z "$notany" ] || { echo "wheels not for cp312 manylinux x86-64: $notany" >&2; exit 1; }
echo "$got wheels in .whl/: $(du -cb .whl/*.whl | tail -1 | awk '{printf "%.1f MiB", $1/1048576}')"
