"""PPO's critic through the Megatron train step: a score head read at every token, trained with the clipped value
loss (mrl.objectives.ppo.ValueLoss).

References: the critic's values and its first step's gradients by plain torch on transformers'
`*ForSequenceClassification` (its decoder's hidden states through its score head at every position, the clipped
value loss written out here, autograd); then every layout against one process: TP2 with sequence parallelism, PP2,
CP2, DP2 and packed sequences give the same values before training, the same losses of 3 Adam steps, the same first
step's gradients (gathered to full tensors) and the same values after.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from mrl.testing.distributed import run_on_ranks
from mrl.testing.tiny_models import build_tiny_hf_model

pytestmark = pytest.mark.functional

SEQ_LEN, ROWS, CLIP, STEPS = 16, 8, 0.2, 3
ADAM_EPS = 1e-6  # as test_policy_layouts.py: Adam's eps gain on ~eps gradients would amplify fp32 order noise


# ---- rank side: imported by each rank process of run_on_ranks ----
def make_batch(vocab: int = 200, seed: int = 0):
    """ids, response mask (ragged, some crossing CP chunk borders), lengths, the rollout's values and returns."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (ROWS, SEQ_LEN), generator=g)
    mask = torch.zeros(ROWS, SEQ_LEN)
    for i in range(ROWS):
        mask[i, 3 : 5 + i] = 1
    lengths = torch.tensor([5 + i for i in range(ROWS)])
    old = torch.randn(ROWS, SEQ_LEN, generator=g) * 0.3 * mask
    returns = (old + torch.randn(ROWS, SEQ_LEN, generator=g) * 0.5) * mask
    return ids, mask, lengths, old, returns


