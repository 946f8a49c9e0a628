"""The policy as the controller sees it: `logprobs`, `train`, `save`/`load` and a refit source, over rank actors.

Dispatch contract (what is split, what is replicated):
- `logprobs(batch)`: the batch (`RankBatch`, rows = sequences) is SHARDED along rows over data-parallel ranks;
  temperature/reference flags are REPLICATED; the leaders' [n, T] results are concatenated back in row order.
- `train(batch, loss_fn)`: batch SHARDED as above; the loss object and the step's GLOBAL count of valid tokens (or
  sequences), computed here over the whole batch, are REPLICATED, so every rank normalises by the same number.
  Metrics come back already summed over data-parallel ranks (every leader holds the same sums).
- refit source (`plan_buckets`, `send_bucket[_async]`, for the loop of mrl/inference/refit.py): the transport (the
  run's weight-sync mode) says which ranks pack (`sending`) and MERGES the ranks' return values into the output
  (`merge`). By default every rank joins the gathers of a bucket (TP all-gathers, PP broadcasts) and rank 0 alone
  packs it (a shared-memory file, or a broadcast to the engines): REPLICATED work, one output. A collective
  transport made with `refit_addresses` has one sender per pipeline stage: only the bucket's owner stage gathers it
  (no PP broadcast) and that stage's first rank packs it as sender `bucket_sender(index)` (every bucket lies within
  one stage: the plan never spans two). CUDA IPC: rank 0's packed bucket is broadcast to every rank, each shares its
  own GPU's copy, the parts merged into one payload with a handle per GPU (mrl/inference/transports/cuda_ipc.py).
  Shared-memory files under EP with one stage: each EP rank packs its own experts, the files merged. The loop hands
  the payload to the engine before asking for the next bucket, so extra memory stays at one bucket.
- `save`/`load`: every rank writes/reads its shards of one distributed checkpoint folder.
- `release_memory()` / `reclaim_memory()`: no data; every rank moves its own shards off / back on its device
  (mrl/policy/memory.py). The release's report: GB moved SUMMED over ranks, CUDA memory reserved the MAX over ranks
  (the fullest GPU).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from mrl.distributed import GroupFuture, Work, WorkerGroup
from mrl.distributed.env import Threads
from mrl.policy.interface import PolicyLoss, RankBatch, global_count
from mrl.policy.worker import PolicySpec, PolicyWorker

if TYPE_CHECKING:
    from mrl.inference.transports import CollectiveTransport, WeightTransport


def _merge_metrics(value: Any) -> dict[str, float]:
    """Leaders' metric dicts merged by `shard_and_run`: equal values stay scalars, differing ones (per-rank times)
    come back as lists, of which the slowest counts."""
    return {k: float(max(v)) if isinstance(v, list) else float(v) for k, v in value.items()}


class Policy:
    """`world_size` PolicyWorker actors on the bundles of `placement` from `first_bundle` on (the first ones: a
    policy, a critic or a colocated teacher; the last ones: a teacher on devices of its own)."""

    def __init__(
        self,
        spec: PolicySpec,
        placement: Any,
        *,
        world_size: int,
        resource_fraction: float = 1.0,
        omp_num_threads: Threads = 1,
        busy_per_node: Optional[int] = None,
        name: str = "policy",
        first_bundle: int = 0,
        wait_before_init: Optional[Callable[[], None]] = None,
    ) -> None:
        self.spec = spec
        self.workers = WorkerGroup(
            name,
            PolicyWorker,
            placement,
            init_args=(spec,),
            bundle_indices=list(range(first_bundle, first_bundle + world_size)),
            resource_fraction=resource_fraction,
            omp_num_threads=omp_num_threads,
            busy_per_node=busy_per_node,
            start_timeout_s=300.0,
            wait_before_init=wait_before_init,
        )
        self.workers.layout_from_workers(PolicyWorker.data_parallel_layout)
        self._planned: Optional[tuple[int, list[int]]] = None  # (bucket_bytes, each bucket's owner stage) held
        self._stage_ranks: Optional[list[int]] = None  # the global rank of each pipeline stage's first rank
        self._checkpoint_bytes: Optional[int] = None

    @property
    def data_parallel_size(self) -> int:
        return self.workers.layout.dp_size

    def logprobs(self, batch: RankBatch, *, temperature: float = 1.0, reference: bool = False) -> torch.Tensor:
        """[B, T] log-probabilities of `batch.input_ids` (position 0 is 0) under the policy or its reference; for a
        reward model, its score at every token (the sequence's score at position length - 1)."""
        self._check_groups(batch)
        return self.workers.shard_and_run(
            PolicyWorker.logprobs,
            batch,
            temperature=temperature,
            reference=reference,
            work=Work(tokens=batch.input_ids.numel()),
        )

    def scores(self, batch: RankBatch) -> torch.Tensor:
        """[B] a reward model's score of each sequence: its value at the last real token (`batch.lengths`)."""
        if batch.lengths is None:
            raise ValueError("scores need RankBatch.lengths (the position of each sequence's last token)")
        values = self.logprobs(batch)  # [B, T]
        return values.gather(1, (batch.lengths.long() - 1)[:, None]).squeeze(1)

    def routing_counts(self) -> torch.Tensor:
        """[2, layers] the routing disagreement counts of the logprob passes since the last call (a MoE policy given
        its batches' engine routing; mrl/model/router_replay.py), summed over the ranks."""
        return self.workers.run_all(PolicyWorker.routing_counts)[0]

    def _check_groups(self, batch: RankBatch) -> None:
        dp = self.data_parallel_size
        if batch.group_size > 1 and (len(batch) % dp or (len(batch) // dp) % batch.group_size):
            raise ValueError(
                f"{len(batch)} rows in groups of {batch.group_size} (preference pairs) do not split "
                f"into whole groups over {dp} data-parallel ranks: use a multiple of "
                f"{dp * batch.group_size} rows"
            )

    def train(self, batch: RankBatch, loss_fn: PolicyLoss, *, temperature: float = 1.0) -> dict[str, float]:
        """One optimizer step on the whole batch (all rows, every data-parallel rank)."""
        self._check_groups(batch)
        count = global_count(batch.loss_mask, loss_fn.level)
        merged = self.workers.shard_and_run(
            PolicyWorker.train,
            batch,
            loss_fn,
            count,
            temperature=temperature,
            work=Work(tokens=3 * batch.input_ids.numel()),
        )  # forward + backward
        return _merge_metrics(merged)

    # ------------------------------------------------------------------------------------ memory hand-over
    def release_memory(self) -> dict[str, float]:
        """Before a colocated engine wakes: every rank moves what `policy.offload_when_generating` names to host
        memory and empties its CUDA cache (on CPU: nothing moves). No caller has to undo it: train, logprobs, the
        refit export, save and load take back what they need first. Idempotent; with the weights configured to go,
        call it again after the refit (its export brought them back)."""
        reports = self.workers.run_all(PolicyWorker.release_memory)
        return {k: (max if k.startswith("reserved") else sum)(r[k] for r in reports) for k in reports[0]}

    def reclaim_memory(self) -> None:
        """Every rank takes back what `release_memory` moved (train does it itself; this is for callers that want
        the transfer outside a timed phase)."""
        self.workers.run_all(PolicyWorker.reclaim_memory)

    # --------------------------------------------------------------------------------------- refit source
    def plan_buckets(self, bucket_bytes: int) -> range:
        """Buckets of at most `bucket_bytes` of whole layers, planned on every rank from the config alone (once: the
        ranks keep the plan until another bucket size is asked for, so a refit every step makes no call for it)."""
        if self._planned is None or self._planned[0] != bucket_bytes:
            self.workers.run_all(PolicyWorker.plan_export, bucket_bytes)
            self._planned = (bucket_bytes, self.workers.run_all(PolicyWorker.bucket_owners)[0])
        return range(len(self._planned[1]))

    def bucket_sender(self, index: int) -> int:
        """The pipeline stage that owns bucket `index` of the current plan (`plan_buckets` first): the sender of a
        collective transport with one sender per stage."""
        if self._planned is None:
            raise RuntimeError("bucket_sender before plan_buckets")
        return self._planned[1][index]

    def _pipeline_stages(self) -> int:
        return self.spec.policy.parallel.pipeline_parallel_size

    def _sender_ranks(self) -> list[int]:
        """Global rank of each pipeline stage's first rank (tp = cp = dp = 0), in stage order."""
        if self._stage_ranks is None:
            stages = self.workers.run_all(PolicyWorker.refit_stage)
            self._stage_ranks = [rank for _, rank in sorted((s, r) for r, s in enumerate(stages) if s is not None)]
            assert len(self._stage_ranks) == self._pipeline_stages(), stages
        return self._stage_ranks

    def send_bucket(self, index: int, transport: WeightTransport) -> dict:
        return self.send_bucket_async(index, transport).result()

    def send_bucket_async(self, index: int, transport: WeightTransport) -> GroupFuture:
        """Every rank runs `PolicyWorker.export_bucket`: the ranks `transport.sending` names gather and pack bucket
        `index`, and `transport.merge` joins their payloads into the result (rank 0's, or the owner stage's first
        rank's, alone; CUDA IPC: every rank's part, one handle per GPU; shared-memory files under EP: each EP rank's
        experts in its own file)."""
        bucket_bytes = self._planned[0] if self._planned is not None else 0
        return self.workers.run_all_async(
            PolicyWorker.export_bucket, index, transport, work=Work(bytes=bucket_bytes)
        ).then(transport.merge)

    def refit_addresses(self) -> list[tuple[str, int]]:
        """Each pipeline stage's first rank's node and a free port there, in stage order: the rendezvous of each
        sender's sub-group of a refit broadcast group (stage 0's first rank is rank 0)."""
        ports = self.workers.run_all(PolicyWorker.refit_port)
        return [(self.workers.info[rank].node_ip or "127.0.0.1", ports[rank]) for rank in self._sender_ranks()]

    def join_refit_group_async(self, transport: CollectiveTransport) -> GroupFuture:
        """The senders join the broadcast group: each stage's first rank (one sender per stage) or rank 0 (member
        0); the other ranks take no part."""
        return self.workers.run_all_async(PolicyWorker.join_refit_group, transport)

    def export_state(self) -> dict[str, torch.Tensor]:
        """The whole model as HF-named full tensors (small models: HF export, tests)."""
        self._planned = None  # the ranks plan one bucket of everything for it
        return self.workers.run_all(PolicyWorker.export_state)[0]

    def export_adapters(self) -> list[tuple[str, torch.Tensor]]:
        """The LoRA adapters (`policy.lora`) as a PEFT adapter folder's tensors (the refit's bucket plan kept)."""
        return self.workers.run_all(PolicyWorker.export_adapters)[0]

    def save(self, path: str, *, weights_only: bool = False) -> None:
        """Every rank writes its shards of checkpoint `path` (`weights_only`: no optimizer or LR schedule)."""
        self.workers.run_all(PolicyWorker.save, path, weights_only=weights_only, work=Work(bytes=self._state_bytes()))

    def load(self, path: str, *, load_optimizer: bool = True) -> list[Any]:
        """Every rank loads its shards of checkpoint `path`; returns the ranks' load reports."""
        return self.workers.run_all(
            PolicyWorker.load, path, load_optimizer=load_optimizer, work=Work(bytes=self._state_bytes())
        )

    def _state_bytes(self) -> int:
        """Bytes of a checkpoint of every rank's shards (weights and optimizer states), asked once: a save's or a
        load's work, for its deadline."""
        if self._checkpoint_bytes is None:
            self._checkpoint_bytes = int(sum(self.workers.run_all(PolicyWorker.state_bytes)))
        return self._checkpoint_bytes

    def shutdown(self) -> None:
        """The ranks leave their process groups (bounded: a dead or stuck rank cannot), then their actors are killed."""
        self.workers.shutdown(clean=PolicyWorker.shutdown)
