#!/usr/bin/env bash
# requirements/gpu.lock, the GPU image's exact versions (Dockerfile), made and checked by pip's resolver for CPython
# 3.12 on manylinux x86_64 (glibc up to 2.39: the base image's Ubuntu 24.04), in report mode: it reads each wheel's
# metadata (the index's PEP 658 metadata files where it has them, else HTTP range requests into the wheel:
# --use-feature=fast-deps) and downloads no wheel.
#
#   requirements/lock_gpu.sh lock    resolve pyproject.toml ([project.dependencies] and the gpu extra) with
#                                    requirements/gpu.in into requirements/gpu.lock (make lock-gpu)
#   requirements/lock_gpu.sh check   resolve the same inputs with every pin of the lock; fails unless that
#                                    resolves, to exactly the lock (make check-gpu-lock)
#
# The resolver runs under a real CPython 3.12, as environment markers are evaluated against the running interpreter
# (--python-version only selects wheels): GPU_LOCK_PYTHON, python3.12 on PATH, or pyenv's. It runs pip 25.3 in a
# venv of its own under .cache/gpu-lock/ and ignores this machine's pip configuration (local wheel folders, caps,
# extra indexes): the lock is PyPI's. GPU_LOCK_INDEX_URL points it at a mirror of PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."

mode=${1:-}
case "$mode" in
    lock|check) ;;
    *) echo "usage: $0 lock|check" >&2; exit 2 ;;
esac

