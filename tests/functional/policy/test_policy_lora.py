"""LoRA adapters on the Megatron policy's parallel linears (mrl/model/lora.py), through the real train step:

- adapters initialised with B = 0 leave the model's logprobs unchanged, bit for bit;
- the optimizer holds the adapters alone, and three Adam steps leave every base parameter unchanged, bit for bit,
  while the adapters move;
- the adapters merged into the base weights (W + s * B @ A per shard) give the adapted model's logprobs;
- TP2 with sequence parallelism, PP2 and CP2 give the single process's logprobs before and after, and its losses, and
  export the same PEFT adapters, which HF PEFT loads over the base model to give mrl's logprobs;
- a tiny Qwen3-MoE with its routed experts adapted (target `experts`): the same in one process, at EP2 and at TP2
  with sequence parallelism (explicit expert communication);
- a checkpoint written at TP2 + SP (dense) or EP2 (experts) read by one process, and the exporter's merged model
  read by transformers, give the adapted logprobs;
- dropout on the adapters' input draws its mask as torch's dropout does, in training only.
"""

from __future__ import annotations

import pytest
import torch

from mrl.testing.distributed import run_on_ranks
from mrl.testing.tiny_models import build_tiny_hf_model

pytestmark = pytest.mark.functional

SEQ_LEN, RANK, ALPHA, STEPS = 16, 4, 8.0, 3


# ---- rank side: imported by each rank process of run_on_ranks ----
def make_batch(n: int = 8, vocab: int = 200, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (n, SEQ_LEN), generator=g)
    mask = torch.zeros(n, SEQ_LEN)
    for i in range(n):
        mask[i, 3 : 5 + i] = 1
    adv = torch.randn(n, generator=g)[:, None].expand(n, SEQ_LEN).contiguous()
    return ids, mask, adv


def _model(model_dir: str, tp: int, pp: int, sp: bool, cp: int = 1):
    import json
    from pathlib import Path

    from megatron.core import parallel_state as ps

    from converters import model_dims
    from converters.hf_io import load_hf_state
    from mrl.model.build import build_model, load_hf_weights, router_settings, transformer_config_from_hf

    hf_config = json.loads((Path(model_dir) / "config.json").read_text())
    experts = router_settings(model_dims(hf_config), expert_parallel=ps.get_expert_model_parallel_world_size())
    config = transformer_config_from_hf(hf_config, tensor_parallel=tp, pipeline_parallel=pp, sequence_parallel=sp,
                                        context_parallel=cp, **experts)
    model = build_model(hf_config, config)
    load_hf_weights(model, load_hf_state(model_dir), hf_config)
    return model, config, hf_config


