"""A vLLM engine larger than a node, on a Ray cluster of two nodes started on this machine (ray.cluster_utils.Cluster:
two raylets, each told it has 4 GPUs, which Ray schedules as real ones: GPU ids per node, CUDA_VISIBLE_DEVICES set).
No model is built: probes stand where the engine and vLLM's workers would (mrl/testing/placement_probes.py).

What a run does is checked against what vLLM needs: the run reserves ONE placement group of both nodes (vLLM's Ray
executor places an engine's workers in its actor's group), its bundles in rank order node by node as Ray really put
them; an engine of TP 2 x PP 4 gets 8 workers in vLLM's rank order, each pipeline stage's two on one node, stages 0-1
on the first node and 2-3 on the second, every worker on its own GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import ray

from mrl.app.runtime import reserve_placement
from mrl.config import load_config
from mrl.distributed import RayCluster, WorkerGroup
from mrl.inference.factory import engine_seats, engine_spans_nodes, vllm_engine_config
from mrl.inference.vllm_worker import engine_actor_options
from mrl.testing.placement_probes import Probe

pytestmark = pytest.mark.functional

RECIPES = Path(__file__).resolve().parents[3] / "recipes"
GPUS_PER_NODE = 4


@pytest.fixture(scope="module")
def two_nodes():
    from ray.cluster_utils import Cluster

    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": GPUS_PER_NODE})
    try:
        nodes.add_node(num_cpus=2, num_gpus=GPUS_PER_NODE)
        nodes.wait_for_nodes()
        cluster = RayCluster(address=nodes.address, log_to_driver=False)
        yield cluster
        cluster.shutdown()
    finally:
        ray.shutdown()
        nodes.shutdown()


def test_an_engine_of_pipeline_stages_puts_each_stage_on_one_node(two_nodes):
    cfg = load_config(RECIPES / "arith-tiny-cpu.yaml", [
        "cluster.num_nodes=2", f"cluster.devices_per_node={GPUS_PER_NODE}", "cluster.cpus_per_worker=0.25",
        "policy.train_micro_batch_size=1", "generation.vllm.tensor_parallel_size=2",
        "generation.vllm.pipeline_parallel_size=4"])
    assert engine_spans_nodes(cfg)
    placement = reserve_placement(cfg, two_nodes)
    engines = None
    try:
        assert len(placement.groups) == 1 and placement.on_gpus
        nodes = [b.node_id for b in placement.bundles]
        first, second = nodes[0], nodes[-1]
        assert first != second and nodes == [first] * GPUS_PER_NODE + [second] * GPUS_PER_NODE
        seats = engine_seats(cfg, placement, colocated_share=0.5)
        assert seats.actors == (0,) and seats.workers == (tuple(range(8)),)
        engine_cfg = vllm_engine_config(cfg, "model", seats=seats, placement=placement)
        assert engine_cfg.ray_executor_bundles == (tuple(b.index for b in placement.bundles),)
        engines = WorkerGroup("generation", Probe, placement, init_args=(engine_cfg,), bundle_indices=seats.actors,
                              resource_fraction=seats.share, **engine_actor_options(engine_cfg))
        (workers,) = engines.run_all(Probe.start_engine_workers)
        assert [w["node"] for w in workers] == [first] * 4 + [second] * 4  # ranks 2k, 2k + 1: stage k
        assert all(len(w["gpu_ids"]) == 1 and w["held"] == pytest.approx(0.5) for w in workers)
        for node in (first, second):
            gpus = [w["gpu_ids"][0] for w in workers if w["node"] == node]
            assert sorted(gpus) == list(range(GPUS_PER_NODE))  # one worker per GPU of the node
    finally:
        if engines is not None:
            engines.shutdown()
        two_nodes.remove_placement(placement)
