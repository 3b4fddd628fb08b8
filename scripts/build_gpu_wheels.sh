#!/usr/bin/env bash
# Wheels the GPU suite needs beyond a stock CUDA PyTorch image (one with torch, triton and transformers), for a
# machine without network: this package and the pinned versions of what it needs, for CPython 3.12 on x86-64 Linux.
#   bash scripts/build_gpu_wheels.sh [DIR]          (default DIR: .whl; prints the total size)
# Then, on the GPU machine, in a copy of this repository with DIR beside it:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site DIR/*.whl && export PYTHONPATH=/tmp/site:$PWD
#   python3 -m pytest -q tests/gpu && python3 benchmarks/gpu.py --out gpu-results.md
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-.whl}
mkdir -p "$out"
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip wheel -q --no-deps -w "$out" .
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d "$out" \
    transformers==5.24.0 accelerate==1.15.0 safetensors==0.8.0 huggingface_hub==2.4.0 hf-xet==1.8.0 \
    tokenizers==0.23.3 regex==2026.11.15 httpx2==2.16.2 httpcore2==2.16.2 click==8.5.1 typer==0.29.2 \
    pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 tqdm==4.70.1
du -ch "$out"/*.whl | tail -1