def _adapted(model, config, settings_seed: int = 11):
    """Adapters on `model`, then Megatron's DDP, Adam and its schedule over them (what the policy worker does)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    from mrl.config.schema import OptimizerConfig, SchedulerConfig
    from mrl.model.lora import LoraSettings, apply_lora
    from mrl.policy.optim import build_optimizer, build_scheduler

    wrapped = apply_lora(model, LoraSettings(rank=RANK, alpha=ALPHA, seed=settings_seed))
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), module=model)
    config.finalize_model_grads_func = finalize_model_grads
    opt_cfg = OptimizerConfig(lr=1e-2, weight_decay=0.0, adam_eps=1e-6)
    optimizer = build_optimizer([ddp], opt_cfg, params_dtype=torch.float32)
    scheduler = build_scheduler(optimizer, opt_cfg, SchedulerConfig(), total_steps=STEPS)
    return ddp, optimizer, scheduler, wrapped


def _exporter(model, hf_config):
    from converters import model_dims
    from mrl.model.build import stage_layer_offset
    from mrl.policy.export import ShardedExporter

    return ShardedExporter(model, model_dims(hf_config), layer_offset=stage_layer_offset(model), names="local")


def run(model_dir: str, tp: int = 1, pp: int = 1, sp: bool = False, cp: int = 1, ep: int = 1):
    """Logprobs without adapters, with fresh ones, after 3 steps, and of the merged model; losses; whether the base
    stayed bit for bit; the optimizer's parameter count. None on ranks that do not report."""
    import os

    from megatron.core import parallel_state as ps

    from converters import model_dims
    from mrl.model.lora import merged_weight
    from mrl.parallel.groups import init_process_groups
    from mrl.parallel.layout import ParallelDims
    from mrl.policy.interface import RankBatch, global_count
    from mrl.policy.train_step import StepContext, logprobs_of_batch, train_on_batch
    from mrl.testing.losses import PGLoss

    init_process_groups(ParallelDims(tp=tp, pp=pp, cp=cp, ep=ep, sequence_parallel=sp,
                                     world_size=int(os.environ["WORLD_SIZE"])))
    model, config, hf_config = _model(model_dir, tp, pp, sp, cp)
    ids, mask, adv = make_batch()
    batch = RankBatch(ids, mask, token_data={"adv": adv})
    ctx = StepContext(dp_size=1, cp_rank=ps.get_context_parallel_rank(), cp_size=cp,
                      cp_group=ps.get_context_parallel_group(), is_last_stage=ps.is_pipeline_last_stage(),
                      vocab_size=hf_config["vocab_size"])
    plain = logprobs_of_batch([model], batch, micro_batch_size=4, ctx=ctx)
    base = {name: p.detach().clone() for name, p in model.named_parameters()}
    ddp, optimizer, scheduler, wrapped = _adapted(model, config)
    optimized = sum(p.numel() for group in optimizer.param_groups for p in group["params"])
    fresh = logprobs_of_batch([ddp], batch, micro_batch_size=4, ctx=ctx)
    losses = []
    for _ in range(STEPS):
        metrics = train_on_batch([ddp], optimizer, scheduler, batch, loss_fn=PGLoss("token"),
                                 count=global_count(mask, "token"), micro_batch_size=4, ctx=ctx)
        loss = torch.tensor(metrics.get("loss", 0.0), dtype=torch.float64)  # each CP rank's part of it
        torch.distributed.all_reduce(loss, group=ps.get_context_parallel_group())
        losses.append(float(loss))
    after = logprobs_of_batch([ddp], batch, micro_batch_size=4, ctx=ctx)
    base_kept = all(torch.equal(p, base[name]) for name, p in model.named_parameters() if name in base)
    adapters = {name: p for name, p in model.named_parameters() if ".lora.lora_" in name}
    moved = all(bool((p != 0).any()) for name, p in adapters.items() if name.endswith("lora_b"))
    # the merged model: the same base weights, each wrapped layer's weight replaced by W + s * B @ A
    merged_model, _, _ = _model(model_dir, tp, pp, sp, cp)
    layers = dict(model.named_modules())
    with torch.no_grad():
        for name, module in merged_model.named_modules():
            if name in wrapped:
                module.weight.copy_(merged_weight(layers[name]))
    merged = logprobs_of_batch([merged_model], batch, micro_batch_size=4, ctx=ctx)
    moe = model_dims(hf_config).moe is not None  # routed experts' adapters have no PEFT folder
    peft = [] if moe else _exporter(model, hf_config).adapter_tensors()  # collective; rank 0 holds them
    report = {"adapters": dict(peft)} if torch.distributed.get_rank() == 0 and not moe else {}
    if not (ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
            and ps.get_context_parallel_rank() == 0):
        return report or None
    return report | {"plain": plain, "fresh": fresh, "after": after, "merged": merged, "losses": losses,
            "base_kept": base_kept, "moved": moved, "optimized": optimized,
            "adapter_numel": sum(p.numel() for p in adapters.values()), "wrapped": len(wrapped)}


# ---- tests ----
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_hf_model(tmp_path_factory.mktemp("lora"), "qwen2", num_kv_heads=2, seed=3))


@pytest.fixture(scope="module")
def single(model_dir):
    (result,) = run_on_ranks(run, world_size=1, args=(model_dir,))
    return result


