"""Sequence packing and dynamic batching in the policy's train step and logprobs.

The reference is always the same model run on the same batch with fixed-size padded micro-batches: packed (THD,
block-diagonal attention, RoPE restarting per sequence) and dynamically batched runs must give the same logprobs and,
after three Adam steps, the same weights, token- and sequence-level, under TP, TP+SP, CP and PP.
"""

from __future__ import annotations

import pytest
import torch

from mrl.testing.batches import long_tail_batch
from mrl.testing.distributed import run_on_ranks
from mrl.testing.losses import PGLoss
from mrl.testing.tiny_models import build_tiny_hf_model

# Long-tail lengths (prompt + response) in a [8, 24] right-padded batch; the prompt is the first 3 tokens.
LENGTHS = [24, 5, 9, 13, 3, 17, 7, 11]
WIDTH, PROMPT = 24, 3


# ---- rank side: imported by each rank process of run_on_ranks ----


def make_batch():
    """ids [8, 24] (pad id 0 past each length), loss mask on the response tokens, per-sequence advantages."""
    return long_tail_batch(LENGTHS, WIDTH, PROMPT)


def _build(model_dir: str, tp: int, pp: int, cp: int, sp: bool):
    from mrl.testing.megatron import trainable_from_hf

    return trainable_from_hf(model_dir, total_steps=3, tensor_parallel=tp, pipeline_parallel=pp, context_parallel=cp,
                             sequence_parallel=sp)


