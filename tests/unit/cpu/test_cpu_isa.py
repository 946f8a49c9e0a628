"""mrl.cpu.isa: the instruction-set levels by hand, and each path this CPU can take run for real in a fresh
process (the caps are read once, at start or at a library's first call): the AVX2-only machine's path forced on an
AVX-512 CPU loads vLLM's real `_C_AVX2` library (no shared-memory collectives), runs oneDNN's AVX2 kernels (its own
verbose log says so) and ATen's AVX2 kernels, and mrl's oneDNN linear still equals float64."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mrl.cpu.isa import FORCE_ENV, LEVELS, CpuIsa, detect, forced_environment, native_level

pytestmark = pytest.mark.unit

NATIVE = detect({}).native


def _isa(native, forced=None) -> CpuIsa:
    return CpuIsa(model="test", cores=2, native=native, forced=forced, amx=False, onednn_available=True)


def test_native_level_from_cpuinfo_capabilities():
    assert native_level({"avx2": False, "avx512_f": True}) is None  # below the stack's floor
    assert native_level({"avx2": True, "avx512_f": False, "avx512_bf16": False}) == "avx2"
    assert native_level({"avx2": True, "avx512_f": True, "avx512_bf16": False}) == "avx512"
    assert native_level({"avx2": True, "avx512_f": True, "avx512_bf16": True}) == "avx512_bf16"


@pytest.mark.parametrize(
    "native, forced, level, kernels, shm",
    [
        ("avx512_bf16", None, "avx512_bf16", "_C", True),
        ("avx512_bf16", "avx512", "avx512", "_C_AVX512", True),
        ("avx512_bf16", "avx2", "avx2", "_C_AVX2", False),
        ("avx512", None, "avx512", "_C_AVX512", True),
        ("avx2", None, "avx2", "_C_AVX2", False),
        ("avx2", "avx512_bf16", "avx2", "_C_AVX2", False),  # a cap never raises the level
    ],
)
def test_level_and_what_follows(native, forced, level, kernels, shm):
    isa = _isa(native, forced)
    assert (isa.level, isa.vllm_kernels, isa.vllm_shm_collectives, isa.linear_gemm) == (level, kernels, shm, "onednn")
    assert f"ISA {level}" in isa.summary()


def test_no_x86_level_keeps_torch_gemms():
    assert _isa(None).linear_gemm == "torch"
    assert _isa(None).vllm_kernels == "_C"


def test_a_bad_forced_level_names_the_variable_and_the_choices():
    with pytest.raises(ValueError, match=rf"{FORCE_ENV}='sse4'.*avx2, avx512, avx512_bf16"):
        detect({FORCE_ENV: "sse4"})
    with pytest.raises(ValueError, match="avx2, avx512, avx512_bf16"):
        forced_environment("sse4")


@pytest.mark.skipif(NATIVE is None, reason="not an x86 CPU with AVX2")
def test_a_forced_level_compiles_into_caches_of_its_own():
    """The inductor-cache workaround (isa._compile_cache): never the default caches, one per level, for inductor
    and for vLLM's compiled models."""
    env = forced_environment("avx2", {"PYTHONPATH": "/elsewhere"})
    assert env["PYTHONPATH"].split(os.pathsep)[1:] == ["/elsewhere"]
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    assert env["TORCHINDUCTOR_CACHE_DIR"] != default_cache_dir()  # inductor's own default, whatever the environment
    if NATIVE != "avx2":
        assert forced_environment("avx512", {})["TORCHINDUCTOR_CACHE_DIR"] != env["TORCHINDUCTOR_CACHE_DIR"]
        assert forced_environment("avx512", {})["VLLM_CACHE_ROOT"] != env["VLLM_CACHE_ROOT"]
    from vllm.envs import VLLM_CACHE_ROOT

    assert env["VLLM_CACHE_ROOT"] not in (VLLM_CACHE_ROOT, env["TORCHINDUCTOR_CACHE_DIR"])


@pytest.mark.skipif(NATIVE in (None, "avx512_bf16"), reason="needs a CPU below the highest level")
def test_a_level_above_the_cpu_is_refused():
    with pytest.raises(ValueError, match=f"its own level: {NATIVE}"):
        forced_environment(LEVELS[LEVELS.index(NATIVE) + 1])


_PROBE = """
import json, torch
from mrl.cpu import isa
from mrl.cpu.megatron_speed import _linear

g = torch.Generator().manual_seed(0)
x, w = torch.randn(100, 200, generator=g), torch.randn(48, 200, generator=g)
error = float((_linear(x, w).double() - x.double() @ w.double().t()).abs().max())
import vllm._custom_ops  # noqa: vLLM picks its kernel library here (CpuPlatform.import_kernels)
print("PROBE" + json.dumps({
    "avx512": torch.cpu._is_avx512_supported(), "bf16": torch.cpu._is_avx512_bf16_supported(),
    "aten": torch.backends.cpu.get_cpu_capability(), "kernels": isa.loaded_vllm_kernels(),
    "shm": hasattr(torch.ops._C, "init_shm_manager"), "error": error, "expected": isa.current().vllm_kernels,
}))
"""

#: oneDNN's verbose log names the ISA it dispatches to (`onednn_verbose,...,info,cpu,isa:<name>`), one of these per
#: level. Uncapped (the CPU's own level), oneDNN takes the best ISA the CPU has: on a CPU with AVX10.1 (AVX-512 with
#: bfloat16 and float16, e.g. a Xeon of family 6 model 207 whose AMX the hypervisor hides) that is "Intel AVX 10.1".
ONEDNN_ISA_NAME = {"avx2": ("Intel AVX2",), "avx512": ("Intel AVX-512",), "avx512_bf16": ("bfloat16", "Intel AVX 10")}


#: Every level this CPU can run: its own and each below it, forced.
PATHS_HERE = [] if NATIVE is None else list(LEVELS[: LEVELS.index(NATIVE) + 1])


@pytest.mark.parametrize("level", PATHS_HERE)
def test_each_path_this_cpu_can_take_runs_for_real(level):
    pytest.importorskip("vllm")
    env = {k: v for k, v in os.environ.items() if k not in (FORCE_ENV, "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS",
                                                           "ATEN_CPU_CAPABILITY")}
    if level != NATIVE:
        env.update(forced_environment(level, env))
    env["ONEDNN_VERBOSE"] = "1"
    done = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    probe = json.loads(done.stdout.split("PROBE", 1)[1])
    isa_lines = [line for line in done.stdout.splitlines() if ",info,cpu,isa:" in line]
    assert isa_lines and any(name in isa_lines[0] for name in ONEDNN_ISA_NAME[level]), isa_lines
    kernels = {"avx2": "_C_AVX2", "avx512": "_C_AVX512", "avx512_bf16": "_C"}[level]
    assert (probe["kernels"], probe["expected"], probe["shm"]) == (kernels, kernels, level != "avx2")
    assert (probe["avx512"], probe["bf16"]) == (level != "avx2", level == "avx512_bf16")
    assert probe["aten"] == ("AVX2" if level == "avx2" else "AVX512")
    assert probe["error"] < 1e-4  # fp32 GEMM of 200 N(0,1) products (|y| ~ 14) against float64