def _hf_logprobs(model, ids):
    with torch.no_grad():
        logits = model(ids).logits.float()
    return torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def test_the_exported_adapters_loaded_by_peft_give_mrls_logprobs(model_dir, single, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from converters.hf_io import save_peft_adapter

    modules = save_peft_adapter(single["adapters"].items(), tmp_path / "adapter", rank=RANK, alpha=ALPHA,
                                dropout=0.0, base_model=model_dir)
    assert modules == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    ids = make_batch()[0]
    assert (_hf_logprobs(peft, ids) - single["after"][:, 1:]).abs().max() <= 1e-4
    with peft.disable_adapter():  # the same folder without its adapters is the base: they carried the change
        assert (_hf_logprobs(peft, ids) - single["plain"][:, 1:]).abs().max() <= 1e-4


def test_fresh_adapters_change_nothing_training_moves_them_alone_and_merging_gives_the_same_model(single):
    assert torch.equal(single["fresh"], single["plain"])  # B = 0: the adapters add exactly 0
    assert single["wrapped"] == 2 * 4  # 2 layers x (qkv, proj, fc1, fc2)
    assert single["optimized"] == single["adapter_numel"]  # Adam over the adapters alone
    assert single["base_kept"] and single["moved"]
    assert single["losses"][-1] < single["losses"][0]
    assert (single["after"] - single["plain"]).abs().max() > 1e-3  # the adapters changed the model
    assert (single["merged"] - single["after"]).abs().max() <= 1e-5


@pytest.mark.parametrize("layout", [dict(tp=2, sp=True), dict(pp=2), dict(cp=2)], ids=["tp2-sp", "pp2", "cp2"])
def test_lora_layouts_equal_one_process(model_dir, single, layout):
    reports = [r for r in run_on_ranks(run, world_size=2, args=(model_dir,), kwargs=layout) if r is not None]
    check_layout(reports, single)
    (exported,) = [got["adapters"] for got in reports if "adapters" in got]  # rank 0's, whichever stage it is
    assert exported.keys() == single["adapters"].keys()
    for name, tensor in exported.items():  # Adam's steps (lr 1e-2 each) carry the gradients' rounding: 1e-2 of a step
        assert (tensor - single["adapters"][name]).abs().max() <= 1e-4, name


def check_layout(reports: list, single: dict, after_atol: float = 1e-5) -> None:
    """A layout's reports against the single process's: logprobs before and after, losses, merged = adapted."""
    assert any("after" in got for got in reports)
    for got in (got for got in reports if "after" in got):  # the last stage's first TP rank
        assert got["base_kept"] and got["moved"]
        assert (got["fresh"] - single["plain"]).abs().max() <= 1e-5
        assert got["losses"] == pytest.approx(single["losses"], abs=1e-5)
        assert (got["after"] - single["after"]).abs().max() <= after_atol
        assert (got["merged"] - got["after"]).abs().max() <= 1e-5


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return str(build_tiny_hf_model(tmp_path_factory.mktemp("lora-moe"), "qwen3_moe", layers=2, seed=5))


@pytest.fixture(scope="module")
def moe_single(moe_dir):
    (result,) = run_on_ranks(run, world_size=1, args=(moe_dir,))
    return result


def test_routed_experts_adapters_train_alone_and_merge(moe_single):
    assert moe_single["wrapped"] == 2 * (2 + 8 * 2)  # layers x (qkv, proj + 8 experts x (fc1, fc2))
    assert torch.equal(moe_single["fresh"], moe_single["plain"])
    assert moe_single["optimized"] == moe_single["adapter_numel"]
    assert moe_single["base_kept"] and moe_single["moved"]
    assert (moe_single["merged"] - moe_single["after"]).abs().max() <= 1e-5


@pytest.mark.parametrize("layout", [dict(ep=2), dict(tp=2, sp=True)], ids=["ep2", "tp2-sp"])
def test_routed_experts_adapters_in_every_layout_equal_one_process(moe_dir, moe_single, layout):
    """EP2: each rank adapts its own experts; TP2: the experts' linears run under explicit expert communication, their
    replicated factor's gradient summed over the expert-TP group."""
    reports = [r for r in run_on_ranks(run, world_size=2, args=(moe_dir,), kwargs=layout) if r is not None]
    # After the Adam steps: the experts' summed factor gradients round differently from one process's, and Adam's
    # steps carry that rounding into the adapters (1e-4, as the dense layouts' exported adapters); measured 3.1e-5 at
    # TP2 on an AMX Xeon, under 1e-5 on a Zen 5 EPYC.
    check_layout(reports, moe_single, after_atol=1e-4)


def save_and_export(model_dir: str, out: str, tp: int = 1, sp: bool = False, ep: int = 1):
    """Two steps with adapters, then a distributed checkpoint in `out` and the merged model exported as HF-named
    tensors (the refit's exporter); rank 0 returns the logprobs after the steps and the exported tensors."""
    import os

    from megatron.core import parallel_state as ps

    from mrl.checkpoint.megatron import save_megatron_state
    from mrl.parallel.groups import init_process_groups
    from mrl.parallel.layout import ParallelDims
    from mrl.policy.export import plan_buckets
    from mrl.policy.interface import RankBatch, global_count
    from mrl.policy.train_step import StepContext, logprobs_of_batch, train_on_batch
    from mrl.testing.losses import PGLoss

    init_process_groups(ParallelDims(tp=tp, ep=ep, sequence_parallel=sp, world_size=int(os.environ["WORLD_SIZE"])))
    model, config, hf_config = _model(model_dir, tp, 1, sp)
    ddp, optimizer, scheduler, _ = _adapted(model, config)
    ids, mask, adv = make_batch()
    batch = RankBatch(ids, mask, token_data={"adv": adv})
    ctx = StepContext(dp_size=1, cp_rank=0, cp_size=1, cp_group=ps.get_context_parallel_group(),
                      is_last_stage=True, vocab_size=hf_config["vocab_size"])
    for _ in range(2):
        train_on_batch([ddp], optimizer, scheduler, batch, loss_fn=PGLoss("token"),
                       count=global_count(mask, "token"), micro_batch_size=4, ctx=ctx)
    after = logprobs_of_batch([ddp], batch, micro_batch_size=4, ctx=ctx)
    save_megatron_state(out, [ddp], optimizer, scheduler)
    exporter = _exporter(model, hf_config)
    state: dict = {}
    for bucket in plan_buckets(exporter.dims, exporter.names, 1 << 62, 4, split_units=True, stages=exporter.stages):
        state.update(exporter.bucket(bucket))
    return {"after": after, "state": state} if torch.distributed.get_rank() == 0 else None


def load_and_score(model_dir: str, out: str, load_optimizer: bool = True):
    """One process: a fresh adapted model, the checkpoint loaded into it (resharded), its logprobs. `load_optimizer`
    False: the weights alone (Megatron chains a dense and an expert optimizer under EP only, so their states keep to
    an EP size)."""
    from megatron.core import parallel_state as ps

    from mrl.checkpoint.megatron import load_megatron_state
    from mrl.parallel.groups import init_process_groups
    from mrl.parallel.layout import ParallelDims
    from mrl.policy.interface import RankBatch
    from mrl.policy.train_step import StepContext, logprobs_of_batch

    init_process_groups(ParallelDims())
    model, config, hf_config = _model(model_dir, 1, 1, False)
    ddp, optimizer, scheduler, _ = _adapted(model, config, settings_seed=99)  # another seed: the checkpoint sets A
    load_megatron_state(out, [ddp], optimizer, scheduler, load_optimizer=load_optimizer)
    ids, mask, adv = make_batch()
    ctx = StepContext(dp_size=1, cp_rank=0, cp_size=1, cp_group=ps.get_context_parallel_group(),
                      is_last_stage=True, vocab_size=hf_config["vocab_size"])
    return logprobs_of_batch([ddp], RankBatch(ids, mask, token_data={"adv": adv}), micro_batch_size=4, ctx=ctx)


@pytest.mark.parametrize("case", ["dense-tp2-sp", "moe-ep2"])
def test_a_lora_checkpoint_reshards_and_the_refit_exports_the_merged_model(model_dir, moe_dir, tmp_path, case):
    """Written at TP2 with sequence parallelism (a dense model) or EP2 (routed experts adapted), read by one process:
    the adapters come back; the merged model the exporter gathers, read by transformers, gives the adapted logprobs."""
    from transformers import AutoModelForCausalLM

    from converters.hf_io import copy_model_metadata, save_hf_state

    source, layout = (model_dir, dict(tp=2, sp=True)) if case == "dense-tp2-sp" else (moe_dir, dict(ep=2))
    out = str(tmp_path / "ckpt")
    saved = next(r for r in run_on_ranks(save_and_export, world_size=2, args=(source, out), kwargs=layout)
                 if r is not None)
    (loaded,) = run_on_ranks(load_and_score, world_size=1, args=(source, out, case.startswith("dense")))
    assert (loaded - saved["after"]).abs().max() <= 1e-5
    save_hf_state(saved["state"].items(), tmp_path / "hf", log=lambda message: None)
    copy_model_metadata(source, tmp_path / "hf")
    options = dict(experts_implementation="eager") if case.startswith("moe") else {}
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32, **options)
    ids = make_batch()[0]
    with torch.no_grad():
        logits = hf(ids).logits.float()
    token_lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    assert (token_lp - saved["after"][:, 1:]).abs().max() <= 1e-4


