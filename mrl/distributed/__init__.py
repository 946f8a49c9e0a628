"""Ray orchestration: the cluster and its placements (cluster.py) and worker groups of one actor per rank
(worker_group.py), with the batch sharding contract in batch.py."""

from mrl.distributed.batch import merge_shards, replicated_field, split_batch
from mrl.distributed.cluster import Bundle, Placement, RayCluster
from mrl.distributed.errors import ClusterResourceError, WorkerDiedError, WorkerError, WorkerTimeoutError
from mrl.distributed.worker_group import (DataParallelLayout, GroupFuture, WorkerGroup, WorkerInfo, result_watching,
                                         wait_all)

__all__ = [
    "Bundle",
    "ClusterResourceError",
    "DataParallelLayout",
    "GroupFuture",
    "Placement",
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
