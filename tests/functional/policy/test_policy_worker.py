"""One policy rank in a process of its own: activation recomputation changes nothing but memory, and the learning
rate follows warm-up + cosine decay exactly as computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from mrl.testing.distributed import run_on_ranks
from mrl.testing.tiny_models import build_tiny_hf_model


# ---- rank side ----
def train_steps(model_dir: str, steps: int, recompute: bool, scheduler: dict) -> dict:
    from mrl.objectives.loss import GRPOLoss
    from mrl.config.schema import OptimizerConfig, PolicyConfig, SchedulerConfig
    from mrl.policy.interface import RankBatch
    from mrl.policy.worker import PolicySpec, PolicyWorker

    cfg = PolicyConfig(precision="float32", activation_checkpointing=recompute, train_micro_batch_size=4,
                       optimizer=OptimizerConfig(lr=1e-2, weight_decay=0.0), scheduler=SchedulerConfig(**scheduler))
    worker = PolicyWorker(PolicySpec(model_dir, cfg, seed=0, total_steps=steps))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 200, (8, 12), generator=g)
    mask = torch.zeros(8, 12)
    mask[:, 5:] = 1
    batch = RankBatch(ids, mask, {"advantages": torch.randn(8, generator=g)[:, None].expand(8, 12).contiguous()})
    metrics = [worker.train(batch, GRPOLoss(), float(mask[:, 1:].sum())) for _ in range(steps)]
    return {"loss": [m["loss"] for m in metrics], "lr": [m["lr"] for m in metrics],
            "logprobs": worker.logprobs(batch)}


# ---- tests ----
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_hf_model(tmp_path_factory.mktemp("worker"), seed=5))


def test_activation_recomputation_gives_the_same_steps(model_dir):
    schedule = {"style": "constant"}
    plain = run_on_ranks(train_steps, 1, args=(model_dir, 3, False, schedule))[0]
    recomputed = run_on_ranks(train_steps, 1, args=(model_dir, 3, True, schedule))[0]
    assert recomputed["loss"] == plain["loss"]
    assert torch.equal(recomputed["logprobs"], plain["logprobs"])


def test_warmup_then_cosine_learning_rates(model_dir):
    got = run_on_ranks(train_steps, 1, args=(model_dir, 6, False, {"style": "cosine", "warmup_steps": 2}))[0]
    peak, warmup, decay = 1e-2, 2, 6  # decay_steps defaults to the run's 6 steps
    expected = []
    for done in range(6):  # step k uses the rate after k - 1 completed steps
        if done <= warmup:
            expected.append(peak * done / warmup)
        else:
            expected.append(0.5 * (math.cos(math.pi * (done - warmup) / (decay - warmup)) + 1) * peak)
    assert got["lr"] == pytest.approx(expected, abs=1e-12)
