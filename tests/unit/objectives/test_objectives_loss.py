"""Loss functions against hand-computed values, and the global-normalisation property of the loss objects."""

import math

import pytest
import torch

from mrl.objectives.loss import GRPOLoss, NLLLoss, clipped_pg_loss, importance_weights, kl_penalty, local_count


def close(actual: torch.Tensor, expected, tol: float = 1e-5) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=torch.float32), rtol=tol, atol=tol)


# ------------------------------------------------------------------------------------------------------------ KL
def test_kl_estimators_by_hand_with_clamps():
    lp = torch.tensor([0.0, -1.0, -3.0, 30.0, -40.0])
    ref = torch.tensor([0.0, -2.0, -2.0, 0.0, 0.0])  # log-ratios 0, 1, -1, 30 -> 20, -40 -> -20
    close(kl_penalty(lp, ref, "k1"), [0.0, 1.0, -1.0, 10.0, -10.0])
    close(kl_penalty(lp, ref, "k2"), [0.0, 0.5, 0.5, 10.0, 10.0])
    close(kl_penalty(lp, ref, "k3"), [0.0, math.exp(-1) - 1 + 1, math.exp(1) - 1 - 1, 10.0, 10.0])
    with pytest.raises(ValueError, match="kl_kind"):
        kl_penalty(lp, ref, "k4")


# ------------------------------------------------------------------------------------------------ clipped PG loss
RATIOS = torch.tensor([[1.5, 0.5, 1.0], [1.1, 0.7, 2.0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
ADV = torch.tensor([1.0, -2.0])


def pg_inputs():
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -2.2]])
    lp = (old + RATIOS.log()).requires_grad_(True)
    return lp, old


def test_clipped_pg_token_and_sequence_levels():
    lp, old = pg_inputs()
    # row 0 (A=+1): r=1.5 -> clipped 1.2 -> -1.2; r=0.5 -> min(0.5, 0.8) = 0.5 -> -0.5; r=1 -> -1
    # row 1 (A=-2): r=1.1 -> min(-2.2, -2.2) -> 2.2; r=0.7 -> min(-1.4, 0.8 * -2 = -1.6) -> 1.6; third masked
    close(clipped_pg_loss(lp, old, ADV, MASK), (-1.2 - 0.5 - 1.0 + 2.2 + 1.6) / 5)
    close(clipped_pg_loss(lp, old, ADV, MASK, level="sequence"), ((-2.7 / 3) + (3.8 / 2)) / 2)
    # clip-higher: r=1.5 is now capped at 1.28
    close(clipped_pg_loss(lp, old, ADV, MASK, clip_high=0.28), (-1.28 - 0.5 - 1.0 + 2.2 + 1.6) / 5)
    # importance weights multiply each token's loss
    w = torch.tensor([[0.5, 1.0, 1.0], [1.0, 1.0, 7.0]])
    close(clipped_pg_loss(lp, old, ADV, MASK, is_weights=w), (-0.6 - 0.5 - 1.0 + 2.2 + 1.6) / 5)


def test_clipped_pg_gradient_is_zero_on_clipped_tokens():
    lp, old = pg_inputs()
    clipped_pg_loss(lp, old, ADV, MASK).backward()
    # d/dlp of -r*A is -r*A; clipped tokens (r=1.5, A>0) and (r=0.7, A<0) get 0; masked token gets 0.
    close(lp.grad, [[0.0, -0.5 / 5, -1.0 / 5], [2.2 / 5, 0.0, 0.0]])


def test_dual_clip_caps_negative_advantage_loss():
    old = torch.zeros(1, 2)
    lp = torch.tensor([[math.log(5.0), math.log(1.1)]])
    adv = torch.tensor([[-1.0, -1.0]])
    mask = torch.ones(1, 2)
    close(clipped_pg_loss(lp, old, adv, mask), (5.0 + 1.1) / 2)
    close(clipped_pg_loss(lp, old, adv, mask, dual_clip=3.0), (3.0 + 1.1) / 2)


