#!/usr/bin/env bash
# One call on the lent GPU machine (the exact call, with `carry`: benchmarks/README.md): installs the carried torchao
# (benchmarks/prepare_gpu_run.sh) into a folder of its own, then runs one part of gpu_check.py with its JSON, table
# and log written under $OUT, the folder whose files come back, after every check.
# Usage: bash benchmarks/gpu_run.sh part1|part2 [gpu_check.py options, e.g. --dry-run]   (PYTHON: default python3)
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:?usage: bash benchmarks/gpu_run.sh part1|part2 [gpu_check.py options]}
shift
out=${OUT:?OUT must name the folder whose files come back}
python=${PYTHON:-python3}
site=${GPU_CHECK_SITE:-/tmp/gpu_check_site}
"$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
    .gpu_carry/*.whl || exit 1
export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$python" benchmarks/gpu_check.py --checks "$part" --out "$out/gpu_check_$part.json" "$@" 2>&1 |
    tee "$out/gpu_check_$part.log"
exit "${PIPESTATUS[0]}"
