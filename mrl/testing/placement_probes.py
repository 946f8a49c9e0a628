"""Probes that stand where mrl's workers would on GPUs, for placement tests on a CPU machine with Ray's logical GPUs
(tests/functional/distributed): each reports what a process placed by Ray sees of its GPUs and its node.

`Probe.start_engine_workers` starts an engine's workers the way vLLM 0.32's Ray executor does
(vllm/v1/executor/ray_executor_v2.py: one actor per bundle of VLLM_RAY_BUNDLE_INDICES, in rank order, with
num_gpus=VLLM_RAY_PER_WORKER_GPUS, in the placement group its engine's actor runs in), from the environment mrl
gives the engine (`mrl.inference.vllm_backend.ray_executor_env`).
"""

from __future__ import annotations

import os

import ray
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


def _seen() -> dict:
    """What a process placed by Ray sees of its GPUs."""
    from mrl.parallel.devices import local_cuda_device

    ids = [int(i) for i in ray.get_gpu_ids()]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    count = len(visible.split(",")) if visible else 0  # what torch.cuda.device_count() would say on a GPU node
    # the share Ray accounts to it (Ray keeps resource amounts to 1e-4: a third is 0.3333)
    held = ray.get_runtime_context().get_assigned_resources().get("GPU", 0.0)
    return {
        "gpu_ids": ids,
        "held": held,
        "visible": visible,
        "device": local_cuda_device(count) if count else None,
        "node": ray.get_runtime_context().get_node_id(),
        "noset": os.environ.get("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"),
    }


@ray.remote(num_cpus=0)
class _VllmLikeWorker:
    def seen(self) -> dict:
        return _seen()


class Probe:
    """Stands where a policy rank, an engine or a reward model would."""

    def __init__(self, engine_config=None) -> None:
        self.engine_config = engine_config

    def seen(self) -> dict:
        return _seen()

    def start_engine_workers(self) -> list[dict]:
        """As vLLM's Ray executor does for an engine of several workers (module docstring), from the environment
        mrl gives it; what each worker sees, in vLLM's rank order. Imported here, by the engine probes alone:
        `mrl.inference` imports torch, which the probes of ranks and of vLLM's workers never need."""
        from mrl.inference.vllm_backend import ray_executor_env

        config = self.engine_config.for_engine(int(os.environ["RANK"]))
        env = ray_executor_env(config)
        group = get_current_placement_group()
        workers = [
            _VllmLikeWorker.options(  # type: ignore[attr-defined]  # mypy ignores the ray.remote class decorator
                num_gpus=float(env["VLLM_RAY_PER_WORKER_GPUS"]),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    group,  # type: ignore[arg-type]  # ray 2.60 documents None (no group) but annotates PlacementGroup
                    placement_group_bundle_index=int(index),
                    placement_group_capture_child_tasks=True,
                ),
                runtime_env={"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}},
            ).remote()
            for index in env["VLLM_RAY_BUNDLE_INDICES"].split(",")
        ]
        seen = ray.get([worker.seen.remote() for worker in workers])
        for worker in workers:
            ray.kill(worker)
        return seen