def test_masked_garbage_never_reaches_loss_or_gradient():
    lp, old = pg_inputs()
    lp_bad = lp.detach().clone()
    lp_bad[1, 2] = float("inf")
    old_bad = old.clone()
    old_bad[1, 2] = float("nan")
    lp_bad.requires_grad_(True)
    loss = clipped_pg_loss(lp_bad, old_bad, ADV, MASK)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp_bad.grad).all()
    close(loss, clipped_pg_loss(lp.detach(), old, ADV, MASK))


# ----------------------------------------------------------------------------------------------- GRPO loss object
def one_row(lp, **extra):
    batch = {"loss_mask": torch.ones_like(lp), "advantages": torch.zeros(lp.shape[0])}
    batch.update(extra)
    return batch


def test_grpo_loss_kl_term():
    lp = torch.tensor([[-1.0, -2.0]])
    batch = one_row(lp, prev_logprobs=lp.clone(), ref_logprobs=torch.tensor([[-1.5, -1.0]]))  # x = [0.5, -1]
    loss, metrics = GRPOLoss(kl_beta=0.1, kl_kind="k1")(lp, batch, 2)
    close(loss, 0.1 * (0.5 - 1.0) / 2)
    k3 = ((math.exp(-0.5) - 1 + 0.5) + (math.exp(1.0) - 1 - 1.0)) / 2
    loss, metrics = GRPOLoss(kl_beta=0.1, kl_kind="k3")(lp, batch, 2)
    close(loss, 0.1 * k3)
    close(metrics["kl"], k3)
    with pytest.raises(KeyError, match="ref_logprobs"):
        GRPOLoss(kl_beta=0.1)(lp, one_row(lp), 2)


def test_grpo_loss_truncated_importance_sampling():
    old = torch.tensor([[-1.0, -1.0]])
    gen = old - torch.tensor([[math.log(3.0), math.log(0.5)]])  # exp(old - gen) = [3, 0.5]
    batch = one_row(old, prev_logprobs=old, generation_logprobs=gen, advantages=torch.tensor([1.0]))
    loss, metrics = GRPOLoss(importance_sampling="tis", is_cap=2.0)(old.clone(), batch, 2)
    close(loss, (-1.0 * 2.0 - 1.0 * 0.5) / 2)  # ratio 1, A = 1 -> pg = -1 per token, times [2, 0.5]
    close(metrics["is_weight_mean"], 1.25)
    close(metrics["is_modified_fraction"], 0.5)


def test_grpo_loss_icepop_masks_tokens_outside_the_band():
    old = torch.tensor([[-1.0, -1.0, -1.0]])
    gen = old - torch.tensor([[3.0, 0.5, 1.5]]).log()
    batch = one_row(old, prev_logprobs=old, generation_logprobs=gen, advantages=torch.tensor([1.0]))
    loss, metrics = GRPOLoss(importance_sampling="icepop", icepop_low=0.5, icepop_high=2.0)(old.clone(), batch, 3)
    close(loss, (0.0 - 0.5 - 1.5) / 3)
    close(metrics["is_modified_fraction"], 1.0 / 3)
    with pytest.raises(KeyError, match="generation_logprobs"):
        GRPOLoss(importance_sampling="tis")(old, one_row(old), 3)


def test_grpo_loss_mismatch_metrics():
    old = torch.tensor([[-1.0, -2.0, 0.0]])
    gen = old + torch.tensor([[0.1, -0.2, 5.0]])
    batch = one_row(old, prev_logprobs=old, generation_logprobs=gen, loss_mask=torch.tensor([[1.0, 1.0, 0.0]]))
    _, metrics = GRPOLoss()(old.clone(), batch, 2)
    close(metrics["token_mult_prob_error"], (math.exp(0.1) + math.exp(0.2)) / 2)
    close(metrics["gen_kl_error"], ((math.exp(-0.1) - 1 + 0.1) + (math.exp(0.2) - 1 - 0.2)) / 2)
    close(metrics["num_valid_tokens"], 2.0)


