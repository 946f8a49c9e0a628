"""The policy train step under CP2, TP2+SP and a tiny MoE at EP2 equals the single-process result; micro-batching
does not change the gradients or the weights of a step. The MoE families (Qwen3-MoE, DeepSeek-V3 with MLA) loaded
from HF checkpoints, routers frozen as in RL, do the same at EP2 and TP2, and their single-process logprobs equal
HF transformers'.

Every layout is compared with the same model and batch run in one process (TP1), the reference: logprobs before
training, the losses of 3 Adam steps, the gradients of the 3rd step and every weight after it, gathered to full
tensors (TP shards concatenated, gated fc1 halves re-ordered, pipeline-stage and expert indices made global, vocab
padding cut). TP2, PP2 and DP2 are covered by test_policy_train_step.py.

Why Adam's epsilon is 1e-6 here, not the default 1e-8: a parallel layout or a micro-batch split changes the fp32
summation order of the gradients (measured: <= 4e-8 absolute after one step, gradients up to 6e-2). Adam's first
update is lr * g / (|g| + eps), whose slope in g is lr * eps / (|g| + eps)^2 <= lr / eps: an element whose gradient
is ~eps (an embedding row of a token that barely touches the loss) turns a tiny gradient difference into a large
weight difference. With eps = 1e-8 (gain up to 1e5) TP2+SP differed from TP1 by 4.4e-5 in one embedding element
after one step (g = 1.7e-8, difference 3e-9), and micro-batchings by 1.6e-6. With eps = 1e-6 (gain <= 1e3) weights
agree to ~3e-6 (layouts, 3 steps) and ~4e-7 (micro-batchings, 1 step). The gradients themselves are compared
directly as well, which is where a real sharding error (a missing all-reduce, a wrong normalisation) shows.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from mrl.testing.distributed import run_on_ranks
from mrl.testing.losses import PGLoss
from mrl.testing.tiny_models import build_tiny_hf_model

LR = 1e-3
ADAM_EPS = 1e-6  # not 1e-8: see the module docstring (Adam amplifies fp32 noise on gradients ~eps)
SEQ_LEN = 16  # a multiple of 2*cp (CP2) and of tp (SP)


# ---- rank side: imported by each rank process of run_on_ranks ----


def make_batch(n: int = 8, t: int = SEQ_LEN, vocab: int = 200, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (n, t), generator=g)
    mask = torch.zeros(n, t)
    for i in range(n):
        mask[i, 3: 5 + i] = 1  # responses of different lengths, some crossing CP chunk borders
    adv = torch.randn(n, generator=g)[:, None].expand(n, t).contiguous()
    return ids, mask, adv


def _global_name(name: str, model, layer_offset: int) -> str:
    """This rank's parameter name -> the name in a 1-rank model (GPT's name: global transformer layer and expert
    indices; `layer_offset` is the stage's first transformer layer, `stage_layer_offset`)."""
    from megatron.core import parallel_state as ps

    from mrl.model.hybrid import to_gpt

    parts = to_gpt(name).split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(int(parts[2]) + layer_offset)
    if "local_experts" in parts:
        i = parts.index("local_experts") + 1
        per_rank = model.config.num_moe_experts // ps.get_expert_model_parallel_world_size()
        parts[i] = str(int(parts[i]) + ps.get_expert_model_parallel_rank() * per_rank)
    return ".".join(parts)


def _tp_gather(name: str, param: torch.Tensor, tensor: torch.Tensor, gated: bool) -> torch.Tensor:
    """The full tensor of `tensor`, this rank's shard of `param` (its value or its gradient)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if not getattr(param, "tensor_model_parallel", False):
        return tensor.detach().clone()
    group = ps.get_expert_tensor_parallel_group() if ".experts." in name else ps.get_tensor_model_parallel_group()
    shards = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, tensor.detach().contiguous(), group=group)
    if gated and name.endswith("linear_fc1.weight"):  # each shard is [gate_r; up_r]: the full one is [gate; up]
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=param.partition_dim)


def full_tensors(model, vocab_size: int, grads: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter (or its DDP gradient) of the whole model as in a 1-rank model; collective over all ranks."""
    import torch.distributed as dist

    from mrl.model.build import stage_layer_offset

    offset = stage_layer_offset(model)
    local = {}
    for name, param in model.named_parameters():
        if grads and not param.requires_grad:
            continue  # a frozen router: no gradient
        full = _tp_gather(name, param, param.main_grad if grads else param, model.config.gated_linear_unit)
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            full = full[:vocab_size]  # Megatron's padding rows (their number depends on TP) never train
        local[_global_name(name, model, offset)] = full
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    merged: dict[str, torch.Tensor] = {}
    for part in gathered:
        for name, tensor in part.items():
            merged.setdefault(name, tensor)  # DP/CP replicas hold the same tensor
    return merged


