# GPU image for clusters (not built on the CPU development machines: they have no Docker engine).
# Megatron-Core + Transformer Engine + CUDA vLLM + Ray, installed from requirements/gpu.lock and nothing else: what
# goes in is what pip's resolver checked for this image (make check-gpu-lock: CPython 3.12, manylinux x86_64 up to
# glibc 2.39).
#
# The base brings CUDA and no Python packages. torch comes from the lock, at the version vLLM 0.32.0 pins
# (torch==2.13.0, PyPI's CUDA 13.0 build), so nothing replaces a torch that other extensions were compiled against
# (pip replacing the NGC PyTorch image's own torch broke the ABI of the TE and apex built into that image).
# CUDA 13.0, the CUDA of that torch; cuDNN and the compiler (devel) to build Transformer Engine's PyTorch extension;
# Ubuntu 24.04, whose Python is 3.12 and glibc 2.39 (the lock's).
FROM nvidia/cuda:13.0.2-cudnn-devel-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1

# Python 3.12 in a venv (Ubuntu's own Python is marked externally managed); a C++ compiler for the TE extension.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential git \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -c 'import sys; assert sys.version_info[:2] == (3, 12), sys.version' \
    && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH VIRTUAL_ENV=/opt/venv
# The pip that resolved the lock (requirements/lock_gpu.sh; the Makefile's CPU stack uses the same).
RUN python -m pip install pip==25.3

WORKDIR /opt/mrl
COPY requirements/gpu.lock requirements/gpu.in requirements/

# 1. Every wheel of the lock, torch among them at vLLM's pin (then checked: its version and CUDA against the lock).
#    --no-deps: the lock is a whole resolution (the check fails on a missing or extra package), so pip adds and
#    upgrades nothing. --only-binary=:all: installs the wheels the check found; the pure-Python packages published
#    only as source archives (gpu.in's `#build-wheel:` lines, antlr4-python3-runtime) are the exception.
RUN python -m pip install --no-deps --only-binary=:all: \
        $(sed -n 's/^#build-wheel: *\([A-Za-z0-9._-]*\).*/--no-binary=\1/p' requirements/gpu.in) \
        -r requirements/gpu.lock \
    && python -c "import re, sys, torch; lock = open('requirements/gpu.lock').read(); \
        want = (re.search(r'^torch==(\S+)$', lock, re.M)[1], re.search(r'^cuda-toolkit==(\d+)\.', lock, re.M)[1]); \
        got = (torch.__version__.split('+')[0], torch.version.cuda.split('.')[0]); \
        sys.exit(None if got == want else f'torch, CUDA: {got}; the lock: {want}')"

# 2. Transformer Engine's PyTorch extension (the lock's `#source:` line; no wheel is published), after torch.
#    --no-build-isolation: it compiles against the torch installed above, with the lock's setuptools and wheel (in
#    isolation pip would fetch the newest torch into a throwaway build environment and compile against that one).
#    --no-deps: its requirements (the core library transformer-engine-cu13, einops, onnx, ...) are pinned in the
#    lock and installed above. NVTE_PYTORCH_FORCE_BUILD: compile here rather than download a prebuilt wheel that its
#    setup.py guesses from the versions. CUDA_HOME: the base's toolkit, not the nvcc wheel some packages bring.
#    MAX_JOBS bounds the compiler's memory.
ARG MAX_JOBS=8
RUN NVTE_PYTORCH_FORCE_BUILD=TRUE CUDA_HOME=/usr/local/cuda MAX_JOBS=${MAX_JOBS} \
        python -m pip install --no-deps --no-build-isolation --no-binary=:all: \
        "$(sed -n 's/^#source: *//p' requirements/gpu.lock)"

# 3. mrl itself, with --no-deps: its dependencies are the lock's (make check-gpu-lock resolves the lock with
#    pyproject.toml's ranges). pip check: every installed package's requirements hold (vLLM's torch==2.13.0 among
#    them, and the TE extension's, decided when it was built). One line of it is a false alarm, left out: the TE
#    core wheel is named py3-none-manylinux_2_28_x86_64 but its WHEEL file says cp310-cp310, so pip check calls it
#    "not supported on this platform" (seen with transformer_engine_cu13 2.11.0 installed on CPython 3.12).
COPY pyproject.toml README.md ./
COPY mrl ./mrl
COPY converters ./converters
COPY recipes ./recipes
COPY slurm ./slurm
RUN python -m pip install --no-deps --no-build-isolation -e . \
    && { python -m pip check > /tmp/pip-check.txt || true; } \
    && grep -v -E '^(No broken requirements found\.|transformer_engine_cu[0-9]+ \S+ is not supported on this platform)$' \
            /tmp/pip-check.txt \
        | { ! grep .; } \
    && rm /tmp/pip-check.txt

ENV RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false
ENTRYPOINT ["mrl"]
