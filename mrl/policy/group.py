"""The policy as the controller sees it: `logprobs`, `train`, `refit`, `save`/`load`, over a group of rank actors.

Dispatch contract (what is split, what is replicated):
- `logprobs(batch)`: the batch (`RankBatch`, rows = sequences) is SHARDED along rows over data-parallel ranks;
  temperature/reference flags are REPLICATED; the leaders' [n, T] results are concatenated back in row order.
- `train(batch, loss_fn)`: batch SHARDED as above; the loss object and the step's GLOBAL count of valid tokens (or
  sequences), computed here over the whole batch, are REPLICATED, so every rank normalises by the same number.
  Metrics come back already summed over data-parallel ranks (every leader holds the same sums).
- `refit(engine)`: every rank joins the gathers; rank 0 hands one bucket at a time to the engine (whose workers
  all load it) before the next bucket is gathered, so extra memory stays at one bucket. The bucket travels as a
  shared-memory file (colocated, one node) or by broadcast in a group of rank 0 and the engines (collective).
- `save`/`load`: every rank writes/reads its shards of one distributed checkpoint folder.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Optional, Protocol

import torch

from mrl.distributed.worker_group import wait_all
from mrl.inference.interface import RefitStats
from mrl.inference.refit import check_complete
from mrl.inference.transports.collective import payload as collective_payload
from mrl.policy.train_step import PolicyLoss, RankBatch, global_count
from mrl.policy.worker import PolicySpec, PolicyWorker


class RefitTarget(Protocol):
    """An engine that loads shared-memory refit payloads (`VllmEngineGroup`)."""

    expected_names: Optional[frozenset[str]]

    def load_payload(self, payload: dict) -> None: ...

    def finish_refit(self) -> None: ...


def _merge_metrics(value: Any) -> dict[str, float]:
    """Leaders' metric dicts merged by `shard_and_run`: equal values stay scalars, differing ones (per-rank times)
    come back as lists, of which the slowest counts."""
    return {k: float(max(v)) if isinstance(v, list) else float(v) for k, v in value.items()}


class Policy:
    """`world_size` PolicyWorker actors on the first bundles of `placement`."""

    def __init__(self, spec: PolicySpec, placement: Any, *, world_size: int, resource_fraction: float = 1.0,
                 omp_num_threads: int = 1, name: str = "policy") -> None:
        from mrl.distributed import WorkerGroup

        self.spec = spec
        self.workers = WorkerGroup(name, PolicyWorker, placement, init_args=(spec,),
                                   bundle_indices=list(range(world_size)), resource_fraction=resource_fraction,
                                   omp_num_threads=omp_num_threads, start_timeout_s=300.0)
        self.workers.layout_from_workers("data_parallel_layout")
        self._refit_groups: dict[int, str] = {}

    @property
    def data_parallel_size(self) -> int:
        return self.workers.layout.dp_size

    def logprobs(self, batch: RankBatch, *, temperature: float = 1.0, reference: bool = False) -> torch.Tensor:
        """[B, T] log-probabilities of `batch.input_ids` (position 0 is 0) under the policy or its reference."""
        return self.workers.shard_and_run("logprobs", batch, temperature=temperature, reference=reference)

    def train(self, batch: RankBatch, loss_fn: PolicyLoss, *, temperature: float = 1.0) -> dict[str, float]:
        """One optimizer step on the whole batch (all rows, every data-parallel rank)."""
        count = global_count(batch.loss_mask, loss_fn.level)
        merged = self.workers.shard_and_run("train", batch, loss_fn, count, temperature=temperature)
        return _merge_metrics(merged)

    def refit(self, engine: RefitTarget, bucket_bytes: int, *, transport: str = "shm_file") -> RefitStats:
        """Stream the current weights into `engine` bucket by bucket (HF names, full tensors), through shared-memory
        files ("shm_file": engines on this node) or a broadcast group ("collective": engines anywhere)."""
        from mrl.inference.transports import make_transport

        start = time.perf_counter()
        group = self._connect(engine) if transport == "collective" else None
        shm = make_transport("shm_file")
        num_buckets = self.workers.run_all("plan_export", bucket_bytes)[0]
        seen: set[str] = set()
        total = largest = 0
        try:
            for index in range(num_buckets):
                if group is not None:  # send and receive meet in the broadcasts: start both, then wait for both
                    sent = self.workers.run_all_async("export_bucket", index, group=group)
                    received = engine.load_payload_async(collective_payload(group))
                    payload = wait_all([sent, received])[0][0]
                else:
                    payload = self.workers.run_all("export_bucket", index)[0]
                    try:
                        engine.load_payload(payload)
                    finally:
                        shm.release(payload)
                seen.update(payload["names"])
                total += payload["bytes"]
                largest = max(largest, payload["bytes"])
        finally:
            engine.finish_refit()
        check_complete(engine.expected_names, seen)
        return RefitStats(len(seen), num_buckets, total, largest, time.perf_counter() - start)

    def _connect(self, engine: Any) -> str:
        """The refit broadcast group between this policy's rank 0 and `engine`'s actors (made once per engine)."""
        group = self._refit_groups.get(id(engine))
        if group is None:
            group = f"mrl-refit-{uuid.uuid4().hex[:12]}"
            address = self.workers.info[0].node_ip or "127.0.0.1"
            port = self.workers.run_all("refit_port")[0]
            size = 1 + engine.num_engines
            wait_all([self.workers.run_all_async("join_refit_group", group, address, port, size),
                      engine.join_refit_group_async(group, address, port, size)])
            self._refit_groups[id(engine)] = group
        return group

    def export_state(self) -> dict[str, torch.Tensor]:
        """The whole model as HF-named full tensors (small models: HF export, tests)."""
        return self.workers.run_all("export_state")[0]

    def save(self, path: str) -> None:
        self.workers.run_all("save", path)

    def load(self, path: str, *, load_optimizer: bool = True) -> list[Any]:
        """Every rank loads its shards of checkpoint `path`; returns the ranks' load reports."""
        return self.workers.run_all("load", path, load_optimizer=load_optimizer)

    def shutdown(self) -> None:
        try:
            self.workers.run_all("shutdown")
        except Exception:  # noqa: BLE001 -- a dead rank cannot leave its groups; the actors are killed below
            pass
        self.workers.shutdown()