def init_by_global_name(model, seed: int) -> None:
    """Weights drawn from a generator per global parameter name, so every expert-parallel layout starts from the
    same model (Megatron's own init draws experts in a rank-dependent order). Needs tensor parallel size 1."""
    from megatron.core import parallel_state as ps

    from mrl.model.build import stage_layer_offset

    assert ps.get_tensor_model_parallel_world_size() == 1, "init_by_global_name draws full tensors, not TP shards"
    offset = stage_layer_offset(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            gen = torch.Generator().manual_seed(seed + zlib.crc32(_global_name(name, model, offset).encode()))
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1.0 + 0.1 * noise if "layernorm" in name else 0.15 * noise)


def run(model_dir: str, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, sp: bool = False, **kwargs):
    """One layout: process groups for (tp, pp, cp, ep, sp) on this run's ranks, then `train_and_report`."""
    import os

    from mrl.parallel.layout import ParallelDims
    from mrl.parallel.groups import init_process_groups

    init_process_groups(ParallelDims(tp=tp, pp=pp, cp=cp, ep=ep, sequence_parallel=sp,
                                     world_size=int(os.environ["WORLD_SIZE"])))
    return train_and_report(model_dir, sequence_parallel=sp, **kwargs)


def run_micro_batchings(model_dir: str, sizes: tuple[int, ...], **kwargs) -> list:
    """One process, a fresh model per micro-batch size."""
    from mrl.parallel.layout import ParallelDims
    from mrl.parallel.groups import init_process_groups

    init_process_groups(ParallelDims())
    return [train_and_report(model_dir, micro_batch_size=size, **kwargs) for size in sizes]


