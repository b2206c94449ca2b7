#!/usr/bin/env bash
# Prepares the folder carried to the lent GPU machine (benchmarks/README.md, "On the lent GPU machine"): the torchao
# wheel matching its torch (2.11 -> torchao 0.17.0) for its Python 3.12, downloaded here from PyPI, and checks that
# the tree that travels plus this folder stay under the 64 MiB a call may carry. Run from anywhere in the checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
carry=.gpu_carry
torchao=${TORCHAO_VERSION:-0.17.0}
rm -rf "$carry" && mkdir -p "$carry"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$carry" "torchao==$torchao"
git check-ignore -q "$carry" || { echo "$carry is not git-ignored: it would travel twice" >&2; exit 1; }
# What travels: tracked and untracked-not-ignored files, plus the carried folder.
tree=$(git ls-files -z --cached --others --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
carried=$(du -sb "$carry" | cut -f1)
limit=$((64 * 1024 * 1024))
echo "travels: tree $((tree / 1024)) KiB + $carry $((carried / 1024)) KiB = $(((tree + carried) / 1024)) KiB (limit $((limit / 1024)) KiB)"
[ $((tree + carried)) -lt "$limit" ] || { echo "over the 64 MiB a call carries" >&2; exit 1; }
ls "$carry"
