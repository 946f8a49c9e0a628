"""Router replay (mrl/model/router_replay.py): the trainer routes each token to the experts a batch's routing names.

Engine to trainer: the Megatron engine records the experts of every token it feeds; with the engine's weights the
trainer's own routing of the same tokens equals it (disagreement 0). With the engine's expert-selection bias
perturbed (DeepSeek-V3's bias chooses experts and weighs nothing, so only the choices move), the trainer without
replay disagrees on a share of the tokens and its logprobs leave the engine's; with replay they come back to the
fp32 agreement of identical models.

The engine's routing is played by a routing chosen here: either the trainer's own choices, recorded in a pass
without replay (replaying them must change nothing and disagree nowhere), or random expert sets (which the trainer
would almost never choose: the disagreement is ~27/28 per layer, and the logprobs move). The random routing's logprobs
and one train step under EP2, TP2 + SP with packing, CP2 with packing, and PP2 with recomputation must equal the one
process's: the routing reaches every router cut to the tokens it sees, and recomputed forwards replay the same
experts as their first forward (under PP's 1F1B schedule another micro-batch's forward runs in between).
"""

from __future__ import annotations

import pytest
import torch

from mrl.testing.batches import long_tail_batch
from mrl.testing.distributed import run_on_ranks
from mrl.testing.losses import PGLoss
from mrl.testing.tiny_models import build_tiny_hf_model

LENGTHS = [24, 5, 9, 13, 3, 17, 7, 11]  # prompt + response, right-padded to WIDTH; the prompt is the first 3 tokens
WIDTH, PROMPT, LAYERS, EXPERTS, TOPK = 24, 3, 2, 8, 2


# ---- rank side: imported by each rank process of run_on_ranks ----


def make_batch():
    """ids [8, 24] (pad id 0 past each length), loss mask on the response tokens, per-sequence advantages."""
    return long_tail_batch(LENGTHS, WIDTH, PROMPT)


def random_routing(seed: int = 1) -> torch.Tensor:
    """[8, 24, layers, k] distinct random experts per token and layer, stored as the rollouts keep them (uint8 for
    the tiny model's experts); `no_route` on each sequence's last token and past it (what an engine never fed through
    the model: routed freshly). The trainer's own routing below is int16 with -1 (the other stored form)."""
    from mrl.model.router_replay import no_route, routing_dtype

    g = torch.Generator().manual_seed(seed)
    routing = torch.rand(len(LENGTHS), WIDTH, LAYERS, EXPERTS, generator=g).argsort(dim=-1)[..., :TOPK]
    dtype = routing_dtype(EXPERTS)
    routing = routing.to(dtype)
    routing[torch.arange(WIDTH)[None, :] >= torch.tensor(LENGTHS)[:, None] - 1] = no_route(dtype)
    return routing


def _build(model_dir: str, sp: bool, recompute: bool):
    import json
    from pathlib import Path

    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )

    from converters import model_dims
    from converters.hf_io import load_hf_state
    from mrl.config.schema import OptimizerConfig, SchedulerConfig
    from mrl.model.build import (
        build_model,
        freeze_routers,
        load_hf_weights,
        router_settings,
        transformer_config_from_hf,
    )
    from mrl.policy.optim import build_optimizer, build_scheduler

    hf_config = json.loads((Path(model_dir) / "config.json").read_text())
    extra = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) if recompute else {}
    cfg = transformer_config_from_hf(
        hf_config, tensor_parallel=ps.get_tensor_model_parallel_world_size(),
        pipeline_parallel=ps.get_pipeline_model_parallel_world_size(),
        context_parallel=ps.get_context_parallel_world_size(), sequence_parallel=sp, **extra,
        **router_settings(model_dims(hf_config), expert_parallel=ps.get_expert_model_parallel_world_size()))
    model = build_model(hf_config, cfg)
    load_hf_weights(model, load_hf_state(model_dir), hf_config)
    freeze_routers(model)
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(grad_reduce_in_fp32=True), module=model)
    cfg.finalize_model_grads_func = finalize_model_grads
    opt_cfg = OptimizerConfig(lr=1e-3, weight_decay=0.0, adam_eps=1e-6)
    optimizer = build_optimizer([ddp], opt_cfg, params_dtype=torch.float32)
    return ddp, optimizer, build_scheduler(optimizer, opt_cfg, SchedulerConfig(), total_steps=1), hf_config


