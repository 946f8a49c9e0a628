"""Memory hand-over on a shared GPU: what a policy rank moves off its device while a colocated engine generates.

Data flow on one rank (`PolicyWorker.release_memory`, then `reclaim_memory` or the next compute call):
    release  optimizer states (Adam's exp_avg and exp_avg_sq; the fp32 main weights of bf16 training) and, when
             configured, the weights: each device storage's bytes -> a host buffer (pinned on CUDA, kept for the next
             cycle), then the storage is resized to 0 bytes. DDP's gradient buffers: resized to 0 bytes, not copied
             (every step zeroes them before its first backward). Then gc + torch.cuda.empty_cache() hands the freed
             blocks, and the blocks the training step's activations and logits left cached, back to the driver.
    reclaim  storages resized back and refilled from the host (bit for bit); gradient buffers re-created, zeroed.

Why storages and not `tensor.data = tensor.cpu()` (Megatron's `MegatronOptimizer.offload_to_cpu`, the reference
model's `.cpu()`): the same memory is seen through several tensors -- DDP's bucket views of its parameter and gradient
buffers, the distributed optimizer's shard views of fp32 parameters, `param.main_param` -- and resizing the storage
keeps every one of them valid, where replacing `.data` leaves the others on the old memory. Megatron's helper also
moves Adam's host-side `step` counters to the GPU on restore, and with fp32 parameters (whose optimizer params are
the model's own) it would move the model as "optimizer state"; here a storage the model owns is never optimizer state.

Hazard: while released, a parked tensor has no memory; any use of it before `reclaim` is undefined (CUDA reads out
of bounds). The worker reclaims at the top of every call that reads them (train, logprobs, export, save, load).
On a CPU rank the device is the host: nothing moves (`active=False`) and only the released flag is kept.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from mrl.config.schema import OffloadConfig

#: The parts a release can move, in the order they go (and come back in reverse).
PARTS = ("optimizer_states", "gradients", "weights")


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """[nbytes] uint8 view of a whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def storage_key(tensor: torch.Tensor) -> int:
    """Identity of the storage under `tensor` (its StorageImpl, stable across resizes; views share it)."""
    return tensor.untyped_storage()._cdata


class Parking:
    """Device storages parked in host buffers and restored bit for bit; every tensor viewing them stays the same object.

    `park` takes all the storages of one part at once; parking a part already parked changes nothing."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin  # pinned host buffers: CUDA only (the copies run at full PCIe speed)
        self._host: dict[int, torch.Tensor] = {}  # storage key -> [nbytes] uint8 host copy, reused from cycle to cycle
        self._parked: list[tuple[torch.UntypedStorage, int]] = []  # (storage, its size in bytes)

    @property
    def parked(self) -> bool:
        return bool(self._parked)

    def park(self, tensors: Iterable[torch.Tensor], device_type: str, skip: frozenset[int] = frozenset()) -> int:
        """Move the storages of `tensors` on devices of `device_type` (not those keyed in `skip`) to the host;
        returns the bytes moved."""
        if self._parked:
            return 0
        storages: dict[int, torch.UntypedStorage] = {}
        for t in tensors:
            if t.device.type == device_type and storage_key(t) not in skip and t.untyped_storage().nbytes():
                storages.setdefault(storage_key(t), t.untyped_storage())
        host = {}
        for key, storage in storages.items():
            buffer = self._host.get(key)
            if buffer is None or buffer.numel() != storage.nbytes():
                buffer = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=self.pin)
            buffer.copy_(_bytes_of(storage), non_blocking=self.pin)
            host[key] = buffer
        if self.pin:
            torch.cuda.current_stream().synchronize()  # the host copies are complete before the device memory goes
        self._host = host  # buffers of storages that no longer exist (a checkpoint load replaced them) are dropped
        for storage in storages.values():
            self._parked.append((storage, storage.nbytes()))
            storage.resize_(0)
        return sum(size for _, size in self._parked)

    def restore(self) -> None:
        """Every parked storage back to its size and bytes (host -> device copies queued on the current stream,
        ahead of any compute that reads them)."""
        for storage, size in self._parked:
            storage.resize_(size)
            _bytes_of(storage).copy_(self._host[storage._cdata], non_blocking=self.pin)
        self._parked = []


def _inner_optimizers(optimizer: Any) -> list[Any]:
    """The torch optimizers inside a Megatron optimizer, chained or not (a rank without parameters of a kind holds
    a stub whose `optimizer` is None)."""
    subs = getattr(optimizer, "chained_optimizers", [optimizer])
    return [sub.optimizer for sub in subs if getattr(sub, "optimizer", None) is not None]


def optimizer_params(optimizer: Any) -> list[torch.Tensor]:
    """The parameters the optimizer updates: fp32 main weights in bf16 training, the model's own in fp32 training."""
    return [p for inner in _inner_optimizers(optimizer) for group in inner.param_groups for p in group["params"]]


def optimizer_states(optimizer: Any) -> list[torch.Tensor]:
    """Per-parameter state tensors (exp_avg, exp_avg_sq, step, ...)."""
    return [
        v
        for inner in _inner_optimizers(optimizer)
        for state in inner.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    ]


