"""Router replay on CUDA (mrl/model/router_replay.py) through the policy worker: a tiny Qwen3-MoE in fp32, its batch
moved to the GPU with the routing. Replaying the trainer's own choices changes no logprob; random expert sets move
the logprobs and are measured as disagreeing on ~27/28 of the tokens; a train step replaying them with activation
recomputation (layers re-run in the backward, their targets from the queue) equals the step without recomputation."""

from __future__ import annotations

import torch

from mrl.testing.batches import long_tail_batch
from mrl.testing.distributed import run_on_ranks
from mrl.testing.tiny_models import build_tiny_hf_model

LENGTHS, WIDTH, LAYERS, EXPERTS, TOPK = [32, 9, 17, 25, 5, 30, 12, 20], 32, 2, 8, 2


def replay_on_device(model_dir: str, recompute: bool) -> dict:
    """Rank side: logprobs without routing, with the recorded own routing, with random routing; then one train
    step with the random routing replayed: its metrics and the logprobs after it."""
    from mrl.config.schema import MoEConfig, OptimizerConfig, PolicyConfig
    from mrl.model.router_replay import no_route, routing_dtype
    from mrl.policy.interface import RankBatch
    from mrl.policy.worker import PolicySpec, PolicyWorker
    from mrl.testing.losses import PGLoss

    cfg = PolicyConfig(precision="float32", train_micro_batch_size=4, train_global_batch_size=8,
                       logprob_micro_batch_size=8, activation_checkpointing=recompute,
                       moe=MoEConfig(router_replay="replay"), optimizer=OptimizerConfig(lr=1e-3, weight_decay=0.0))
    worker = PolicyWorker(PolicySpec(model_dir, cfg, seed=0, total_steps=1))
    ids, mask, adv = long_tail_batch(LENGTHS, WIDTH, prompt=3)
    lengths = torch.tensor(LENGTHS)
    beyond = torch.arange(WIDTH)[None, :] >= lengths[:, None]
    plain = RankBatch(ids, mask, token_data={"adv": adv}, lengths=lengths)
    out = {"device": str(next(worker.module.parameters()).device), "none": worker.logprobs(plain)}

    worker.routing.record = {}  # one micro-batch of 8 rows: the routers' rows are [T * 8] sequence-first
    worker.logprobs(plain)
    own = torch.stack([worker.routing.record[layer][0].view(WIDTH, len(ids), TOPK).transpose(0, 1).cpu()
                       for layer in range(LAYERS)], dim=2).to(torch.int16)
    worker.routing.record = None
    own[beyond] = -1
    out["own"] = worker.logprobs(RankBatch(ids, mask, token_data={"adv": adv}, lengths=lengths, routing=own))

    g = torch.Generator().manual_seed(1)  # kept as the rollouts keep it (uint8, 255 = none); the own routing: int16
    dtype = routing_dtype(EXPERTS)
    random = torch.rand(len(ids), WIDTH, LAYERS, EXPERTS, generator=g).argsort(dim=-1)[..., :TOPK].to(dtype)
    random[torch.arange(WIDTH)[None, :] >= lengths[:, None] - 1] = no_route(dtype)
    replayed = RankBatch(ids, mask, token_data={"adv": adv}, lengths=lengths, routing=random)
    worker.routing_counts()  # the own routing's pass counted (0 differ); the next pass with a routing counts again
    out["random"] = worker.logprobs(replayed)
    out["metrics"] = worker.train(replayed, PGLoss("token"), float(mask[:, 1:].sum()))
    out["after"] = worker.logprobs(replayed)
    return out


def test_router_replay_on_cuda(tmp_path, figure):
    model_dir = str(build_tiny_hf_model(tmp_path, "qwen3_moe", hidden=128, layers=LAYERS, heads=4, seed=5))
    kept = run_on_ranks(replay_on_device, 1, args=(model_dir, False), timeout_s=600)[0]
    recomputed = run_on_ranks(replay_on_device, 1, args=(model_dir, True), timeout_s=600)[0]
    assert kept["device"].startswith("cuda")
    valid = torch.arange(WIDTH)[None, :] < torch.tensor(LENGTHS)[:, None]
    own_error = float((kept["own"] - kept["none"]).abs().max())
    moved = float((kept["random"] - kept["none"])[valid].abs().max())
    differs = kept["metrics"]["moe_routing_differs_max"]
    step_error = float((recomputed["after"] - kept["after"])[valid].abs().max())
    figure("router_replay.own_routing_logprob_error", own_error, "nats")
    figure("router_replay.random_routing_moves_logprobs", moved, "nats")
    figure("router_replay.random_routing_differs", differs, "of tokens")
    figure("router_replay.recompute_vs_kept_after_step", step_error, "nats",
           grad_norms=[kept["metrics"]["grad_norm"], recomputed["metrics"]["grad_norm"]])
    assert own_error <= 1e-6
    assert moved > 0.05
    assert 0.85 < differs <= 1.0
    assert step_error <= 1e-5
    assert abs(recomputed["metrics"]["grad_norm"] - kept["metrics"]["grad_norm"]) <= 1e-5 * kept["metrics"]["grad_norm"]