def run(model_dir: str, modes: list[dict], tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, sp: bool = False,
        packing: int = 0, recompute: bool = False) -> list[dict]:
    """Per mode (a fresh model each): logprobs before and after one train step with the batch's `routing`
    ("random", "own": the trainer's own choices recorded in a first pass, "none"), replayed or (`replay` False) only
    measured, and the step's routing disagreement counts [2, layers] summed over the ranks. Reporting ranks (last
    stage, TP 0, CP 0) return their data-parallel shard's rows."""
    import os

    from megatron.core import parallel_state as ps

    from mrl.parallel.groups import init_process_groups
    from mrl.parallel.layout import ParallelDims

    init_process_groups(ParallelDims(tp=tp, pp=pp, cp=cp, ep=ep, sequence_parallel=sp,
                                     world_size=int(os.environ["WORLD_SIZE"])))
    layout = dict(tp=tp, cp=cp, sp=sp, packing=packing, recompute=recompute)
    return [_one_mode(model_dir, ps, layout, **mode) for mode in modes]


def _one_mode(model_dir: str, ps, layout: dict, routing: str, replay: bool = True) -> dict:
    import torch.distributed as dist

    from mrl.config.schema import PackingConfig
    from mrl.model.router_replay import RoutingReplay
    from mrl.policy.interface import RankBatch, global_count
    from mrl.policy.train_step import StepContext, logprobs_of_batch, train_on_batch

    ddp, optimizer, scheduler, hf_config = _build(model_dir, layout["sp"], layout["recompute"])
    ids, mask, adv = make_batch()
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    rows = slice(dp_rank * len(ids) // dp, (dp_rank + 1) * len(ids) // dp)
    replayer = RoutingReplay([ddp], replay=replay, recompute=layout["recompute"],
                             tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=layout["tp"],
                             sequence_parallel=layout["sp"])
    ctx = StepContext(dp_size=dp, cp_rank=ps.get_context_parallel_rank(), cp_size=layout["cp"],
                      cp_group=ps.get_context_parallel_group(), is_last_stage=ps.is_pipeline_last_stage(),
                      vocab_size=hf_config["vocab_size"], routing=replayer)
    batch = RankBatch(ids[rows], mask[rows], token_data={"adv": adv[rows]}, lengths=torch.tensor(LENGTHS)[rows])
    if routing == "random":
        batch.routing = random_routing()[rows]
    elif routing == "own":  # one process, one unpacked micro-batch: the routers' rows are [T * N] sequence-first
        replayer.record = {}
        logprobs_of_batch([ddp], batch, micro_batch_size=len(ids), ctx=ctx)
        recorded = [replayer.record[layer][0].view(WIDTH, len(ids), TOPK).transpose(0, 1) for layer in range(LAYERS)]
        batch.routing = torch.stack(recorded, dim=2).to(torch.int16)
        batch.routing[torch.arange(WIDTH)[None, :] >= torch.tensor(LENGTHS)[:, None]] = -1  # padding: no routing
        replayer.record = None
    packing = layout["packing"]
    budget = dict(packing=PackingConfig(enabled=True, tokens_per_microbatch=packing)) if packing else {}
    before = logprobs_of_batch([ddp], batch, micro_batch_size=2, ctx=ctx, **budget)
    replayer.reset()
    metrics = train_on_batch([ddp], optimizer, scheduler, batch, loss_fn=PGLoss("token"),
                             count=global_count(mask, "token"), micro_batch_size=2, ctx=ctx, **budget)
    counts = replayer.counts(LAYERS)
    groups = [ps.get_data_parallel_group(with_context_parallel=True), ps.get_pipeline_model_parallel_group()]
    if layout["sp"]:
        groups.append(ps.get_tensor_model_parallel_group())
    for group in groups:
        dist.all_reduce(counts, group=group)
    after = logprobs_of_batch([ddp], batch, micro_batch_size=2, ctx=ctx, **budget)
    reports = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0 and \
        ps.get_context_parallel_rank() == 0
    return {"rows": (rows.start, rows.stop), "before": before, "after": after, "counts": counts,
            "grad_norm": metrics["grad_norm"]} if reports else {"counts": counts}


def assemble(results: list[dict]) -> dict:
    """The reporting ranks' shards put back in row order."""
    before, after = torch.zeros(len(LENGTHS), WIDTH), torch.zeros(len(LENGTHS), WIDTH)
    for r in results:
        if "rows" in r:
            before[slice(*r["rows"])] = r["before"][:, :WIDTH]
            after[slice(*r["rows"])] = r["after"][:, :WIDTH]
    return {"before": before, "after": after, "counts": results[0]["counts"],
            "grad_norm": next(r["grad_norm"] for r in results if "rows" in r)}


def engines_and_trainer(model_dir: str, bias_noises: list[float], loop: str = "static") -> list[dict]:
    """`engine_and_trainer` for each noise, in one process."""
    from mrl.parallel.groups import init_process_groups
    from mrl.parallel.layout import ParallelDims

    init_process_groups(ParallelDims())
    return [engine_and_trainer(model_dir, noise, loop) for noise in bias_noises]


def engine_and_trainer(model_dir: str, bias_noise: float, loop: str = "static") -> dict:
    """Samples from the Megatron engine (its expert bias moved by `bias_noise` x N(0, 1)), then the trainer's
    logprobs of them without the routing, with it measured only, and replayed; each with its disagreement counts."""
    from megatron.core.transformer.moe.router import TopKRouter

    from mrl.algorithms.rollout import rows_from_output
    from mrl.inference.interface import SamplingConfig, routing_rows
    from mrl.inference.megatron_backend import MegatronBackend, MegatronEngineConfig
    from mrl.model.router_replay import RoutingReplay
    from mrl.policy.interface import RankBatch
    from mrl.policy.train_step import StepContext, logprobs_of_batch

    engine = MegatronBackend(MegatronEngineConfig(model_dir, max_model_len=64, max_batch_size=8, return_routing=True,
                                                  engine=loop))
    g = torch.Generator().manual_seed(11)
    if bias_noise:  # Qwen3-MoE's routers have no expert bias: its runs leave the engine as loaded
        with torch.no_grad():
            for router in (m for m in engine.model.modules() if isinstance(m, TopKRouter)):
                router.expert_bias += bias_noise * torch.randn(router.expert_bias.shape, generator=g)
    out = engine.generate([[5, 17, 42, 8], [9, 10, 11], [100, 3, 77, 21, 60, 4]], SamplingConfig(n=2, max_new_tokens=10,
                                                                                                   seed=3))
    ids, mask, gen = rows_from_output(out, pad_id=0)
    lengths = torch.tensor([len(s.prompt_token_ids) + s.length for s in out.samples])
    routing = routing_rows([s.routing for s in out.samples], ids.shape[1])
    ddp = _build(model_dir, sp=False, recompute=False)[0]
    results = {"mask": mask, "gen": gen, "routing": routing, "lengths": lengths}
    for name, replay, given in [("fresh", False, None), ("measured", False, routing), ("replayed", True, routing)]:
        replayer = RoutingReplay([ddp], replay=replay, recompute=False)
        ctx = StepContext(dp_size=1, cp_rank=0, cp_size=1, cp_group=None, is_last_stage=True,
                          vocab_size=engine.vocab_size, routing=replayer)
        logprobs = logprobs_of_batch([ddp], RankBatch(ids, mask, lengths=lengths, routing=given),
                                     micro_batch_size=len(ids), ctx=ctx)
        results[name] = {"logprobs": logprobs, "counts": replayer.counts(LAYERS)}
    return results


# ---- tests ----
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_hf_model(tmp_path_factory.mktemp("qwen3_moe"), "qwen3_moe", layers=LAYERS, seed=5))


