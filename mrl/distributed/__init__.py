"""Ray orchestration: the cluster and its placements (cluster.py) and worker groups of one actor per rank
(worker_group.py; waiting on their calls: group_calls.py), with the batch sharding contract in batch.py.

The names below load on first use (PEP 562), so `mrl.distributed.env` and `mrl.distributed.batch` import without
Ray: the GPU tier runs on machines that have none (tests/gpu)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_HOMES = {
    "merge_shards": "batch",
    "replicated_field": "batch",
    "split_batch": "batch",
    "Bundle": "cluster",
    "Placement": "cluster",
    "RayCluster": "cluster",
    "ClusterResourceError": "errors",
    "WorkerDiedError": "errors",
    "WorkerError": "errors",
    "WorkerTimeoutError": "errors",
    "Deadlines": "deadlines",
    "Work": "deadlines",
    "DataParallelLayout": "worker_group",
    "GroupFuture": "group_calls",
    "WorkerGroup": "worker_group",
    "WorkerInfo": "group_calls",
    "result_watching": "group_calls",
    "wait_all": "group_calls",
}

if TYPE_CHECKING:
    from mrl.distributed.batch import merge_shards, replicated_field, split_batch
    from mrl.distributed.cluster import Bundle, Placement, RayCluster
    from mrl.distributed.deadlines import Deadlines, Work
    from mrl.distributed.errors import ClusterResourceError, WorkerDiedError, WorkerError, WorkerTimeoutError
    from mrl.distributed.group_calls import GroupFuture, WorkerInfo, result_watching, wait_all
    from mrl.distributed.worker_group import DataParallelLayout, WorkerGroup


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'mrl.distributed' has no attribute {name!r}")
    return getattr(importlib.import_module(f"mrl.distributed.{home}"), name)


__all__ = [
    "Bundle",
    "ClusterResourceError",
    "DataParallelLayout",
    "Deadlines",
    "GroupFuture",
    "Placement",
    "Work",
    "RayCluster",
    "WorkerDiedError",
    "WorkerError",
    "WorkerGroup",
    "WorkerInfo",
    "WorkerTimeoutError",
    "merge_shards",
    "replicated_field",
    "result_watching",
    "split_batch",
    "wait_all",
]