def test_grpo_loss_reports_the_entropy_the_train_step_adds_weighted_like_the_loss():
    old = torch.tensor([[-1.0, -2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    batch = one_row(old, loss_mask=mask, token_entropy=torch.tensor([[0.5, 1.5, 99.0]]))
    _, metrics = GRPOLoss()(old.clone(), batch, 2)
    close(metrics["entropy"], (0.5 + 1.5) / 2)  # the masked token's 99 is not counted
    assert "entropy" not in GRPOLoss()(old.clone(), one_row(old, loss_mask=mask), 2)[1]


def test_grpo_loss_without_prev_logprobs_is_on_policy():
    lp, _ = pg_inputs()
    batch = {"loss_mask": MASK, "advantages": ADV}
    loss, metrics = GRPOLoss()(lp, batch, local_count(MASK, "token"))
    loss.backward()
    # ratio == 1 everywhere: loss = -mean(A) over tokens; gradient = -A / N on each valid token
    close(loss, -(1.0 * 3 - 2.0 * 2) / 5)
    close(lp.grad, [[-0.2, -0.2, -0.2], [0.4, 0.4, 0.0]])
    close(metrics["clip_fraction"], 0.0)


def test_nll_loss_levels():
    lp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -4.0, -9.0]])
    mask = torch.tensor([[0, 1, 1], [1, 0, 0]])
    loss, metrics = NLLLoss()(lp, {"loss_mask": mask}, local_count(mask, "token"))
    close(loss, (2.0 + 3.0 + 0.5) / 3)
    loss, _ = NLLLoss(level="sequence")(lp, {"loss_mask": mask}, local_count(mask, "sequence"))
    close(loss, (2.5 + 0.5) / 2)


def test_invalid_settings_are_clear_errors():
    with pytest.raises(ValueError, match="loss.level"):
        GRPOLoss(level="batch")
    with pytest.raises(ValueError, match="dual_clip"):
        GRPOLoss(dual_clip=0.5)
    with pytest.raises(ValueError, match="icepop_low"):
        GRPOLoss(icepop_low=2.0, icepop_high=1.0)
    with pytest.raises(ValueError, match="importance_sampling"):
        importance_weights(torch.zeros(1), torch.zeros(1), "pop")


# ------------------------------------------------------------------- micro-batch splits never change the loss
def random_batch(seed: int, rows: int = 8, cols: int = 6) -> tuple[torch.Tensor, dict]:
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(rows, cols, generator=g) > 0.3).float()
    mask[3] = 0  # a sequence without any valid token
    old = -torch.rand(rows, cols, generator=g) * 3
    lp = old + 0.3 * torch.randn(rows, cols, generator=g)
    batch = {"loss_mask": mask, "advantages": torch.randn(rows, generator=g), "prev_logprobs": old,
             "generation_logprobs": old + 0.1 * torch.randn(rows, cols, generator=g),
             "ref_logprobs": old + 0.2 * torch.randn(rows, cols, generator=g)}
    return lp, batch


