"""Megatron train step and logprobs: equal to HF transformers, and the same under every parallel layout."""

from __future__ import annotations

import pytest
import torch

from mrl.testing.distributed import run_on_ranks
from mrl.testing.losses import PGLoss
from mrl.testing.tiny_models import build_tiny_hf_model


# ---- rank side: imported by each rank process of run_on_ranks ----


def make_batch(n: int = 8, t: int = 16, vocab: int = 200, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (n, t), generator=g)
    mask = torch.zeros(n, t)
    for i in range(n):
        mask[i, 3: 5 + i] = 1  # responses of different lengths
    adv = torch.randn(n, generator=g)[:, None].expand(n, t).contiguous()
    return ids, mask, adv


def run(model_dir: str, tp: int = 1, pp: int = 1, steps: int = 3, micro_batch_size: int = 4, level: str = "token",
        distributed_optimizer: bool = False):
    """Logprobs before training, per-step losses, logprobs after training; gathered on the last stage."""
    import json
    from pathlib import Path

    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from safetensors.torch import load_file

    from mrl.config.schema import OptimizerConfig, SchedulerConfig
    from mrl.parallel.layout import ParallelDims
    from mrl.parallel.groups import init_process_groups
    from mrl.model.build import build_model, load_hf_weights, transformer_config_from_hf
    from mrl.policy.optim import build_optimizer, build_scheduler
    from mrl.policy.interface import RankBatch, global_count
    from mrl.policy.train_step import StepContext, logprobs_of_batch, train_on_batch

    world = int(__import__("os").environ["WORLD_SIZE"])
    init_process_groups(ParallelDims(tp=tp, pp=pp, world_size=world))
    hf_config = json.loads((Path(model_dir) / "config.json").read_text())
    cfg = transformer_config_from_hf(hf_config, tensor_parallel=tp, pipeline_parallel=pp)
    model = build_model(hf_config, cfg)
    load_hf_weights(model, load_file(str(Path(model_dir) / "model.safetensors")), hf_config)
    model = DistributedDataParallel(cfg, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=distributed_optimizer), module=model)
    cfg.finalize_model_grads_func = finalize_model_grads
    opt_cfg = OptimizerConfig(lr=1e-3, weight_decay=0.0, use_distributed_optimizer=distributed_optimizer)
    optimizer = build_optimizer([model], opt_cfg, params_dtype=torch.float32)
    scheduler = build_scheduler(optimizer, opt_cfg, SchedulerConfig(), total_steps=steps)

    ids, mask, adv = make_batch()
    count = global_count(mask, level)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    rows = slice(dp_rank * len(ids) // dp, (dp_rank + 1) * len(ids) // dp)  # this DP rank's shard
    batch = RankBatch(ids[rows], mask[rows], token_data={"adv": adv[rows]})
    ctx = StepContext(dp_size=dp, cp_rank=0, cp_size=1, cp_group=ps.get_context_parallel_group(),
                      is_last_stage=ps.is_pipeline_last_stage(), vocab_size=hf_config["vocab_size"])
    before = logprobs_of_batch([model], batch, micro_batch_size=micro_batch_size, ctx=ctx)
    losses, entropy_sums = [], []
    for _ in range(steps):
        metrics = train_on_batch([model], optimizer, scheduler, batch, loss_fn=PGLoss(level), count=count,
                                 micro_batch_size=micro_batch_size, ctx=ctx)
        loss = torch.tensor(metrics.get("loss", 0.0), dtype=torch.float64)
        dist.all_reduce(loss, group=ps.get_data_parallel_group())  # each DP rank holds its share of the sum
        losses.append(float(loss))
        entropy_sums.append(metrics.get("entropy_sum"))
    after = logprobs_of_batch([model], batch, micro_batch_size=micro_batch_size, ctx=ctx)
    if not ps.is_pipeline_last_stage():
        return None
    gathered = [None] * dp
    dist.all_gather_object(gathered, (before, after), group=ps.get_data_parallel_group())
    return {"before": torch.cat([g[0] for g in gathered]), "after": torch.cat([g[1] for g in gathered]),
            "losses": losses, "entropy_sums": entropy_sums}


# ---- tests ----
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_hf_model(tmp_path_factory.mktemp("qwen2"), "qwen2", num_kv_heads=2, seed=3))


@pytest.fixture(scope="module")
def reference(model_dir):
    (result,) = run_on_ranks(run, world_size=1, args=(model_dir,))
    return result


def last(results):
    return [r for r in results if r is not None][-1]


def test_logprobs_equal_hf_transformers(model_dir, reference):
    from transformers import AutoModelForCausalLM

    ids, _, _ = make_batch()
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(ids).logits.float()
    expected = torch.zeros_like(ids, dtype=torch.float32)
    expected[:, 1:] = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    assert (reference["before"] - expected).abs().max() <= 1e-5


def test_the_train_step_reports_the_entropy_of_hf_transformers_distributions(model_dir, reference):
    from transformers import AutoModelForCausalLM

    ids, mask, _ = make_batch()
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logprobs = torch.log_softmax(hf(ids).logits.float(), dim=-1)
    entropy = -(logprobs.exp() * logprobs).sum(dim=-1)  # [n, T]: of the distribution of the token after t
    expected = float((entropy[:, :-1] * mask[:, 1:]).sum())  # each response token's own distribution
    assert reference["entropy_sums"][0] == pytest.approx(expected, rel=1e-5)  # the first step's forward: before it


def test_training_changes_the_policy_in_the_advantage_direction(reference):
    ids, mask, adv = make_batch()
    gain = ((reference["after"] - reference["before"]) * mask).sum(dim=1)
    # sequences with positive advantage became more likely, negative ones less likely
    assert torch.all(torch.sign(gain[adv[:, 0].abs() > 0.3]) == torch.sign(adv[adv[:, 0].abs() > 0.3, 0]))
    assert reference["losses"][0] != reference["losses"][-1]


@pytest.mark.parametrize("layout", [dict(tp=2), dict(pp=2), dict(tp=1), dict(tp=1, distributed_optimizer=True)],
                         ids=["tp2", "pp2", "dp2", "dp2-distopt"])
def test_parallel_layouts_match_single_process(model_dir, reference, layout):
    got = last(run_on_ranks(run, world_size=2, args=(model_dir,), kwargs=layout))
    assert (got["before"] - reference["before"]).abs().max() <= 1e-5
    assert got["losses"] == pytest.approx(reference["losses"], abs=1e-5)
    # After Adam steps, fp32 reduction-order noise on near-zero gradients is amplified by g / sqrt(v): the
    # weights agree to ~1e-4, not 1e-5 (see the closing note of the policy issue).
    assert (got["after"] - reference["after"]).abs().max() <= 2e-4


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_micro_batching_does_not_change_the_step(model_dir, level):
    runs = [run_on_ranks(run, world_size=1, args=(model_dir,), kwargs=dict(micro_batch_size=m, level=level, steps=1))[0]
            for m in (8, 4, 2)]
    for other in runs[1:]:
        assert other["losses"] == pytest.approx(runs[0]["losses"], abs=1e-6)
        # logprobs after one Adam step: summation order differs per split (fp32 noise ~1e-6 after Adam)
        assert (other["after"] - runs[0]["after"]).abs().max() <= 5e-6
