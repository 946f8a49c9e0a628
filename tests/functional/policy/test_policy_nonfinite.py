"""A non-finite step changes nothing: the policy skips the update on every rank when one rank's loss is NaN.

Reference: the same model given only the clean step. Megatron's fp32 optimizer applies NaN gradients as they come
(FP32Optimizer.step always reports success), so without the guard in mrl/policy/train_step.py the poisoned step
turns every weight into NaN and both checks below fail.
"""

from __future__ import annotations

import pytest
import torch

from mrl.testing.distributed import run_on_ranks
from mrl.testing.losses import PGLoss
from mrl.testing.tiny_models import build_tiny_hf_model

pytestmark = pytest.mark.functional


# ---- rank side ----


def _batch(poison: bool):
    """This rank's shard of 4 rows; with `poison`, rank 1's advantages hold one NaN (its loss is NaN, rank 0's not)."""
    from megatron.core import parallel_state as ps

    from mrl.policy.interface import RankBatch

    g = torch.Generator().manual_seed(ps.get_data_parallel_rank())
    ids = torch.randint(2, 200, (4, 12), generator=g)
    mask = torch.zeros(4, 12)
    mask[:, 3:9] = 1
    adv = torch.randn(4, generator=g)[:, None].expand(4, 12).contiguous()
    if poison and ps.get_data_parallel_rank() == 1:
        adv[2, 5] = float("nan")
    return RankBatch(ids, mask, token_data={"adv": adv})


def steps_after(model_dir: str, poisoned_first: bool) -> dict:
    from megatron.core import parallel_state as ps

    from mrl.parallel.groups import init_process_groups
    from mrl.parallel.layout import ParallelDims
    from mrl.policy.train_step import StepContext, train_on_batch
    from mrl.testing.megatron import trainable_from_hf

    init_process_groups(ParallelDims(world_size=2))
    model, optimizer, scheduler, hf_config = trainable_from_hf(model_dir, total_steps=4)
    ctx = StepContext(dp_size=2, cp_rank=0, cp_size=1, cp_group=ps.get_context_parallel_group(),
                      is_last_stage=True, vocab_size=hf_config["vocab_size"])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    lr_before = optimizer.param_groups[0]["lr"]

    def step(poison: bool) -> dict:
        return train_on_batch([model], optimizer, scheduler, _batch(poison), loss_fn=PGLoss("token"), count=48.0,
                              micro_batch_size=2, ctx=ctx)

    out = {}
    if poisoned_first:
        skipped = step(poison=True)
        out["skipped"] = {k: skipped[k] for k in ("nonfinite", "grad_norm", "loss")}
        from mrl.policy.train_step import _gradients

        grads = list(_gradients([model]))  # DDP's buffers, which the guard reads: NaN on both ranks after the reduce
        out["gradients_read"] = sum(g.numel() for g in grads) >= sum(p.numel() for p in model.parameters())
        out["gradients_nonfinite"] = any(not bool(g.isfinite().all()) for g in grads)
        out["unchanged"] = all(torch.equal(before[n], p) for n, p in model.named_parameters())
        out["optimizer_state_empty"] = not any(optimizer.optimizer.state.values())  # Adam never stepped
        out["scheduler_steps"] = scheduler.num_steps
    clean = step(poison=False)
    out["clean_nonfinite"] = clean["nonfinite"]
    out["lr"] = (lr_before, optimizer.param_groups[0]["lr"])
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


# ---- test side ----


def test_a_nan_on_one_rank_skips_the_update_everywhere_and_the_next_step_is_as_if_it_never_happened(tmp_path):
    model_dir = build_tiny_hf_model(tmp_path / "hf", family="llama", seed=3)
    with_skip = run_on_ranks(steps_after, world_size=2, args=(str(model_dir), True), timeout_s=240)
    reference = run_on_ranks(steps_after, world_size=2, args=(str(model_dir), False), timeout_s=240)
    for rank, (got, want) in enumerate(zip(with_skip, reference)):
        skipped = got["skipped"]
        assert skipped["nonfinite"] == 1.0 and skipped["grad_norm"] != skipped["grad_norm"], (rank, skipped)
        assert got["unchanged"] and got["optimizer_state_empty"] and got["scheduler_steps"] == 0, rank
        assert got["gradients_read"] and got["gradients_nonfinite"], rank
        assert got["clean_nonfinite"] == 0.0 and got["lr"] == want["lr"], rank
        for name, value in want["params"].items():
            assert torch.isfinite(got["params"][name]).all(), (rank, name)
            assert torch.equal(got["params"][name], value), (rank, name)
    # rank 0's own loss was finite: only the all-reduced flag made it skip (its gradients came NaN through DDP too)
    assert with_skip[0]["skipped"]["loss"] == with_skip[0]["skipped"]["loss"]