def dropout_check(model_dir: str, p: float = 0.5):
    """One adapter with dropout p and a random B: its training output against torch's dropout drawn from the same
    generator state (a column layer without sequence parallelism: the default generator), and in eval mode none."""
    from mrl.model.lora import LoraSettings, apply_lora
    from mrl.parallel.groups import init_process_groups
    from mrl.parallel.layout import ParallelDims

    init_process_groups(ParallelDims())
    model, _, _ = _model(model_dir, 1, 1, False)
    apply_lora(model, LoraSettings(rank=RANK, alpha=ALPHA, dropout=p, targets=("linear_qkv",)))
    lora = model.decoder.layers[0].self_attention.linear_qkv.lora
    with torch.no_grad():
        lora.lora_b.normal_()
        x = torch.randn(5, 2, lora.lora_a.shape[1])
        lora.train()
        torch.manual_seed(7)
        trained = lora(x)
        torch.manual_seed(7)
        dropped = torch.nn.functional.dropout(x, p)
        lora.eval()
        evaluated = lora(x)
    scale = ALPHA / RANK
    return {
        "train": (trained - scale * dropped @ lora.lora_a.T @ lora.lora_b.T).abs().max().item(),
        "eval": (evaluated - scale * x @ lora.lora_a.T @ lora.lora_b.T).abs().max().item(),
        "differs": (trained - evaluated).abs().max().item(),
    }


def test_dropout_on_the_adapters_input_in_training_only(model_dir):
    (got,) = run_on_ranks(dropout_check, world_size=1, args=(model_dir,))
    assert got["train"] <= 1e-5 and got["eval"] <= 1e-5
    assert got["differs"] > 1e-2
