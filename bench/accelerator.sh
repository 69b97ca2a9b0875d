#!/usr/bin/env bash
# One prepared run of the serving path on an accelerator (issue 28), from a bare machine:
#
#   bench/accelerator.sh OUT_DIR [--wheels DIR] [dsv4 bench accelerator flags: --device cuda
#                        --preset small,medium --backend aoti --loads 1,16,64 …]
#
# --wheels DIR: install the dependencies the host's Python lacks from wheels carried in DIR
# (bench/accelerator_wheels.sh downloads them where pip reaches PyPI), into a private
# directory: nothing is fetched, the host's own torch and packages are left as they are. The
# project itself runs from this tree (PYTHONPATH): no build step, nothing written into it.
# Every figure lands in OUT_DIR/accelerator.json, the run's output in OUT_DIR/log.txt; the
# exit status is the bench's (1 when the device's greedy tokens disagree with the cpu's).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
if [[ $# -lt 1 || $1 == -* ]]; then
    echo "usage: bench/accelerator.sh OUT_DIR [--wheels DIR] [dsv4 bench accelerator flags]" >&2
    exit 2
fi
out=$1
shift
python=${PYTHON:-python3}
if [[ ${1:-} == --wheels ]]; then
    wheels=${2:?--wheels needs a directory}
    shift 2
    shopt -s nullglob
    found=("$wheels"/*.whl)
    if [[ ${#found[@]} -eq 0 ]]; then
        echo "bench/accelerator.sh: no wheels in $wheels" >&2
        exit 2
    fi
    site=$(mktemp -d "${TMPDIR:-/tmp}/dsv4-site.XXXXXX")
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "${found[@]}"
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$out"
cd "$repo"
"$python" -m console.cli bench accelerator --out "$out" "$@" 2>&1 | tee "$out/log.txt"
