"""24K-token sequences through the policy at CP1 and CP2, against HF transformers; the context-parallel edge cases.

The tiny model uses YaRN (factor 4 over a native 8192 positions), so the 24K tokens lie past its native length and
the rope scaling is checked on the way. Packs go through the real train step (`logprobs_of_batch`,
`train_on_batch`, packing on), whose attention is the flash path of `mrl.parallel.attention` at this length.

Edge cases in one pack of 24576 tokens: a 24552-token sequence, a 10-token one, a 3-token one (shorter than the
2*CP = 4 chunks it is cut into) and a 1-token one: padded to 4, CP rank 1 holds only its padding, and it has no
loss tokens at all. CP2 must give the CP1 logprobs, loss and weights after an Adam step, nothing may be NaN, and the
long sequence's CP1 logprobs must equal HF transformers'. One run per layout serves every check: each is a 24K
forward and backward, the longest work of the suite.
"""

from __future__ import annotations

import resource

import pytest
import torch

from mrl.testing.distributed import run_on_ranks
from mrl.testing.losses import PGLoss
from mrl.testing.tiny_models import build_tiny_hf_model, hf_token_logprobs, read_config

LONG = 24576
YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 8192}
PACK_LENGTHS = [24552, 10, 3, 1]  # padded to multiples of 4 (2*CP): 24552 + 12 + 4 + 4 = 24576
PROMPT = 3
PEAK_GB = 3.0  # a rank's peak resident memory through the pack's logprobs and a training step


# ---- rank side: imported by each rank process of run_on_ranks ----


def make_batch(lengths: list[int], vocab: int, seed: int = 0):
    """ids [n, max length] (pad id 0 past each length), loss mask on the tokens after the first PROMPT, and
    per-sequence advantages."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(2, vocab, (len(lengths), width), generator=g)
    mask = torch.zeros(len(lengths), width)
    for i, length in enumerate(lengths):
        ids[i, length:] = 0
        mask[i, PROMPT:length] = 1  # a sequence of <= PROMPT tokens has no loss tokens
    adv = torch.randn(len(lengths), generator=g)[:, None].expand(len(lengths), width).contiguous()
    return ids, mask, adv


def run(model_dir: str, cp: int, lengths: list[int], train_steps: int = 0):
    """Logprobs of the pack, then `train_steps` Adam steps on it: logprobs, per-step losses, the weights before and
    after, peak RSS (GB)."""
    import os

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from mrl.config.schema import PackingConfig
    from mrl.parallel.groups import init_process_groups
    from mrl.parallel.layout import ParallelDims
    from mrl.policy.interface import RankBatch, global_count
    from mrl.policy.train_step import StepContext, logprobs_of_batch, train_on_batch
    from mrl.testing.megatron import trainable_from_hf

    init_process_groups(ParallelDims(cp=cp, world_size=int(os.environ["WORLD_SIZE"])))
    model, optimizer, scheduler, hf_config = trainable_from_hf(model_dir, adam_eps=1e-6,
                                                               total_steps=max(train_steps, 1), context_parallel=cp)
    initial = {k: v.detach().clone() for k, v in model.module.named_parameters()}

    ids, mask, adv = make_batch(lengths, hf_config["vocab_size"])
    batch = RankBatch(ids, mask, token_data={"adv": adv}, lengths=torch.tensor(lengths))
    ctx = StepContext(dp_size=1, cp_rank=ps.get_context_parallel_rank(), cp_size=cp,
                      cp_group=ps.get_context_parallel_group(), is_last_stage=True,
                      vocab_size=hf_config["vocab_size"])
    packing = PackingConfig(enabled=True, tokens_per_microbatch=LONG)
    logprobs = logprobs_of_batch([model], batch, micro_batch_size=1, ctx=ctx, packing=packing)
    losses = []
    for _ in range(train_steps):
        metrics = train_on_batch([model], optimizer, scheduler, batch, loss_fn=PGLoss("token"),
                                 count=global_count(mask, "token"), micro_batch_size=1, ctx=ctx, packing=packing)
        loss = torch.tensor(metrics["loss"], dtype=torch.float64)
        dist.all_reduce(loss, group=ps.get_context_parallel_group())  # each CP rank holds its chunks' share
        losses.append(float(loss))
    weights = {k: v.detach().clone() for k, v in model.module.named_parameters()}
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux
    return {"logprobs": logprobs, "losses": losses, "initial": initial, "weights": weights, "peak_gb": peak_gb}


# ---- tests ----
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_hf_model(tmp_path_factory.mktemp("qwen2_yarn"), "qwen2", num_kv_heads=2, seed=5,
                                   rope_parameters=YARN, max_position_embeddings=4 * 8192))


def run_layout(model_dir: str, cp: int, lengths: list[int], train_steps: int = 0) -> dict:
    results = run_on_ranks(run, world_size=cp, args=(model_dir, cp, lengths), kwargs=dict(train_steps=train_steps),
                           timeout_s=600)
    return {**results[0], "peak_gb": max(r["peak_gb"] for r in results)}


def test_pack_of_24k_and_tiny_sequences_gives_the_same_logprobs_and_step_at_cp2_as_cp1_and_transformers(model_dir):
    cp1, cp2 = (run_layout(model_dir, cp, PACK_LENGTHS, train_steps=1) for cp in (1, 2))
    valid = torch.arange(max(PACK_LENGTHS))[None, :] < torch.tensor(PACK_LENGTHS)[:, None]
    assert cp1["logprobs"].shape == (len(PACK_LENGTHS), max(PACK_LENGTHS))
    assert torch.isfinite(cp1["logprobs"]).all() and torch.isfinite(cp2["logprobs"]).all()
    assert all(torch.isfinite(torch.tensor(run["losses"])).all() for run in (cp1, cp2))
    assert (cp2["logprobs"] - cp1["logprobs"])[valid].abs().max().item() <= 1e-5
    assert torch.all(cp2["logprobs"][~valid] == 0)
    ids = make_batch(PACK_LENGTHS, vocab=read_config(model_dir)["vocab_size"])[0][0]
    reference = torch.cat([torch.zeros(1), hf_token_logprobs(model_dir, ids.tolist())])  # position 0: 0
    assert (cp1["logprobs"][0] - reference).abs().max().item() <= 1e-4
    assert cp2["losses"] == pytest.approx(cp1["losses"], abs=1e-6)
    for name, weight in cp1["weights"].items():
        assert torch.isfinite(cp2["weights"][name]).all(), name
        assert (cp2["weights"][name] - weight).abs().max().item() <= 1e-5, name
    moved = max((cp1["weights"][n] - w).abs().max().item() for n, w in cp1["initial"].items())
    assert moved > 1e-4  # the step really changed the weights being compared
    # O(sequence) attention: dense scores alone would be 24576^2 x 4 heads x 4 bytes = 9.7 GB per layer
    assert cp1["peak_gb"] < PEAK_GB and cp2["peak_gb"] < PEAK_GB, (cp1["peak_gb"], cp2["peak_gb"])
