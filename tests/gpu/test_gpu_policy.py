"""The Megatron policy on CUDA (one rank, NCCL process groups, the local or Transformer Engine layer spec, whichever
imports): its logprobs equal HF transformers' on the same device, and one optimizer step moves them like plain
torch AdamW moves HF's, in fp32 and in bf16 (bf16 parameters, fp32 master weights in Megatron's optimizer)."""

from __future__ import annotations

import pytest
import torch

from mrl.testing.distributed import run_on_ranks
from mrl.testing.tiny_models import build_tiny_hf_model

#: max |logprob difference| allowed: fp32 kernels differ in summation order only. bf16 rounds every activation:
#: mrl's error against HF in fp32 may be BF16_RATIO times HF bf16's own, plus BF16_FLOOR nats.
TOLERANCE = {"float32": 1e-4}
BF16_RATIO, BF16_FLOOR = 2.0, 0.02


def _mask() -> torch.Tensor:
    mask = torch.zeros(8, 24)
    mask[:, 6:20] = 1
    return mask


def _batch(vocab: int):
    g = torch.Generator().manual_seed(0)
    return torch.randint(2, vocab, (8, 24), generator=g), _mask()


def policy_side(model_dir: str, precision: str) -> dict:
    """Rank side: logprobs, one NLL step, logprobs again, all from mrl's PolicyWorker on this rank's GPU."""
    from mrl.config.schema import OptimizerConfig, PolicyConfig
    from mrl.objectives.loss import NLLLoss
    from mrl.policy.interface import RankBatch
    from mrl.policy.worker import PolicySpec, PolicyWorker

    cfg = PolicyConfig(precision=precision, train_micro_batch_size=8, train_global_batch_size=8,
                       logprob_micro_batch_size=8, optimizer=OptimizerConfig(lr=1e-3, weight_decay=0.0))
    worker = PolicyWorker(PolicySpec(model_dir, cfg, seed=0, total_steps=1))
    ids, mask = _batch(worker.model_dims.vocab_size)
    batch = RankBatch(ids, mask)
    before = worker.logprobs(batch)
    metrics = worker.train(batch, NLLLoss(), float(mask[:, 1:].sum()))
    return {"before": before, "after": worker.logprobs(batch), "loss": metrics["loss"],
            "device": str(next(worker.module.parameters()).device),
            "dtype": str(next(worker.module.parameters()).dtype)}


def hf_side(model_dir: str, precision: str) -> dict:
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, precision)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda()
    master = [p.detach().clone() for p in model.parameters()]  # fp32 master weights, like Megatron's optimizer
    model = model.to(dtype)
    ids, mask = _batch(model.config.vocab_size)
    ids, mask = ids.cuda(), mask.cuda()

    def logprobs() -> torch.Tensor:
        logits = model(ids).logits.float()[:, :-1]
        out = torch.zeros(ids.shape, device=ids.device)
        out[:, 1:] = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
        return out * mask

    before = logprobs()
    loss = -(before * mask).sum() / mask[:, 1:].sum()
    loss.backward()
    params = list(model.parameters())
    grads = [p.grad.float() for p in params]
    norm = torch.sqrt(sum((g * g).sum() for g in grads))
    grads = [g * min(1.0, 1.0 / (float(norm) + 1e-6)) for g in grads]  # clip_grad 1.0
    optimizer = torch.optim.AdamW([torch.nn.Parameter(m) for m in master], lr=1e-3, weight_decay=0.0)
    for m, g in zip(optimizer.param_groups[0]["params"], grads):
        m.grad = g
    optimizer.step()
    with torch.no_grad():
        for p, m in zip(params, optimizer.param_groups[0]["params"]):
            p.copy_(m.to(dtype))
        after = logprobs()
    return {"before": before.cpu(), "after": after.cpu(), "loss": float(loss)}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_hf_model(tmp_path_factory.mktemp("gpu-policy"), hidden=128, layers=2, heads=4,
                                   intermediate=256))


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_policy_on_cuda_equals_hf_before_and_after_a_step(model_dir, precision, figure):
    """fp32: mrl equals HF to summation order. bf16: both round differently (HF's norms and attention against
    Megatron's local spec), so each is compared with HF in fp32: mrl's bf16 error may be at most twice HF's own."""
    mrl = run_on_ranks(policy_side, 1, args=(model_dir, precision), timeout_s=600)[0]
    hf = hf_side(model_dir, precision)
    ref = hf if precision == "float32" else hf_side(model_dir, "float32")
    mask = _mask()  # HF's logprobs come masked; mrl's come for every token
    mrl["before"], mrl["after"] = mrl["before"] * mask, mrl["after"] * mask
    assert mrl["device"].startswith("cuda") and mrl["dtype"] == f"torch.{precision}"
    moved = (hf["after"] - hf["before"]).abs().max().item()
    for when in ("before", "after"):
        error = (mrl[when] - ref[when]).abs().max().item()
        allowed = TOLERANCE["float32"] if precision == "float32" else BF16_RATIO * (
            hf[when] - ref[when]).abs().max().item() + BF16_FLOOR
        figure(f"policy.{precision}.max_logprob_error_{when}_step", error, "nats", allowed=allowed,
               reference="HF transformers in fp32", hf_same_precision_error=(hf[when] - ref[when]).abs().max().item())
        assert error <= allowed, f"{precision} {when} the step: mrl is {error:.3g} nats off HF fp32, allowed {allowed:.3g}"
    assert moved > 0.1  # the step moved the logprobs far more than the tolerances
    loss_allowed = TOLERANCE["float32"] if precision == "float32" else BF16_RATIO * abs(hf["loss"] - ref["loss"]) + 1e-2
    figure(f"policy.{precision}.loss_error", abs(mrl["loss"] - ref["loss"]), "nats", allowed=loss_allowed)
    assert abs(mrl["loss"] - ref["loss"]) <= loss_allowed