def run_split(loss_fn, lp: torch.Tensor, batch: dict, pieces: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    lp = lp.detach().clone().requires_grad_(True)
    count = local_count(batch["loss_mask"], loss_fn.level)
    total, metrics = torch.zeros(()), {}
    for idx in torch.arange(lp.shape[0]).chunk(pieces):
        part = {k: v[idx] for k, v in batch.items()}
        loss, m = loss_fn(lp[idx], part, count)
        total = total + loss
        for k, v in m.items():
            metrics[k] = metrics.get(k, 0.0) + v
    total.backward()
    return total.detach(), lp.grad, metrics


# ------------------------------------------------------------------------------------------------------------ GSPO
def test_gspo_by_hand():
    """Two sequences, clip 0.2: s_0 = exp((0.2 + 0) / 2) = exp(0.1), unclipped, A = 1; s_1 = exp(-0.3) < 0.8, A = -1,
    clipped (loss 0.8, no gradient). L = (-exp(0.1) + 0.8) / 2; d L / d lp_t = -exp(0.1) / (2 * 2) on sequence 0."""
    lp = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -0.5, -0.5]], requires_grad=True)
    batch = {"loss_mask": torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]), "advantages": torch.tensor([1.0, -1.0]),
             "prev_logprobs": torch.tensor([[-1.2, -2.0, 0.0], [-0.2, -0.2, -0.2]])}
    loss, metrics = GRPOLoss(level="sequence", ratio_level="sequence")(lp, batch, 2.0)
    loss.backward()
    close(loss, (-math.exp(0.1) + 0.8) / 2)
    close(lp.grad, [[-math.exp(0.1) / 4, -math.exp(0.1) / 4, 0.0], [0.0, 0.0, 0.0]])
    close(metrics["clip_fraction"], 0.5)  # sequence 1's tokens, weighted per sequence


def gspo_reference(lp, old, adv, mask, clip_low, clip_high):
    """GSPO as published (Zheng et al. 2025, eq. 5-7), in plain torch: s_i = (pi / pi_old)^(1 / |y_i|) with the
    gradient through the whole mean, J = mean_i min(s_i A_i, clip(s_i, 1 - eps_l, 1 + eps_h) A_i); loss = -J over
    the sequences with at least one token."""
    rows = [i for i in range(len(lp)) if mask[i].sum() > 0]
    terms = []
    for i in rows:
        keep = mask[i].bool()
        s = torch.exp((lp[i][keep] - old[i][keep]).mean())
        terms.append(torch.minimum(s * adv[i], s.clamp(1 - clip_low, 1 + clip_high) * adv[i]))
    return -torch.stack(terms).mean()