class HostOffload:
    """The hand-over of one policy rank: `release` moves the configured parts off the device and empties the
    allocator's cache; `reclaim(parts)` brings parts back (all by default). Both are idempotent."""

    def __init__(
        self, chunks: Sequence[torch.nn.Module], optimizer: Any, settings: OffloadConfig, *, active: bool
    ) -> None:
        self.chunks = list(chunks)  # DDP-wrapped when trainable
        self.optimizer = optimizer  # None for a frozen model
        self.settings = settings
        self.active = active  # False on a CPU rank: the host is the device, nothing moves
        self.released = False  # release() called and no full reclaim() since (kept on CPU ranks too)
        pin = active and torch.cuda.is_available()
        self._parking = {"optimizer_states": Parking(pin), "weights": Parking(pin)}
        self._grads_parked = False

    def _device_type(self) -> str:
        return next(self.chunks[0].parameters()).device.type

    def _ddp_chunks(self) -> list[Any]:
        return [c for c in self.chunks if hasattr(c, "offload_grad_buffers")]

    def _model_storages(self) -> frozenset[int]:
        """Storages the model owns (parameters, DDP's parameter and gradient buffers): never optimizer state."""
        keys = {storage_key(p) for c in self.chunks for p in c.parameters()}
        for chunk in self._ddp_chunks():
            for buffer in chunk.buffers + chunk.expert_parallel_buffers:
                keys.update(storage_key(t) for t in (buffer.param_data, buffer.grad_data) if t is not None)
        return frozenset(keys)

    def release(self) -> dict[str, float]:
        """Move what `settings` names off the device, then gc and empty the CUDA cache. Returns the GB moved per
        part (`<part>_gb`) and, on CUDA, torch.cuda.memory_reserved before and after (`reserved_before_gb`,
        `reserved_after_gb`). Call it again after a refit when the weights go too: the export brought them back."""
        moved = dict.fromkeys(PARTS, 0)
        report: dict[str, float] = {}
        cuda = self.active and torch.cuda.is_available()
        if cuda:
            report["reserved_before_gb"] = torch.cuda.memory_reserved() / 1e9
        if self.active:
            device = self._device_type()
            if self.settings.optimizer_states and self.optimizer is not None:
                # Main weights' .grad are views of (or, without fp32 grad reduction, copies from) the gradient
                # buffers; the next step's zero_grad(set_to_none=True) drops them anyway, so drop them now.
                model = self._model_storages()
                main = [p for p in optimizer_params(self.optimizer) if storage_key(p) not in model]
                for p in main:
                    p.grad = None
                moved["optimizer_states"] = self._parking["optimizer_states"].park(
                    main + optimizer_states(self.optimizer), device, skip=model
                )
            if self.settings.gradients and self._ddp_chunks() and not self._grads_parked:
                moved["gradients"] = sum(
                    b.grad_data.numel() * b.grad_data.element_size()
                    for c in self._ddp_chunks()
                    for b in c.buffers + c.expert_parallel_buffers
                )
                for chunk in self._ddp_chunks():
                    chunk.offload_grad_buffers(synchronize=False, empty_cache=False)
                self._grads_parked = True
            if self.settings.weights:
                moved["weights"] = self._parking["weights"].park(
                    (p for c in self.chunks for p in c.parameters()), device
                )
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
                report["reserved_after_gb"] = torch.cuda.memory_reserved() / 1e9
        self.released = True
        return {**{f"{part}_gb": size / 1e9 for part, size in moved.items()}, **report}

    def reclaim(self, parts: Sequence[str] = PARTS) -> None:
        """Bring `parts` back to the device (a no-op for parts not parked); all of them clears `released`."""
        if "weights" in parts:
            self._parking["weights"].restore()
        if "gradients" in parts and self._grads_parked:
            for chunk in self._ddp_chunks():
                chunk.restore_grad_buffers(synchronize=False)
            self._grads_parked = False
        if "optimizer_states" in parts:
            self._parking["optimizer_states"].restore()
        if set(PARTS) <= set(parts):
            self.released = False


class PhasePeaks:
    """The caching allocator's peak of this rank's compute phases on CUDA, in GiB (what `mrl plan`'s logprob and
    train columns predict, less the CUDA context): `start` before a phase, `logprob_done` after a logprob pass,
    `train_metrics` after a train step. The logprob passes since the last train step keep their highest peak, which
    the train step's metrics report beside its own. On a CPU rank nothing is measured (the host has no allocator
    peak to read) and the metrics are empty."""

    def __init__(self, active: bool) -> None:
        self.active = active
        self.logprob_gib = 0.0

    def start(self) -> None:
        if self.active:
            torch.cuda.reset_peak_memory_stats()

    def _peak_gib(self) -> float:
        return torch.cuda.max_memory_allocated() / 2**30 if self.active else 0.0

    def logprob_done(self) -> None:
        self.logprob_gib = max(self.logprob_gib, self._peak_gib())

    def train_metrics(self, reduce_max: Callable[[torch.Tensor], None]) -> dict[str, float]:
        """{peak_memory_gib, logprob_peak_memory_gib}: the highest over the ranks (`reduce_max`: [2] fp64 tensor ->
        its elementwise max over every rank, in place); then the logprob peak starts again."""
        if not self.active:
            return {}
        peaks = torch.tensor([self._peak_gib(), self.logprob_gib], dtype=torch.float64, device="cuda")
        reduce_max(peaks)
        self.logprob_gib = 0.0
        return {"peak_memory_gib": float(peaks[0]), "logprob_peak_memory_gib": float(peaks[1])}
