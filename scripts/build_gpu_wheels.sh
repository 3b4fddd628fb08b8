#!/usr/bin/env bash
# Wheels the GPU kit needs beyond a stock CUDA PyTorch image, for a machine without network: pinned versions of
# transformers, accelerate, pytest and everything they need that the image lacks, for CPython $PYVER on x86-64 Linux.
#   bash scripts/build_gpu_wheels.sh [DIR]          (default DIR: .whl, git-ignored; PYVER=3.12 by default)
#   CHECK_ONLY=1 bash scripts/build_gpu_wheels.sh DIR   (the self-check of DIR alone, no download)
# hf_ppmoe itself is not a wheel: the repository is carried and put on PYTHONPATH (its optional runtime packages,
# datasets / matplotlib / sacrebleu, are imported by neither tests/gpu nor benchmarks/gpu.py).
# Then, on the GPU machine, in a copy of this repository with DIR in it:   bash scripts/gpu_check.sh
#
# Self-check (fails naming what is missing): every requirement of every wheel in DIR, markers evaluated for CPython
# $PYVER on Linux x86-64, must be met by a wheel in DIR or by a package of the stock image (IMAGE below); and DIR must
# stay under 64 MiB (what the device tool carries).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-.whl}
PYVER=${PYVER:-3.12}
LIMIT_MIB=64
# The distributions of a stock CUDA PyTorch image (pytorch/pytorch:*-cuda*-runtime and NGC-style images with pip):
# torch's own requirements, the NVIDIA CUDA wheels, and the base Python tools. Not assumed: transformers, accelerate,
# huggingface_hub, tokenizers, safetensors, pytest (brought below), nor truststore (httpcore2 needs it: brought).
IMAGE="torch triton numpy pyyaml filelock fsspec jinja2 markupsafe networkx sympy mpmath typing-extensions
packaging requests urllib3 idna certifi charset-normalizer h11 anyio sniffio pillow setuptools wheel pip psutil
nvidia-cublas nvidia-cuda-runtime nvidia-cuda-nvrtc nvidia-cuda-cupti nvidia-cudnn nvidia-cufft nvidia-curand
nvidia-cusolver nvidia-cusparse nvidia-cusparselt nvidia-nccl nvidia-nvtx nvidia-nvjitlink nvidia-cufile
nvidia-nvshmem"
mkdir -p "$out"
if [ -z "${CHECK_ONLY:-}" ]; then
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
    "${platforms[@]}" -d "$out" \
    transformers==5.24.0 accelerate==1.15.0 safetensors==0.8.0 huggingface_hub==2.4.0 hf-xet==1.8.0 \
    tokenizers==0.23.3 regex==2026.11.15 httpx2==2.16.2 httpcore2==2.16.2 click==8.5.1 typer==0.29.2 \
    truststore==0.10.5 shellingham==1.5.4 rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2 pygments==2.21.0 \
    pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 annotated-doc==0.0.7 \
    pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 tqdm==4.70.1
fi
IMAGE="$IMAGE" PYVER="$PYVER" LIMIT_MIB="$LIMIT_MIB" python3 - "$out" <<'EOF'
"""Resolve every requirement of every wheel in DIR against the wheels there plus the image's packages."""
import os
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

out = Path(sys.argv[1])
image = {canonicalize_name(n) for n in os.environ["IMAGE"].split()}
major, minor = os.environ["PYVER"].split(".")
env = dict(python_version=f"{major}.{minor}", python_full_version=f"{major}.{minor}.0", sys_platform="linux",
           platform_system="Linux", platform_machine="x86_64", os_name="posix",
           implementation_name="cpython", platform_python_implementation="CPython", extra="")
have = {}  # canonical name -> Version, the wheels in DIR
needs = []  # (wheel, requirement)
for wheel in sorted(out.glob("*.whl")):
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        msg = Parser().parsestr(z.read(meta).decode())
    have[canonicalize_name(msg["Name"])] = Version(msg["Version"])
    needs += [(wheel.name, Requirement(r)) for r in msg.get_all("Requires-Dist") or []]
missing = []
for wheel, req in needs:
    if req.marker is not None and not req.marker.evaluate(env):
        continue
    name = canonicalize_name(req.name)
    if name in have:
        if req.specifier and not req.specifier.contains(have[name], prereleases=True):
            missing.append(f"{wheel} needs {req}, DIR has {name} {have[name]}")
    elif name not in image:
        missing.append(f"{wheel} needs {req}: neither a wheel in {out} nor a package of the stock image")
size = sum(w.stat().st_size for w in out.glob("*.whl")) / 2**20
print(f"{len(have)} wheels, {size:.1f} MiB in {out}; {len(needs)} requirements checked against them and "
      f"{len(image)} image packages (CPython {env['python_version']}, Linux x86-64)")
if size > float(os.environ["LIMIT_MIB"]):
    missing.append(f"{out} holds {size:.1f} MiB, over the {os.environ['LIMIT_MIB']} MiB the device tool carries")
if missing:
    sys.exit("build_gpu_wheels.sh: the set is incomplete; add these to the download list (or to IMAGE if the image "
             "really has them):\n  " + "\n  ".join(missing))
print("self-check passed: every requirement is met")
EOF