@pytest.fixture(scope="module")
def one_process(model_dir):
    """TP1 results: no routing, the trainer's own routing replayed, random routing replayed and only measured."""
    names = ["none", "own", "random", "measured"]
    modes = [dict(routing="none"), dict(routing="own"), dict(routing="random"), dict(routing="random", replay=False)]
    (results,) = run_on_ranks(run, world_size=1, args=(model_dir, modes))
    return {name: assemble([result]) for name, result in zip(names, results)}


def valid() -> torch.Tensor:
    return torch.arange(WIDTH)[None, :] < torch.tensor(LENGTHS)[:, None]


def test_replaying_the_trainers_own_routing_changes_nothing(one_process):
    """The same logprobs and the same step (its gradient norm); after the step the trainer would route some tokens
    elsewhere, while the routing still names the old choices, so the logprobs after it are not compared."""
    none, own = one_process["none"], one_process["own"]
    assert (own["before"] - none["before"]).abs().max() <= 1e-6
    assert own["grad_norm"] == pytest.approx(none["grad_norm"], rel=1e-6)
    tokens = sum(LENGTHS)  # every token of the batch carried a routing, per layer
    assert own["counts"].tolist() == [[0.0] * LAYERS, [float(tokens)] * LAYERS]
    assert none["counts"].sum() == 0  # no routing given: nothing measured


def test_random_routing_is_replayed_and_measured(one_process):
    """Random expert sets: the logprobs move (replay acts); measuring without replay changes nothing but counts the
    same disagreement; a random set equals the trainer's with probability 1/28."""
    none, replayed, measured = one_process["none"], one_process["random"], one_process["measured"]
    moved = (replayed["before"] - none["before"])[valid()].abs()
    assert moved.max() > 0.05
    assert (measured["before"] - none["before"]).abs().max() <= 1e-6
    known = sum(length - 1 for length in LENGTHS)  # the last token of each sequence routes freshly
    assert replayed["counts"][1].tolist() == [float(known)] * LAYERS
    assert torch.equal(replayed["counts"], measured["counts"])
    fraction = replayed["counts"][0] / replayed["counts"][1]
    assert (fraction > 0.85).all(), fraction


