"""Placement on GPUs, proved on a CPU machine with Ray's logical GPUs (a local Ray told it has 8, which it accounts
for as it would real ones: CUDA_VISIBLE_DEVICES is set from the ids it assigns, ray/_private/utils.py
`set_visible_accelerator_ids`). No model is built: probe workers stand where the policy's ranks, the engines, vLLM's
own workers and a reward model would, placed by the same functions a run uses (`reserve_placement`, `group_share`,
`engine_seats`, `vllm_engine_config`, `engine_actor_options`, `ray_executor_env`).

What each probe reports is checked against the layout the config implies: the GPU share it holds, `ray.get_gpu_ids()`
and CUDA_VISIBLE_DEVICES inside it, which device the device rule gives it; an engine of tensor parallel k holds no GPU
itself and its k workers (started the way vLLM's Ray executor starts them: vllm/v1/executor/ray_executor_v2.py,
one actor per bundle of VLLM_RAY_BUNDLE_INDICES with num_gpus=VLLM_RAY_PER_WORKER_GPUS, in the engine's placement
group) hold one GPU share each, on k bundles of one node; an engine of k x s pipeline stages, on k x s bundles, each
stage's k on one node, the stages on several nodes of one placement group (the recipes' plans below).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from mrl.app.runtime import group_share, reserve_placement
from mrl.config import load_config
from mrl.distributed import RayCluster, WorkerGroup
from mrl.distributed.cluster import Bundle, Placement
from mrl.inference.factory import engine_seats, engine_spans_nodes, engine_world_size, vllm_engine_config
from mrl.inference.vllm_backend import ray_executor_env
from mrl.inference.vllm_worker import engine_actor_options
from mrl.parallel.devices import device_index
from mrl.testing.placement_probes import Probe

pytestmark = pytest.mark.functional

RECIPES = Path(__file__).resolve().parents[3] / "recipes"
LOGICAL_GPUS = 8


@pytest.fixture(scope="module")
def cluster():
    with RayCluster(num_cpus=4, num_gpus=LOGICAL_GPUS) as c:
        yield c


def _config(recipe: str, *overrides: str, cpus: float = 0.25):
    return load_config(RECIPES / recipe, [*overrides, f"cluster.cpus_per_worker={cpus}"])


TINY_BATCH = "policy.train_micro_batch_size=1"  # divides every data-parallel size below


def _one_node(cfg):
    """The recipe's layout on its first node alone (every node is laid out alike): the config copied with
    cluster.num_nodes = 1, unvalidated, since the policy's parallel sizes are the whole cluster's."""
    return cfg.model_copy(update={"cluster": cfg.cluster.model_copy(update={"num_nodes": 1})})


# (recipe, overrides, big): layouts whose workers are started, on Ray told it has 8 GPUs (one node). `big`: the first
# node of a recipe of several, its engines alone (the policy's ranks sit as in every layout: rank r on bundle r,
# half of its GPU; each whole recipe is also checked as a plan, further below).
STARTED = {
    "tiny, reward model": ("arith-tiny-cpu.yaml", ("cluster.devices_per_node=2", "env.reward_model.model=rm",
                                                   TINY_BATCH), False),
    "tiny, own engine devices": ("arith-tiny-cpu.yaml", ("cluster.devices_per_node=4", "generation.colocated=false",
                                                         "generation.num_devices=2", TINY_BATCH), False),
    "Qwen3-30B-A3B 2n8g, node 0: 4 engines of TP2": ("grpo-qwen3-30b-a3b-2n8g.yaml", (), True),
}


@pytest.mark.parametrize("layout", list(STARTED))
def test_every_worker_holds_the_gpu_share_its_layout_implies(cluster, layout):
    recipe, overrides, big = STARTED[layout]
    cfg = _config(recipe, *overrides)
    cfg = _one_node(cfg) if big else cfg
    placement = reserve_placement(cfg, cluster)
    groups = []
    try:
        assert placement.on_gpus and all(b.resources["GPU"] == 1.0 for b in placement.bundles)
        reward_model = cfg.env.reward_model is not None
        share = group_share(cfg, engine=True, others=int(reward_model))
        if not big:
            policy = WorkerGroup("policy", Probe, placement, bundle_indices=range(cfg.policy_world_size),
                                 resource_fraction=share)
            groups.append(policy)
        seats = engine_seats(cfg, placement, colocated_share=share)
        engine_cfg = vllm_engine_config(cfg, "model", seats=seats, placement=placement)
        engines = WorkerGroup("generation", Probe, placement, init_args=(engine_cfg,), bundle_indices=seats.actors,
                              resource_fraction=seats.share, **engine_actor_options(engine_cfg))
        groups.append(engines)
        gpu_of = {} if big else _check_ranks(policy.run_all(Probe.seen), placement, range(cfg.policy_world_size), share)
        size = engine_world_size(cfg)
        if size == 1:
            engine_gpus = _check_ranks(engines.run_all(Probe.seen), placement, seats.actors, seats.share)
        else:
            engine_gpus = _check_tensor_parallel_engines(engines, placement, seats, size)
        shared = {b: g for b, g in engine_gpus.items() if b in gpu_of}
        assert all(gpu_of[b] == g for b, g in shared.items()), "a colocated engine is not on its policy rank's GPU"
        assert bool(shared) == (cfg.generation.colocated and not big)
        if reward_model:
            scorer = WorkerGroup("reward_model", Probe, placement, bundle_indices=range(cfg.policy_world_size),
                                 resource_fraction=share)
            groups.append(scorer)
            assert _check_ranks(scorer.run_all(Probe.seen), placement, range(cfg.policy_world_size), share) == gpu_of
        if not cfg.generation.colocated:  # the engines' bundles are not the policy's
            assert set(seats.actors).isdisjoint(range(cfg.policy_world_size))
    finally:
        for group in groups:
            group.shutdown()
        cluster.remove_placement(placement)


def _check_ranks(seen: list[dict], placement, bundles, share: float) -> dict[int, int]:
    """Rank r holds `share` of the GPU of bundle bundles[r], sees it as its one device, and the device rule gives
    it device 0 whatever its LOCAL_RANK (up to 7 here). Returns bundle -> GPU id."""
    for rank, (report, bundle) in enumerate(zip(seen, bundles)):
        assert len(report["gpu_ids"]) == 1, f"rank {rank} holds {report['gpu_ids']}: no GPU worker may hold none"
        assert report["held"] == pytest.approx(share, abs=1e-4), f"rank {rank} holds {report['held']} of a GPU, not {share}"
        assert report["visible"] == str(report["gpu_ids"][0]) and report["device"] == 0
        assert report["node"] == placement.bundles[bundle].node_id
    gpus = [report["gpu_ids"][0] for report in seen]
    assert len(set(gpus)) == len(gpus), f"two ranks of one group share a GPU: {gpus}"
    return dict(zip(bundles, gpus))


def _check_tensor_parallel_engines(engines, placement, seats, size: int) -> dict[int, int]:
    """Each engine's actor holds no GPU and sees every GPU (vLLM's platform code looks at them); its `size` workers
    (TP x PP) hold one GPU share each, `size` different GPUs on bundles of one node. Returns bundle -> GPU id of the
    workers."""
    outer = engines.run_all(Probe.seen)
    workers = engines.run_all(Probe.start_engine_workers)
    used = []
    for engine, (report, team, bundles) in enumerate(zip(outer, workers, seats.workers)):
        assert report["gpu_ids"] == [] and report["held"] == 0 and report["noset"] == "1", f"engine {engine}: {report}"
        assert len(team) == size and len({w["gpu_ids"][0] for w in team}) == size, team
        assert [w["node"] for w in team] == [placement.bundles[b].node_id for b in bundles]
        assert all(len(w["gpu_ids"]) == 1 and w["held"] == pytest.approx(seats.share, abs=1e-4) and w["noset"] == "1"
                   for w in team), team
        assert len({placement.bundles[b].group.id for b in bundles}) == 1  # one node's bundles
        used += [w["gpu_ids"][0] for w in team]
    assert len(set(used)) == len(used), f"two engines' workers on one GPU: {used}"
    return dict(zip((b for bundles in seats.workers for b in bundles), used))


def test_device_rule_gives_a_ray_actor_its_one_gpu_and_torchrun_its_local_rank():
    assert device_index(local_rank=3, local_world_size=8, visible=1) == 0  # a Ray actor: its bundle's GPU
    assert device_index(local_rank=3, local_world_size=8, visible=8) == 3  # torchrun: the node's GPUs
    from mrl.parallel.devices import DeviceRuleError

    with pytest.raises(DeviceRuleError, match="sees 2 CUDA devices"):
        device_index(local_rank=3, local_world_size=8, visible=2)
    with pytest.raises(DeviceRuleError, match="sees no CUDA device"):
        device_index(local_rank=0, local_world_size=1, visible=0)


# Recipes too big to start here (8 to 256 GPUs, on 1 to 32 nodes; a local Ray is one node): their placements are built
# as `RayCluster.create_placement` lays them out (a placement group per node, bundles in rank order) and every seat
# is checked, no worker started.
PLANNED = {"DeepScaleR 8K": "grpo-deepscaler-1.5b-8K.yaml", "DeepScaleR 16K": "grpo-deepscaler-1.5b-16K.yaml",
           "Qwen3-30B-A3B 2n8g": "grpo-qwen3-30b-a3b-2n8g.yaml", "DeepSeek-V3 32n8g": "grpo-deepseek-v3-32n8g.yaml"}


@dataclass(frozen=True)
class _NodeGroup:
    id: str


def _placement_of(cfg, one_group: bool = False) -> Placement:
    """A group per node, or (`one_group`) one group whose bundles lie node after node, in the order
    `RayCluster.create_placement(one_group=True)` puts them (bundle indices as Ray numbers them in the group)."""
    per_node, nodes = cfg.cluster.devices_per_node, cfg.cluster.num_nodes
    groups = [_NodeGroup("all")] if one_group else [_NodeGroup(f"node{n}") for n in range(nodes)]
    bundles = [Bundle(groups[0 if one_group else n], n * per_node + i if one_group else i,
                      {"CPU": cfg.cluster.cpus_per_worker, "GPU": 1.0}, f"node{n}", "")
               for n in range(nodes) for i in range(per_node)]
    return Placement("planned", bundles, groups)  # type: ignore[arg-type]


@pytest.mark.parametrize("layout", list(PLANNED))
def test_large_recipes_seat_every_engine_with_a_gpu_share(layout):
    cfg = _config(PLANNED[layout])
    spans = engine_spans_nodes(cfg)
    assert spans == (layout == "DeepSeek-V3 32n8g")  # TP 8 x PP 4: 4 nodes an engine
    placement = _placement_of(cfg, one_group=spans)
    share = group_share(cfg, engine=True)
    seats = engine_seats(cfg, placement, colocated_share=share)
    engine_cfg = vllm_engine_config(cfg, "model", seats=seats, placement=placement)
    tp, size = cfg.generation.vllm.tensor_parallel_size, engine_world_size(cfg)
    assert len(seats.actors) == cfg.policy_world_size // size and seats.share == share == 0.5
    assert engine_cfg.refit_transport == "cuda_ipc" and engine_cfg.sleep_when_idle
    options = engine_actor_options(engine_cfg)
    if tp == 1:
        assert options["gpu_fraction"] is None and engine_cfg.ray_executor_bundles == ()
        assert seats.actors == tuple(range(cfg.policy_world_size))  # an engine beside every policy rank
        return
    assert options["gpu_fraction"] == 0.0 and engine_cfg.ray_worker_gpus == share
    assert not engine_cfg.multiprocessing  # the engine core stays in the actor, where its placement group is
    assert all(len(w) == size and len({placement.bundles[b].group.id for b in w}) == 1 for w in seats.workers)
    for workers in seats.workers:  # vLLM's ranks stage by stage: each stage's TP group on one node
        stage_nodes = [{placement.bundles[b].node_id for b in workers[k:k + tp]} for k in range(0, size, tp)]
        assert all(len(nodes) == 1 for nodes in stage_nodes)
        assert len(set.union(*stage_nodes)) == -(-size // cfg.cluster.devices_per_node)
    assert sorted(b for w in seats.workers for b in w) == list(range(cfg.policy_world_size))  # a worker per GPU
    last = len(seats.actors) - 1
    env = ray_executor_env(engine_cfg.for_engine(last))
    assert env["VLLM_RAY_BUNDLE_INDICES"] == ",".join(str(placement.bundles[b].index) for b in seats.workers[last])
    assert env["VLLM_RAY_PER_WORKER_GPUS"] == "0.5"


def test_an_engine_that_would_straddle_nodes_is_refused():
    cfg = _config("grpo-qwen3-30b-a3b-2n8g.yaml", "generation.vllm.tensor_parallel_size=16")
    with pytest.raises(ValueError, match="tensor-parallel group of 16 GPUs must sit on one node"):
        engine_seats(cfg, _placement_of(cfg, one_group=True))
    staged = _config("grpo-qwen3-30b-a3b-2n8g.yaml", "generation.vllm.tensor_parallel_size=8",
                     "generation.vllm.pipeline_parallel_size=2")
    assert len(engine_seats(staged, _placement_of(staged, one_group=True)).workers[0]) == 16
    with pytest.raises(ValueError, match="must be in one placement group"):  # vLLM's executor takes one group
        engine_seats(staged, _placement_of(staged))
    apart = _config("grpo-qwen3-30b-a3b-2n8g.yaml", "generation.vllm.tensor_parallel_size=4",
                    "generation.vllm.pipeline_parallel_size=4", "generation.colocated=false",
                    "generation.num_devices=16", "cluster.num_nodes=4")
    with pytest.raises(ValueError, match="needs generation.colocated=true"):  # 16 policy ranks, the engine on 2 nodes
        engine_seats(apart, _placement_of(apart, one_group=True))