def _layouts_module():
    """test_policy_layouts.py's full-tensor gather (TP shards joined, global layer names), loaded by its path."""
    spec = importlib.util.spec_from_file_location("policy_layouts", Path(__file__).with_name("test_policy_layouts.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(model_dir: str, tp: int = 1, pp: int = 1, cp: int = 1, sp: bool = False, packing: int | None = None):
    """Values before, per-step losses, the first step's full gradients (HF names, before clipping), values after;
    None on ranks that do not report (all but the last stage's TP-0 / CP-0 rank of each data-parallel rank)."""
    import os

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from converters import megatron_to_hf
    from mrl.config.schema import PackingConfig
    from mrl.objectives.ppo import OLD_VALUES, RETURNS, ValueLoss
    from mrl.parallel.groups import init_process_groups
    from mrl.parallel.layout import ParallelDims
    from mrl.policy.interface import RankBatch, global_count
    from mrl.policy.train_step import StepContext, logprobs_of_batch, train_on_batch
    from mrl.testing.megatron import trainable_from_hf

    init_process_groups(ParallelDims(tp=tp, pp=pp, cp=cp, sequence_parallel=sp,
                                     world_size=int(os.environ["WORLD_SIZE"])))
    model, optimizer, scheduler, hf_config = trainable_from_hf(
        model_dir, lr=1e-3, adam_eps=ADAM_EPS, total_steps=STEPS, tensor_parallel=tp, pipeline_parallel=pp,
        context_parallel=cp, sequence_parallel=sp)
    ids, mask, lengths, old, returns = make_batch()
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    rows = slice(dp_rank * ROWS // dp, (dp_rank + 1) * ROWS // dp)
    batch = RankBatch(ids[rows], mask[rows], {OLD_VALUES: old[rows], RETURNS: returns[rows]}, lengths=lengths[rows])
    ctx = StepContext(dp_size=dp, cp_rank=ps.get_context_parallel_rank(), cp_size=ps.get_context_parallel_world_size(),
                      cp_group=ps.get_context_parallel_group(), is_last_stage=ps.is_pipeline_last_stage(),
                      vocab_size=hf_config["vocab_size"], head="score")
    budget = PackingConfig(enabled=True, tokens_per_microbatch=packing) if packing else None
    layouts = _layouts_module()
    grads: dict = {}
    step = optimizer.step

    def step_and_capture():  # the first step's gradients as the backward left them (before the clip)
        if not grads:
            full = layouts.full_tensors(model.module, hf_config["vocab_size"], grads=True)
            full["output_layer.weight"] = full["output_layer.weight"][:1]  # row 0 is the score, the rest padding
            grads.update(dict(megatron_to_hf(full.items(), hf_config)))
        return step()

    optimizer.step = step_and_capture
    before = logprobs_of_batch([model], batch, micro_batch_size=2, ctx=ctx, packing=budget)
    losses = []
    for _ in range(STEPS):
        metrics = train_on_batch([model], optimizer, scheduler, batch, loss_fn=ValueLoss(CLIP),
                                 count=global_count(mask, "token"), micro_batch_size=2, ctx=ctx, packing=budget)
        loss = torch.tensor(metrics.get("loss", 0.0), dtype=torch.float64)
        dist.all_reduce(loss, group=ps.get_data_parallel_group(with_context_parallel=True))
        losses.append(float(loss))
    after = logprobs_of_batch([model], batch, micro_batch_size=2, ctx=ctx, packing=budget)
    if not (ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
            and ps.get_context_parallel_rank() == 0):
        return None
    return {"dp_rank": dp_rank, "before": before, "after": after, "losses": losses, "grads": grads}


def collect(results: list) -> dict:
    """The reporting ranks' results, values concatenated in data-parallel order."""
    reports = sorted((r for r in results if r is not None), key=lambda r: r["dp_rank"])
    return {**reports[0], **{k: torch.cat([r[k] for r in reports]) for k in ("before", "after")}}


# ---- the independent reference: plain torch on transformers ----
def hf_critic(model_dir: str):
    """Values at every position [N, T] and the first step's loss and gradients, by plain torch on the HF model."""
    from transformers import AutoModelForSequenceClassification

    ids, mask, lengths, old, returns = make_batch()
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32)
    values = torch.zeros(ROWS, SEQ_LEN)
    rows = []
    for i, n in enumerate(lengths.tolist()):  # unpadded rows: the value at position t reads tokens <= t
        row = model.score(model.model(ids[i : i + 1, :n]).last_hidden_state)[0, :, 0]
        rows.append(row)
        values[i, :n] = row.detach()
    # the value of the state before token t+1 is read at position t: the loss pairs position t with token t+1's data
    loss = torch.zeros(())
    count = mask[:, 1:].sum()
    for i, row in enumerate(rows):
        n = len(row)
        v, m = row[: n - 1], mask[i, 1:n]
        o, r = old[i, 1:n], returns[i, 1:n]
        clipped = o + torch.clamp(v - o, -CLIP, CLIP)
        loss = loss + (0.5 * torch.maximum((v - r) ** 2, (clipped - r) ** 2) * m).sum() / count
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return values, float(loss.detach()), grads, lengths


# ---- tests ----
@pytest.fixture(scope="module")
def critic_dir(tmp_path_factory):
    from mrl.app.model_source import ModelSource
    from mrl.app.reward_model import reward_model_source

    root = tmp_path_factory.mktemp("critic")
    lm = build_tiny_hf_model(root / "lm", "qwen2", num_kv_heads=2, seed=3)
    return str(reward_model_source(ModelSource(lm), root, pad_token_id=0, seed=5, name="critic_init").config_dir)


@pytest.fixture(scope="module")
def single(critic_dir):
    return collect(run_on_ranks(run, world_size=1, args=(critic_dir,)))


def _valid(lengths: torch.Tensor) -> torch.Tensor:
    return torch.arange(SEQ_LEN)[None, :] < lengths[:, None]


def test_critic_values_loss_and_gradients_equal_plain_torch_on_hf(critic_dir, single):
    values, loss, grads, lengths = hf_critic(critic_dir)
    assert (single["before"] - values)[_valid(lengths)].abs().max() <= 1e-5
    assert single["losses"][0] == pytest.approx(loss, abs=1e-6)
    assert single["grads"].keys() == grads.keys()
    for name, grad in grads.items():
        assert (single["grads"][name] - grad).abs().max() <= 1e-5, name
    assert single["losses"][-1] < single["losses"][0]  # three steps fit the returns better


LAYOUTS = {
    "tp2-sp": dict(tp=2, sp=True),
    "pp2": dict(pp=2),
    "cp2": dict(cp=2),
    "dp2": dict(),
    "packed": dict(packing=64),
}


@pytest.mark.parametrize("layout", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_critic_layouts_equal_one_process(critic_dir, single, layout):
    world = 1 if "packing" in layout else 2
    got = collect(run_on_ranks(run, world_size=world, args=(critic_dir,), kwargs=layout))
    valid = _valid(make_batch()[2])
    assert (got["before"] - single["before"])[valid].abs().max() <= 1e-5
    assert got["losses"] == pytest.approx(single["losses"], abs=1e-5)
    assert got["grads"].keys() == single["grads"].keys()
    for name, grad in single["grads"].items():
        assert (got["grads"][name] - grad).abs().max() <= 1e-5, name
    # fp32 summation order through three Adam steps (test_policy_preference.py measured up to 1.1e-5 on scores)
    assert (got["after"] - single["after"])[valid].abs().max() <= 3e-5