def train_and_report(model_dir: str, *, sequence_parallel: bool = False, moe: bool = False, steps: int = 3,
                     micro_batch_size: int = 4, level: str = "token", adam_eps: float = ADAM_EPS,
                     first_stage_layers: int | None = None):
    """Logprobs before training, per-step losses, and the full weights and last-step gradients after training.

    Returns None on ranks that do not report (all but the last pipeline stage's TP-0/CP-0 rank of each DP rank).
    """
    import json
    from pathlib import Path

    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    from converters import model_dims
    from converters.hf_io import load_hf_state
    from mrl.config.schema import OptimizerConfig, SchedulerConfig
    from mrl.model.build import (build_model, freeze_routers, load_hf_weights, moe_transformer_config,
                                 router_settings, transformer_config_from_hf)
    from mrl.policy.optim import build_optimizer, build_scheduler
    from mrl.policy.interface import RankBatch, global_count
    from mrl.policy.train_step import StepContext, logprobs_of_batch, train_on_batch

    hf_config = json.loads((Path(model_dir) / "config.json").read_text())
    sizes = dict(tensor_parallel=ps.get_tensor_model_parallel_world_size(),
                 pipeline_parallel=ps.get_pipeline_model_parallel_world_size(),
                 context_parallel=ps.get_context_parallel_world_size(),
                 sequence_parallel=sequence_parallel)
    if first_stage_layers is not None:  # an uneven pipeline split (policy.parallel.first_stage_layers)
        sizes["num_layers_in_first_pipeline_stage"] = first_stage_layers
    if moe:
        cfg = moe_transformer_config(hf_config, num_experts=4, router_topk=2, moe_ffn_hidden_size=64,
                                     expert_parallel=ps.get_expert_model_parallel_world_size(), **sizes)
        model = build_model(hf_config, cfg)
        init_by_global_name(model, seed=7)
    else:  # an HF checkpoint, dense or MoE (routers frozen, as the policy does by default)
        experts = router_settings(model_dims(hf_config), expert_parallel=ps.get_expert_model_parallel_world_size())
        cfg = transformer_config_from_hf(hf_config, **sizes, **experts)
        model = build_model(hf_config, cfg)
        load_hf_weights(model, load_hf_state(model_dir), hf_config)
        freeze_routers(model)
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(grad_reduce_in_fp32=True), module=model)
    cfg.finalize_model_grads_func = finalize_model_grads
    opt_cfg = OptimizerConfig(lr=LR, weight_decay=0.0, adam_eps=adam_eps)
    optimizer = build_optimizer([ddp], opt_cfg, params_dtype=torch.float32)
    scheduler = build_scheduler(optimizer, opt_cfg, SchedulerConfig(), total_steps=steps)

    ids, mask, adv = make_batch()
    count = global_count(mask, level)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    rows = slice(dp_rank * len(ids) // dp, (dp_rank + 1) * len(ids) // dp)  # this DP rank's shard
    batch = RankBatch(ids[rows], mask[rows], token_data={"adv": adv[rows]})
    ctx = StepContext(dp_size=dp, cp_rank=ps.get_context_parallel_rank(), cp_size=ps.get_context_parallel_world_size(),
                      cp_group=ps.get_context_parallel_group(), is_last_stage=ps.is_pipeline_last_stage(),
                      vocab_size=hf_config["vocab_size"])
    before = logprobs_of_batch([ddp], batch, micro_batch_size=micro_batch_size, ctx=ctx)
    losses = []
    for _ in range(steps):
        metrics = train_on_batch([ddp], optimizer, scheduler, batch, loss_fn=PGLoss(level), count=count,
                                 micro_batch_size=micro_batch_size, ctx=ctx)
        loss = torch.tensor(metrics.get("loss", 0.0), dtype=torch.float64)
        # each DP and CP rank holds its share of the sum (its sequences, its chunks of them)
        dist.all_reduce(loss, group=ps.get_data_parallel_group(with_context_parallel=True))
        losses.append(float(loss))
    # DDP's main_grad buffers keep the last step's (clipped) gradients until the next step zeroes them.
    grads = full_tensors(model, hf_config["vocab_size"], grads=True)
    weights = full_tensors(model, hf_config["vocab_size"])
    if not (ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
            and ps.get_context_parallel_rank() == 0):
        return None
    return {"dp_rank": dp_rank, "before": before, "losses": losses, "weights": weights, "grads": grads}


# ---- tests ----
def collect(results: list) -> dict:
    """The reporting ranks' results: logprobs concatenated in data-parallel order, the rest from the first."""
    reports = sorted((r for r in results if r is not None), key=lambda r: r["dp_rank"])
    return {**reports[0], "before": torch.cat([r["before"] for r in reports])}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def differences(got: dict, reference: dict) -> dict[str, float]:
    return {"logprobs": (got["before"] - reference["before"]).abs().max().item(),
            "losses": max(abs(a - b) for a, b in zip(got["losses"], reference["losses"])),
            "weights": max_diff(got["weights"], reference["weights"]),
            "grads": max_diff(got["grads"], reference["grads"])}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_hf_model(tmp_path_factory.mktemp("qwen2"), "qwen2", num_kv_heads=2, seed=3))


@pytest.fixture(scope="module")
def references(model_dir):
    """Single-process results per (model kind, loss level), computed on first use."""
    cache: dict = {}

    def get(moe: bool, level: str) -> dict:
        if (moe, level) not in cache:
            (result,) = run_on_ranks(run, world_size=1, args=(model_dir,), kwargs=dict(moe=moe, level=level))
            cache[moe, level] = collect([result])
        return cache[moe, level]

    return get


LAYOUTS = {
    "cp2": dict(cp=2),
    "cp2-sequence-loss": dict(cp=2, level="sequence"),
    "tp2-sp": dict(tp=2, sp=True),
    "moe-ep2": dict(moe=True, ep=2),
}