LAYOUTS = {"ep2": dict(ep=2), "tp2-sp-packed": dict(tp=2, sp=True, packing=32),
           "cp2-packed": dict(cp=2, packing=32), "pp2-recompute": dict(pp=2, recompute=True)}


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
def test_replayed_logprobs_and_step_equal_one_process(model_dir, one_process, layout):
    """The random routing replayed, and a batch without routing (routed freshly, also by recomputed layers)."""
    modes = [dict(routing="random"), dict(routing="none")]
    ranks = run_on_ranks(run, world_size=2, args=(model_dir, modes), kwargs=LAYOUTS[layout])
    for i, name in enumerate(("random", "none")):
        reference, other = one_process[name], assemble([results[i] for results in ranks])
        for key in ("before", "after"):
            assert (other[key] - reference[key])[valid()].abs().max() <= 1e-5, (name, key)
        assert other["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5), name
        assert torch.equal(other["counts"], reference["counts"]), name


@pytest.fixture(scope="module")
def engine_runs(tmp_path_factory):
    """A tiny DeepSeek-V3: the engine as loaded, and with its expert-selection bias moved by 2 x N(0, 1)."""
    path = str(build_tiny_hf_model(tmp_path_factory.mktemp("deepseek_v3"), "deepseek_v3", layers=LAYERS, seed=5))
    (results,) = run_on_ranks(engines_and_trainer, world_size=1, args=(path, [0.0, 2.0]))
    return results


def test_the_megatron_engine_records_the_routing_the_trainer_would_choose(engine_runs):
    """Same weights: the engine's KV-cached routing of every fed token equals the trainer's full forward's."""
    from mrl.model.router_replay import no_route

    r = engine_runs[0]
    fed = int((r["lengths"] - 1).sum())
    assert r["routing"].shape[2:] == (LAYERS, TOPK)
    assert r["routing"].dtype == torch.uint8  # the tiny model's routed experts fit a byte with room for the mark
    assert (r["routing"][:, :, 0] == no_route(torch.uint8)).all()  # DeepSeek-V3's first layer is dense
    assert r["measured"]["counts"].tolist() == [[0.0, 0.0], [0.0, float(fed)]]
    tokens = r["mask"] > 0
    assert (r["fresh"]["logprobs"] - r["gen"])[tokens].abs().max() <= 1e-4


def test_the_dynamic_engine_records_the_routing_the_trainer_would_choose(model_dir):
    """Megatron's dynamic engine (in-flight batching: one flat forward of every request's new tokens) on Qwen3-MoE:
    each fed token's routing lands at its own row and position, where the trainer's full forward chooses the same
    experts (the replay itself is the loop's business, checked above)."""
    (results,) = run_on_ranks(engines_and_trainer, world_size=1, args=(model_dir, [0.0], "dynamic"))
    r = results[0]
    fed = int((r["lengths"] - 1).sum())
    assert r["routing"].shape[2:] == (LAYERS, TOPK) and r["routing"].dtype == torch.uint8
    assert r["measured"]["counts"].tolist() == [[0.0] * LAYERS, [float(fed)] * LAYERS]  # every fed token, agreeing
    tokens = r["mask"] > 0
    assert (r["fresh"]["logprobs"] - r["gen"])[tokens].abs().max() <= 1e-4


def test_replay_brings_the_trainer_back_to_the_engine_s_choices_and_logprobs(engine_runs):
    from mrl.objectives.mismatch import mismatch_metrics

    r = engine_runs[1]
    tokens = r["mask"] > 0
    differs, known = r["measured"]["counts"][:, 1].tolist()
    assert differs > 0.2 * known  # the moved bias sends a share of the tokens elsewhere (measured: 76 of 80)
    assert torch.equal(r["measured"]["counts"], r["replayed"]["counts"])  # replay measures what it replaces
    fresh = (r["fresh"]["logprobs"] - r["gen"])[tokens].abs().max()
    replayed = (r["replayed"]["logprobs"] - r["gen"])[tokens].abs().max()
    assert fresh > 1e-2 and replayed <= 1e-4, (fresh, replayed)
    # the run's mismatch metric: well above 1 without replay (measured 1.21), at the dense models' level with it
    error = {name: mismatch_metrics(r["gen"], r[name]["logprobs"], r["mask"])["token_mult_prob_error"]
             for name in ("fresh", "replayed")}
    same_weights = mismatch_metrics(engine_runs[0]["gen"], engine_runs[0]["fresh"]["logprobs"], engine_runs[0]["mask"])
    assert error["fresh"] > 1.05 and error["replayed"] <= 1.0001, error
    assert error["replayed"] <= same_weights["token_mult_prob_error"] + 1e-6
    assert torch.equal(r["measured"]["logprobs"], r["fresh"]["logprobs"])  # measuring alone changes nothing
