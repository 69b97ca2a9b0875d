#!/usr/bin/env bash
# Download, where pip reaches PyPI, the wheels bench/accelerator.sh installs on a GPU host that
# has no network: the project's dependencies its image lacks (or holds too old), at the
# versions this environment runs, built for that host's Python (3.12 by default) on x86-64.
#
#   bench/accelerator_wheels.sh DIR [PYTHON_VERSION]
#
# The host's own torch, numpy, safetensors, tokenizers, psutil, xxhash, filelock, httpx, h11, click,
# prometheus-client and nvidia-ml-py are used as they are: none of them is downloaded.
set -euo pipefail
dir=${1:?usage: bench/accelerator_wheels.sh DIR [PYTHON_VERSION]}
pyver=${2:-3.12}
python=${PYTHON:-python3}
packages=(textual rich markdown-it-py mdit-py-plugins linkify-it-py platformdirs
          fastapi starlette pydantic pydantic_core annotated-types typing-inspection typing_extensions
          opentelemetry-api anyio uvicorn watchfiles shtab)
pinned=()
for p in "${packages[@]}"; do
    version=$("$python" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$p") || {
        echo "bench/accelerator_wheels.sh: $p is not installed here; install the project first" >&2
        exit 1
    }
    pinned+=("$p==$version")
done
mkdir -p "$dir"
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$dir" "${pinned[@]}"
du -sh "$dir"