@pytest.mark.parametrize("layout", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_parallel_layouts_match_single_process(model_dir, references, layout):
    reference = references(layout.get("moe", False), layout.get("level", "token"))
    diffs = differences(collect(run_on_ranks(run, world_size=2, args=(model_dir,), kwargs=layout)), reference)
    assert diffs["logprobs"] <= 1e-5, diffs
    assert diffs["losses"] <= 1e-5, diffs
    assert diffs["grads"] <= 1e-6, diffs  # of the 3rd step; gradients reach ~5e-2
    assert diffs["weights"] <= 1e-5, diffs


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen2_moe", "deepseek_v3"])
def moe_family(request, tmp_path_factory):
    """A tiny checkpoint of the family and its single-process result."""
    path = str(build_tiny_hf_model(tmp_path_factory.mktemp(request.param), request.param, layers=2, seed=5))
    (result,) = run_on_ranks(run, world_size=1, args=(path,))
    return path, collect([result])


def _hf_logprobs(model_dir: str, ids: torch.Tensor) -> torch.Tensor:
    """[N, T] logprob of each token under transformers (position 0: 0), the independent reference."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", experts_implementation="eager")
    with torch.no_grad():
        logits = hf.eval()(ids).logits.float()
    out = torch.zeros(ids.shape)
    out[:, 1:] = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return out


def test_moe_family_single_process_logprobs_equal_hf(moe_family):
    path, reference = moe_family
    ids, mask, _ = make_batch()
    hf = _hf_logprobs(path, ids)
    assert ((reference["before"] - hf) * mask).abs().max() <= 1e-5


@pytest.mark.parametrize("layout", [dict(ep=2), dict(tp=2, sp=True)], ids=["ep2", "tp2-sp"])
def test_moe_family_layouts_match_single_process(moe_family, layout):
    """3 Adam steps with frozen routers: logprobs, losses, gradients and weights as in one process."""
    path, reference = moe_family
    diffs = differences(collect(run_on_ranks(run, world_size=2, args=(path,), kwargs=layout)), reference)
    assert diffs["logprobs"] <= 1e-5, diffs
    assert diffs["losses"] <= 1e-5, diffs
    assert diffs["grads"] <= 1e-6, diffs
    assert diffs["weights"] <= 1e-5, diffs
    assert not any(".router." in name for name in reference["grads"])  # frozen: no gradient, no update


def test_uneven_pipeline_stages_match_single_process(tmp_path):
    """3 layers over 2 pipeline stages, 2 in the first (as DeepSeek-V3's 61 layers need an uneven split)."""
    path = str(build_tiny_hf_model(tmp_path / "three", "qwen2", num_kv_heads=2, layers=3, seed=3))
    reference = collect(run_on_ranks(run, world_size=1, args=(path,)))
    got = collect(run_on_ranks(run, world_size=2, args=(path,), kwargs=dict(pp=2, first_stage_layers=2)))
    diffs = differences(got, reference)
    assert max(diffs.values()) <= 1e-5, diffs


def test_moe_model_routes_tokens_to_every_expert(references):
    """The EP2 comparison means something only if both ranks' experts train (4 experts, top-2)."""
    grads = references(True, "token")["grads"]
    experts = [n for n in grads if ".local_experts." in n]
    assert len(experts) == 2 * 4 * 2  # layers x experts x (fc1, fc2)
    assert all(grads[n].abs().max() > 0 for n in experts)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_micro_batching_gives_the_same_weights(model_dir, level):
    """1, 2 and 4 micro-batches of the same 8 sequences: the same gradients, and the same weights after the step."""
    (runs,) = run_on_ranks(run_micro_batchings, world_size=1, args=(model_dir, (8, 4, 2)),
                           kwargs=dict(level=level, steps=1))
    for other in runs[1:]:
        diffs = differences(collect([other]), collect([runs[0]]))
        assert diffs["losses"] <= 1e-6, diffs
        assert diffs["grads"] <= 5e-8, diffs  # fp32 summation order; gradients reach ~5e-2
        assert diffs["weights"] <= 1e-6, diffs