PIP_VERSION=25.3
GLIBC_MINOR=39
INDEX_URL=${GPU_LOCK_INDEX_URL:-https://pypi.org/simple}
WORK=.cache/gpu-lock
LOCK=requirements/gpu.lock
IN=requirements/gpu.in
VENV=$WORK/venv
PY=$VENV/bin/python

find_python() {
    bash requirements/find_python.sh "${GPU_LOCK_PYTHON:-}" && return 0
    echo "$0: needs a CPython 3.12: python3.12 on PATH, pyenv's, or GPU_LOCK_PYTHON=/path/to/python3.12" >&2
    return 1
}

# pip with none of this machine's configuration (PIP_CONFIG_FILE=/dev/null skips every configuration file,
# --isolated the PIP_* variables), against PyPI only.
pip_() {
    local cmd=$1
    shift
    PIP_CONFIG_FILE=/dev/null "$PY" -m pip "$cmd" --isolated --disable-pip-version-check --index-url "$INDEX_URL" "$@"
}

# CI runs the check where the registry may be out of reach: it then skips in one line, as the real-asset suite does.
if command -v curl >/dev/null && ! curl -s -f -o /dev/null --max-time 30 "${INDEX_URL%/}/pip/"; then
    if [ "$mode" = check ]; then
        echo "$0 check: skipped: $INDEX_URL cannot be reached"
        exit 0
    fi
    echo "$0 lock: $INDEX_URL cannot be reached" >&2
    exit 1
fi

mkdir -p "$WORK"
if ! "$PY" -c "import sys, pip; sys.exit(sys.version_info[:2] != (3, 12) or pip.__version__ != '$PIP_VERSION')" \
        >/dev/null 2>&1; then
    rm -rf "$VENV"
    if ! python312=$(find_python); then
        if [ "$mode" = check ]; then  # a CI machine without a CPython 3.12: say so in one line, as offline
            echo "$0 check: skipped: no CPython 3.12 here (python3.12 on PATH, pyenv's, or GPU_LOCK_PYTHON)"
            exit 0
        fi
        exit 1
    fi
    "$python312" -m venv "$VENV"
    PIP_CONFIG_FILE=/dev/null "$PY" -m pip install -q --isolated --disable-pip-version-check --index-url "$INDEX_URL" \
        "pip==$PIP_VERSION"
fi

# The inputs: pyproject's dependencies and gpu extra (transformer-engine without its `pytorch` extra: see gpu.in).
"$PY" - "$WORK/inputs.txt" <<'EOF'
import sys
import tomllib

from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import canonicalize_name

with open("pyproject.toml", "rb") as f:
    project = tomllib.load(f)["project"]
lines = []
for spec in project["dependencies"] + project["optional-dependencies"]["gpu"]:
    req = Requirement(spec)
    if canonicalize_name(req.name) == "transformer-engine":
        req.extras.discard("pytorch")
    lines.append(str(req))
with open(sys.argv[1], "w") as out:
    out.write("\n".join(lines) + "\n")
EOF

# Wheels of the pure-Python packages that are published only as source archives (gpu.in's `#build-wheel:` lines);
# in check mode of the version the lock pins.
WHEELS=$WORK/wheels
mkdir -p "$WHEELS"
sed -n 's/^#build-wheel: *//p' "$IN" | while read -r spec; do
    name=$(echo "$spec" | sed -E 's/[ <>=!~;].*//')
    if [ "$mode" = check ]; then
        pin=$(grep -i -E "^${name}==" "$LOCK" | head -1 || true)
        spec=${pin:-$spec}
        version=${pin#*==}
        if [ -n "$pin" ] && ls "$WHEELS/$(echo "$name" | tr '-' '_')-$version-"*.whl >/dev/null 2>&1; then
            continue
        fi
    fi
    pip_ wheel -q --no-deps -w "$WHEELS" "$spec"
done

platforms=()
for minor in $(seq "$GLIBC_MINOR" -1 5); do
    platforms+=(--platform "manylinux_2_${minor}_x86_64")
done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64)

requirements=(-r "$WORK/inputs.txt" -r "$IN")
if [ "$mode" = check ]; then
    requirements+=(-r "$LOCK")
fi

rm -f "$WORK/report.json"
start=$SECONDS
if ! pip_ install --dry-run --ignore-installed --report "$WORK/report.json" --target "$WORK/target" \
        --python-version 3.12 --implementation cp --abi cp312 "${platforms[@]}" --only-binary=:all: \
        --find-links "$WHEELS" --use-feature=fast-deps "${requirements[@]}" \
        > "$WORK/resolver.log" 2>&1; then
    grep -v -E '^(Collecting|Processing|Looking in|  (Using cached|Downloading|Obtaining)|\s*$)' "$WORK/resolver.log" \
        | grep -v '^WARNING: pip is using lazily' >&2 || true
    echo "$0 $mode: pip's resolver found no set of wheels for these requirements (log: $WORK/resolver.log)" >&2
    exit 1
fi

"$PY" - "$mode" "$WORK/report.json" "$LOCK" $((SECONDS - start)) <<'EOF'
import json
import re
import sys

from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import canonicalize_name

mode, report_path, lock_path, seconds = sys.argv[1:]
with open(report_path) as f:
    report = json.load(f)
resolved = {canonicalize_name(item["metadata"]["name"]): item["metadata"]["version"] for item in report["install"]}
# The extension built in the image from its source archive has the version of transformer-engine (gpu.in).
source = {"transformer-engine-torch": resolved["transformer-engine"]}
# vLLM's own pins of torch and its companions, from its wheel's metadata: written into the lock, so that a test
# without the registry can check the lock's torch against them.
vllm = next(item["metadata"] for item in report["install"] if canonicalize_name(item["metadata"]["name"]) == "vllm")
vllm_pins = []
for spec in vllm.get("requires_dist", []):
    req = Requirement(spec)
    if canonicalize_name(req.name) in {"torch", "torchaudio", "torchvision"} and (
            req.marker is None or req.marker.evaluate({"extra": ""})):
        vllm_pins.append(f"vllm=={vllm['version']} requires {canonicalize_name(req.name)}{req.specifier}")

HEADER = """\
# Exact versions of the GPU image's Python stack (Dockerfile): CPython 3.12, manylinux x86_64 (glibc up to 2.39).
# pip's resolver, from pyproject.toml ([project.dependencies] and the gpu extra) and requirements/gpu.in.
# Regenerate with 'make lock-gpu'; 'make check-gpu-lock' resolves it again (report mode, no wheel downloaded).
"""
VLLM = """\
# vLLM's own pins of torch (its wheel's metadata, as the resolver read it): the torch below is the one they name.
"""
FOOTER = """\
# Built in the image from its source archive (no wheel is published), with --no-build-isolation against the torch
# above, once the pins above are installed: see the Dockerfile. A comment, so that a plain `pip install -r` of this
# file does not build it in isolation, against another torch.
"""

if mode == "lock":
    with open(lock_path, "w") as out:
        out.write(HEADER)
        out.write(VLLM)
        out.writelines(f"#pin: {line}\n" for line in vllm_pins)
        out.writelines(f"{name}=={version}\n" for name, version in sorted(resolved.items()))
        out.write(FOOTER)
        out.writelines(f"#source: {name}=={version}\n" for name, version in source.items())
    print(f"{lock_path}: {len(resolved)} wheels and {len(source)} source build, resolved in {seconds} s")
    sys.exit(0)

pins, source_pins, lock_vllm_pins = {}, {}, []
with open(lock_path) as f:
    for line in f:
        line = line.strip()
        if line.startswith("#pin:"):
            lock_vllm_pins.append(line.removeprefix("#pin:").strip())
        elif m := re.fullmatch(r"#source: *([A-Za-z0-9._-]+)==(\S+)", line):
            source_pins[canonicalize_name(m[1])] = m[2]
        elif line and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[canonicalize_name(name)] = version
problems = [f"resolved {n}=={v}, which the lock does not pin" for n, v in sorted(resolved.items()) if n not in pins]
problems += [f"the lock pins {n}=={v}, resolved {resolved.get(n)}" for n, v in sorted(pins.items())
             if resolved.get(n) != v]
if source_pins != source:
    problems.append(f"the lock's source builds are {source_pins}, expected {source}")
if lock_vllm_pins != vllm_pins:
    problems.append(f"the lock's `#pin:` lines are {lock_vllm_pins}, vLLM's metadata says {vllm_pins}")
if problems:
    print(f"{lock_path} is not what its inputs resolve to (make lock-gpu re-makes it):", *problems, sep="\n  ",
          file=sys.stderr)
    sys.exit(1)
print(f"{lock_path}: resolves ({len(pins)} wheels, {len(source_pins)} source build) in {seconds} s")
EOF