@pytest.mark.parametrize("clip", [(3e-4, 4e-4), (0.05, 0.05)], ids=["published-clip", "wide-clip"])
def test_gspo_equals_the_published_objective_in_plain_torch(clip):
    lp, batch = random_batch(seed=11, rows=8, cols=9)
    batch["prev_logprobs"] = batch["prev_logprobs"].clone()
    batch["prev_logprobs"][:4] = lp[:4] + 1e-4 * torch.randn(4, 9, generator=torch.Generator().manual_seed(1))
    ours_lp, ref_lp = lp.clone().requires_grad_(), lp.clone().requires_grad_()
    count = local_count(batch["loss_mask"], "sequence")
    loss, _ = GRPOLoss(level="sequence", ratio_level="sequence", clip_low=clip[0], clip_high=clip[1])(
        ours_lp, batch, count)
    expected = gspo_reference(ref_lp, batch["prev_logprobs"], batch["advantages"], batch["loss_mask"], *clip)
    loss.backward()
    expected.backward()
    torch.testing.assert_close(loss, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(ours_lp.grad, ref_lp.grad, atol=1e-6, rtol=0)
    assert ours_lp.grad.abs().sum() > 0  # some sequences are inside the clip range (the first four)


def test_gspo_split_along_time_with_whole_sequence_sums():
    """Context parallelism: a rank holds part of each sequence; with the whole sequence's log-ratio sum and token
    count (the train step's all-reduce), the parts' losses and gradients add up to the whole."""
    fn = GRPOLoss(level="sequence", ratio_level="sequence", clip_low=0.05, clip_high=0.05)
    lp, batch = random_batch(seed=5)
    batch["prev_logprobs"] = lp + 0.02 * torch.randn(lp.shape, generator=torch.Generator().manual_seed(2))
    full, full_grad, _ = run_split(fn, lp, batch, 1)
    count = local_count(batch["loss_mask"], "sequence")
    mask = batch["loss_mask"].bool()
    whole = {"seq_num_tokens": batch["loss_mask"].sum(dim=1),
             "seq_log_ratio_sum": torch.where(mask, lp - batch["prev_logprobs"], 0.0).sum(dim=1)}
    leaf = lp.clone().requires_grad_()
    total = torch.zeros(())
    for cols in torch.arange(lp.shape[1]).chunk(2):
        part = {k: (v[:, cols] if v.dim() == 2 else v) for k, v in batch.items()}
        total = total + fn(leaf[:, cols], {**part, **whole}, count)[0]
    total.backward()
    close(total, full)
    close(leaf.grad, full_grad)


def test_gspo_needs_sequence_level():
    from mrl.config.schema import LossConfig

    with pytest.raises(ValueError, match="needs loss.level=sequence"):
        GRPOLoss(ratio_level="sequence")
    with pytest.raises(ValueError, match="loss.level") as error:  # pydantic wraps the ConfigError here;
        LossConfig(ratio_level="sequence", level="token")  # load_config raises it as it is (tests/unit/config)
    assert "loss.clip_low=0.0003" in str(error.value)  # the fix names GSPO's published range


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_fn", [
    lambda level: GRPOLoss(level=level),
    lambda level: GRPOLoss(level=level, clip_high=0.28, dual_clip=3.0, kl_beta=0.05, importance_sampling="tis"),
    lambda level: GRPOLoss(level=level, kl_beta=0.1, kl_kind="k2", importance_sampling="icepop"),
    lambda level: NLLLoss(level=level),
    lambda level: GRPOLoss(level="sequence", ratio_level="sequence", clip_low=0.1, clip_high=0.1, kl_beta=0.05,
                           importance_sampling="tis") if level == "sequence" else None,
])
def test_sum_over_micro_batches_equals_full_batch_loss(level, loss_fn):
    fn = loss_fn(level)
    if fn is None:
        pytest.skip("GSPO is sequence level only")
    lp, batch = random_batch(seed=7)
    full_loss, full_grad, full_metrics = run_split(fn, lp, batch, 1)
    if isinstance(fn, GRPOLoss) and fn.kl_beta == 0 and fn.importance_sampling == "none":
        # independent reference: the standalone function over the whole batch
        close(full_loss, clipped_pg_loss(lp, batch["prev_logprobs"], batch["advantages"], batch["loss_mask"],
                                         level=level))
    for pieces in (2, 4):
        loss, grad, metrics = run_split(fn, lp, batch, pieces)
        close(loss, full_loss)
        close(grad, full_grad)
        for k in full_metrics:
            close(metrics[k], full_metrics[k])


def test_sequence_level_split_along_time_with_whole_sequence_counts():
    """Context parallelism gives a rank half of each sequence: seq_num_tokens keeps sequence level exact."""
    fn = GRPOLoss(level="sequence", kl_beta=0.1)
    lp, batch = random_batch(seed=3)
    full, _, _ = run_split(fn, lp, batch, 1)
    count = local_count(batch["loss_mask"], "sequence")
    seq_tokens = batch["loss_mask"].sum(dim=1)
    total = torch.zeros(())
    for cols in torch.arange(lp.shape[1]).chunk(2):
        part = {k: (v[:, cols] if v.dim() == 2 else v) for k, v in batch.items()}
        part["seq_num_tokens"] = seq_tokens
        total = total + fn(lp[:, cols], part, count)[0]
    close(total, full)


def test_the_loss_section_of_the_config_builds_the_grpo_loss():
    from dataclasses import fields

    from mrl.config.schema import LossConfig

    assert set(LossConfig.model_fields) == {f.name for f in fields(GRPOLoss)}
    loss = GRPOLoss(**LossConfig(kl_beta=0.1, level="sequence").model_dump())
    assert (loss.kl_beta, loss.level, loss.needs_reference) == (0.1, "sequence", True)