def _sum_over_context_parallel(metrics: dict) -> dict:
    """A CP rank's loss, counts and clip fraction are its share of the sequences' tokens (split differently when
    packed): sum."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    keys = [k for k in ("loss", "tokens", "clip_fraction") if k in metrics]
    values = torch.tensor([metrics[k] for k in keys], dtype=torch.float64)
    if keys and ps.get_context_parallel_world_size() > 1:
        dist.all_reduce(values, group=ps.get_context_parallel_group())
    return {**metrics, **dict(zip(keys, values.tolist()))}


def _gspo_batch(batch, before):
    """GSPO's batch: advantages and pi_old = the model's logprobs before training, moved by fixed noise (so the
    sequence ratios differ from 1, some inside GSPO_TEST_CLIP and some outside)."""
    from mrl.policy.interface import RankBatch

    noise = 0.3 * torch.randn(batch.input_ids.shape, generator=torch.Generator().manual_seed(5))
    prev = ((before if before is not None else torch.zeros_like(noise)) + noise) * batch.loss_mask
    return RankBatch(batch.input_ids, batch.loss_mask, token_data={"advantages": batch.token_data["adv"],
                                                                   "prev_logprobs": prev}, lengths=batch.lengths)


GSPO_TEST_CLIP = 0.1


def run(model_dir: str, modes: list, tp: int = 1, pp: int = 1, cp: int = 1, sp: bool = False, level: str = "token",
        steps: int = 3, gspo: bool = False):
    """For each mode (None = fixed micro-batches of 4 rows, ("packing" | "dynamic", budget)): logprobs before
    training, per-step losses and token counts, and this rank's weights after `steps` steps. `gspo`: mrl's GRPO
    loss with the sequence-level ratio (level sequence) instead of the plain policy gradient."""
    import os

    from megatron.core import parallel_state as ps

    from mrl.config.schema import DynamicBatchingConfig, PackingConfig
    from mrl.parallel.groups import init_process_groups
    from mrl.parallel.layout import ParallelDims
    from mrl.policy.interface import RankBatch, global_count
    from mrl.policy.train_step import StepContext, logprobs_of_batch, train_on_batch

    world = int(os.environ["WORLD_SIZE"])
    init_process_groups(ParallelDims(tp=tp, pp=pp, cp=cp, sequence_parallel=sp, world_size=world))
    ids, mask, adv = make_batch()
    batch = RankBatch(ids, mask, token_data={"adv": adv}, lengths=torch.tensor(LENGTHS))
    results = []
    for mode in modes:
        model, optimizer, scheduler, hf_config = _build(model_dir, tp, pp, cp, sp)
        ctx = StepContext(dp_size=1, cp_rank=ps.get_context_parallel_rank(), cp_size=cp,
                          cp_group=ps.get_context_parallel_group(), is_last_stage=ps.is_pipeline_last_stage(),
                          vocab_size=hf_config["vocab_size"])
        kind, tokens, logprob_tokens = (*mode, None)[:3] if mode else (None, 0, None)  # (kind, budget[, logprob's])
        sizes = dict(enabled=True, tokens_per_microbatch=tokens, logprob_tokens_per_microbatch=logprob_tokens)
        budget = dict(packing=PackingConfig(**sizes) if kind == "packing" else None,
                      dynamic_batching=DynamicBatchingConfig(**sizes) if kind == "dynamic" else None)
        before = logprobs_of_batch([model], batch, micro_batch_size=4, ctx=ctx, **budget)
        loss_fn, step_batch = PGLoss(level), batch
        if gspo:
            from mrl.objectives.loss import GRPOLoss

            level = "sequence"
            loss_fn = GRPOLoss(level=level, ratio_level="sequence", clip_low=GSPO_TEST_CLIP, clip_high=GSPO_TEST_CLIP)
            step_batch = _gspo_batch(batch, logprobs_of_batch([model], batch, micro_batch_size=4, ctx=ctx))
        metrics = [_sum_over_context_parallel(train_on_batch(
            [model], optimizer, scheduler, step_batch, loss_fn=loss_fn, count=global_count(mask, level),
            micro_batch_size=4, ctx=ctx, **budget)) for _ in range(steps)]
        weights = {k: v.detach().clone() for k, v in model.module.named_parameters()}
        results.append({"before": before, "metrics": metrics, "weights": weights})
    return results


# ---- tests ----
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_hf_model(tmp_path_factory.mktemp("qwen2"), "qwen2", num_kv_heads=2, seed=3))


#: Three Adam steps of lr 1e-3 (`trainable_from_hf`) move a weight by at most ~3e-3. Another grouping of the same
#: sums (micro-batches, packs) changes the gradients at float32 rounding, and Adam's normalisation passes that on in
#: full where a gradient component is near zero: the weights must agree to 1% of the largest move.
WEIGHT_TOLERANCE = 0.01 * 3 * 1e-3


def valid_positions() -> torch.Tensor:
    """[8, 24] True where a token exists (packed runs compute nothing past a sequence's length)."""
    return torch.arange(WIDTH)[None, :] < torch.tensor(LENGTHS)[:, None]


def assert_same_step(reference: dict, other: dict) -> None:
    """Logprobs before training equal where tokens exist (0 past lengths), same losses, same weights after."""
    if reference["before"] is not None:  # last pipeline stage
        valid = valid_positions()
        assert (other["before"] - reference["before"])[valid].abs().max() <= 1e-5
        assert torch.all(other["before"][~valid] == 0)
        assert [m["loss"] for m in other["metrics"]] == pytest.approx([m["loss"] for m in reference["metrics"]],
                                                                      abs=1e-6)
        assert [m["tokens"] for m in other["metrics"]] == [m["tokens"] for m in reference["metrics"]]
    assert reference["weights"].keys() == other["weights"].keys()
    for name, weight in reference["weights"].items():
        assert (other["weights"][name] - weight).abs().max() <= WEIGHT_TOLERANCE, name


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_packing_and_dynamic_batching_give_the_same_step_as_padded_micro_batches(model_dir, level):
    modes = [None, ("packing", 32), ("dynamic", 48), ("packing", 32, 96), ("dynamic", 48, 96)]
    reference, packed, dynamic, *logprob_budgets = run_on_ranks(
        run, world_size=1, args=(model_dir, modes), kwargs=dict(level=level))[0]
    assert_same_step(reference, packed)
    assert_same_step(reference, dynamic)
    for result in logprob_budgets:  # logprob passes in micro-batches of their own budget
        assert_same_step(reference, result)
    # the step really did change the weights (a no-op would pass the comparisons above)
    assert reference["metrics"][0]["loss"] != reference["metrics"][-1]["loss"]
    # packing efficiency = real / computed tokens (89 real): 2 x [4, 24] padded; packs hold exactly the sequences
    # (no rounding at TP1/CP1, no filler without PP); dynamic, lengths sorted and cut at rows * longest <= 48:
    # [24, 17] -> 2 x 24, [13, 11, 9] -> 3 x 13, [7, 5, 3] -> 3 x 7
    counts = [(r["metrics"][0]["packing_real_tokens"], r["metrics"][0]["packing_computed_tokens"])
              for r in (reference, packed, dynamic)]
    assert counts == [(89, 2 * 4 * 24), (89, 89), (89, 48 + 39 + 21)]


@pytest.mark.parametrize("layout", [dict(tp=2), dict(tp=2, sp=True), dict(cp=2), dict(pp=2)],
                         ids=["tp2", "tp2-sp", "cp2", "pp2"])
def test_packing_under_parallel_layouts(model_dir, layout):
    # with pipeline stages every pack has its budget's shape: a logprob pass's budget gives packs of another shape
    modes = [None, ("packing", 32)] + ([("packing", 32, 64)] if "pp" in layout else [])
    for reference, *packed in run_on_ranks(run, world_size=2, args=(model_dir, modes), kwargs=layout):
        for result in packed:
            assert_same_step(reference, result)


def test_gspo_under_context_parallelism_and_packing_equals_one_rank(model_dir):
    """GSPO's ratio is a whole sequence's: at CP2 each rank holds half of every sequence, and the train step sums
    the halves' log-ratios over the CP group (`_whole_sequence_log_ratio`). Padded and packed CP2 steps equal the
    one-rank padded step: losses, and weights after three steps."""
    (reference,) = run_on_ranks(run, world_size=1, args=(model_dir, [None]), kwargs=dict(gspo=True))[0]
    for padded, packed in run_on_ranks(run, world_size=2, args=(model_dir, [None, ("packing", 32)]),
                                       kwargs=dict(cp=2, gspo=True)):
        for other in (padded, packed):
            for key in ("loss", "grad_norm"):
                assert [m[key] for m in other["metrics"]] == pytest.approx(
                    [m[key] for m in reference["metrics"]], abs=1e-6, rel=1e-6), key
            for name, weight in reference["weights"].items():
                assert (other["weights"][name] - weight).abs().max() <= WEIGHT_TOLERANCE, name
    # the first step has sequences inside the clip range and outside (both branches); it moves every ratio out of
    # the range, so the later steps' gradients are 0 and Adam's momentum alone moves the weights
    assert 0 < reference["metrics"][0]["clip_fraction"] < 1 and reference["metrics"][0]["grad_norm"] > 1
    assert reference["metrics"][0]["loss"] != reference["metrics"][-1]["loss"]
