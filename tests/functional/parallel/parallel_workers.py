"""Functions run on each rank by tests/functional/parallel (through mrl.testing.distributed.run_on_ranks)."""

import torch


def tiny_config(**overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(
        num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
        use_cpu_initialization=True, gradient_accumulation_fusion=False, bias_activation_fusion=False,
        masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False, normalization="RMSNorm",
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, pipeline_dtype=torch.float32,
    )
    return TransformerConfig(**{**base, **overrides})


def tiny_gpt(config, vocab=40, seq=32, **kwargs):
    """A transformer of `config.num_layers // 2` layers as megatron-core's HybridModel (as mrl builds its models)."""
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    from mrl.model import hybrid
    from mrl.parallel.attention import gpt_layer_spec

    spec = gpt_layer_spec(config, use_te=False)  # a block spec of per-layer specs for an MoE config
    return HybridModel(config, hybrid.stack_spec(getattr(spec, "layer_specs", [spec])), vocab_size=vocab,
                       max_sequence_length=seq, hybrid_layer_pattern=hybrid.layer_pattern(config),
                       position_embedding_type="rope", **kwargs)


def cp_chunks(x: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Megatron's load-balanced CP split of the last dim: chunks r and 2cp-1-r of 2cp equal chunks."""
    chunks = x.chunk(2 * cp_size, dim=-1)
    return torch.cat([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]], dim=-1)


def cp2_logits_equal_cp1() -> dict:
    """CP2 logits (plain batch and a THD pack) against the same weights run without CP on this rank."""
    import torch.distributed as dist
    from megatron.core.packed_seq_params import PackedSeqParams

    from mrl.parallel.layout import ParallelDims
    from mrl.parallel.groups import destroy_process_groups, init_process_groups

    init_process_groups(ParallelDims(cp=2, world_size=2), seed=5)
    rank = dist.get_rank()
    model = tiny_gpt(tiny_config(context_parallel_size=2)).eval()
    tokens = torch.randint(0, 40, (2, 16), generator=torch.Generator().manual_seed(0))  # [b, s]
    positions = torch.arange(16).expand(2, -1)
    lens = [8, 4, 12]  # each a multiple of 2*cp
    cu = torch.tensor([0, 8, 12, 24], dtype=torch.int32)
    pack = torch.randint(0, 40, (1, 24), generator=torch.Generator().manual_seed(1))
    local_pack = torch.cat([cp_chunks(pack[:, a:b], 2, rank) for a, b in zip(cu[:-1], cu[1:])], dim=1)
    thd = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                          cu_seqlens_kv_padded=cu, max_seqlen_q=max(lens), max_seqlen_kv=max(lens))
    with torch.no_grad():
        cp_logits = model(cp_chunks(tokens, 2, rank), cp_chunks(positions, 2, rank), None)  # [b, s/2, V]
        cp_pack_logits = model(local_pack, None, None, packed_seq_params=thd)  # [1, 12, V]
    weights = model.state_dict()

    init_process_groups(ParallelDims(world_size=2), seed=5)  # dp=2: each rank a full replica, no CP
    reference = tiny_gpt(tiny_config()).eval()
    reference.load_state_dict(weights)
    with torch.no_grad():
        full = reference(tokens, positions, None)  # [b, s, V]
        per_seq = [reference(pack[:, a:b], torch.arange(b - a)[None], None) for a, b in zip(cu[:-1], cu[1:])]
    expected_pack = torch.cat([cp_chunks(x.transpose(1, 2), 2, rank).transpose(1, 2) for x in per_seq], dim=1)
    expected = cp_chunks(full.transpose(1, 2), 2, rank).transpose(1, 2)
    destroy_process_groups()
    return {
        "batch_err": (cp_logits - expected).abs().max().item(),
        "pack_err": (cp_pack_logits - expected_pack).abs().max().item(),
        "shapes": (tuple(cp_logits.shape), tuple(cp_pack_logits.shape)),
    }


def _moe_forward_backward(ep: int) -> float:
    """Loss of a tiny MoE GPT (4 experts, top-2, all-to-all dispatcher) after a backward pass."""
    config = tiny_config(
        num_layers=2, expert_model_parallel_size=ep, num_moe_experts=4, moe_router_topk=2,  # attention + experts
        moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False, moe_aux_loss_coeff=0.0,
        moe_router_load_balancing_type="none", moe_ffn_hidden_size=32, moe_permute_fusion=False,
        moe_router_dtype="fp32",
    )
    model = tiny_gpt(config)
    import torch.distributed as dist

    tokens = torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    loss = model(tokens, torch.arange(8).expand(2, -1), None, labels=tokens).mean()
    loss.backward()
    return loss.item()


def _outcome(fn, *args):
    try:
        return ("ok", fn(*args))
    except Exception as error:  # the failure under test; both ranks fail the same way before any collective
        return ("error", f"{type(error).__name__}: {error}"[:300])


def _uneven_gather() -> list:
    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings

    sizes = [3, 5]
    rank = dist.get_rank()
    local = torch.full((sizes[rank], 2), float(rank + 1))  # rank r contributes sizes[r] rows of (r+1)
    return mappings._gather_along_first_dim(local, dist.group.WORLD, output_split_sizes=sizes).tolist()


def _tied_pipeline_build() -> float:
    """A tied-embedding GPT at PP2: the last stage's output copy equals the first stage's embedding after the build
    (returns the sum of the tied weight, all-reduced over the two stages)."""
    from megatron.core import parallel_state

    config = tiny_config(num_layers=4, pipeline_model_parallel_size=2)  # a transformer layer per stage
    model = tiny_gpt(config, share_embeddings_and_output_weights=True,
                     pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage())
    weight = model.shared_embedding_or_output_weight().detach().clone()
    gathered = [torch.empty_like(weight) for _ in range(2)]
    torch.distributed.all_gather(gathered, weight, group=parallel_state.get_pipeline_model_parallel_group())
    assert torch.equal(gathered[0], gathered[1]), "the two stages' copies of the tied embedding differ"
    return float(weight.sum())


def megatron_patches_multi_rank() -> dict:
    """Each 2-rank patch: the megatron call fails without it and works with it."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from mrl.cpu import megatron_patches
    from mrl.parallel.layout import ParallelDims
    from mrl.parallel.groups import destroy_process_groups, init_process_groups

    init_process_groups(ParallelDims(ep=2, world_size=2), seed=3)
    results = {}
    megatron_patches.revert(["moe_split_sizes_on_host"])
    results["moe_ep2_without"] = _outcome(_moe_forward_backward, 2)
    megatron_patches.apply()
    model_parallel_cuda_manual_seed(3)
    results["moe_ep2_with"] = _outcome(_moe_forward_backward, 2)

    megatron_patches.revert(["gloo_uneven_all_gather"])
    results["gather_without"] = _outcome(_uneven_gather)
    megatron_patches.apply()
    results["gather_with"] = _outcome(_uneven_gather)
    assert parallel_state.get_expert_model_parallel_world_size() == 2

    parallel_state.destroy_model_parallel()  # same processes, now two pipeline stages
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    model_parallel_cuda_manual_seed(3)
    megatron_patches.revert(["tied_embedding_sync_on_cpu"])
    results["tied_pp2_without"] = _outcome(_tied_pipeline_build)
    megatron_patches.apply()
    results["tied_pp2_with"] = _outcome(_tied_pipeline_build)
    destroy_process_groups()
    return results


def _adam_setup(seed: int):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    config = tiny_config()
    model = tiny_gpt(config)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=True), module=model)
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=1e-2, bf16=False, fp16=False, use_distributed_optimizer=True, clip_grad=1.0), [ddp])
    return model, ddp, optimizer


def _adam_steps(ddp, optimizer, n: int) -> list:
    import torch.distributed as dist
    from megatron.core.pipeline_parallel import get_forward_backward_func

    tokens = torch.randint(0, 40, (2, 16), generator=torch.Generator().manual_seed(dist.get_rank()))
    positions = torch.arange(16).expand(2, -1)

    def forward_step(data_iterator, module):
        out = module(tokens, positions, None, labels=tokens)
        return out, lambda o: (o.mean(), {"loss": o.mean().detach()})

    losses = []
    for _ in range(n):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        (result,) = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=None, model=[ddp],
                                                num_microbatches=1, seq_length=16, micro_batch_size=2)
        optimizer.step()
        losses.append(result["loss"].item())
    return losses


def _sharded(model, optimizer, loading: bool):
    msd = model.sharded_state_dict()
    meta = {"distrib_optim_sharding_type": "fully_reshardable"}
    return {"model": msd, "optimizer": optimizer.sharded_state_dict(msd, is_loading=loading, metadata=meta)}


def _load(model, optimizer, directory: str) -> None:
    from megatron.core import dist_checkpointing

    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner._init_optimizer_states_with_dummy_values()  # torch Adam has no state before its first step
    state = dist_checkpointing.load(_sharded(model, optimizer, True), directory)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])


def distributed_optimizer_resume(directory: str) -> dict:
    """DP2 + distributed optimizer (torch Adam): resume from a checkpoint continues exactly like no stop."""
    from megatron.core import dist_checkpointing, parallel_state

    from mrl.cpu import megatron_patches
    from mrl.parallel.layout import ParallelDims
    from mrl.parallel.groups import destroy_process_groups, init_process_groups

    init_process_groups(ParallelDims(world_size=2), seed=11)
    groups = {
        "dp": parallel_state.get_data_parallel_world_size(),
        "tp": parallel_state.get_tensor_model_parallel_world_size(),
        "dp_ranks": sorted(torch.distributed.get_process_group_ranks(parallel_state.get_data_parallel_group())),
    }
    model, ddp, optimizer = _adam_setup(11)
    _adam_steps(ddp, optimizer, 2)
    dist_checkpointing.save(_sharded(model, optimizer, False), directory)
    uninterrupted = _adam_steps(ddp, optimizer, 3)

    megatron_patches.revert(["distributed_optimizer_torch_adam_state"])
    model, ddp, optimizer = _adam_setup(12)
    try:
        _load(model, optimizer, directory)
        without = "loaded"
    except KeyError as error:
        without = f"KeyError: {error}"
    megatron_patches.apply()

    model, ddp, optimizer = _adam_setup(13)  # different init: everything must come from the checkpoint
    _load(model, optimizer, directory)
    step_tensors = {id(s["step"]) for inner in optimizer.chained_optimizers for s in inner.optimizer.state.values()}
    resumed = _adam_steps(ddp, optimizer, 3)
    destroy_process_groups()
    return {"groups": groups, "uninterrupted": uninterrupted, "resumed": resumed, "without": without,
            "distinct_steps": len(step_tensors) > 1}


def grouped_experts_equal_sequential(model_dir: str, ep: int) -> dict:
    """One forward and backward of the tiny MoE model in `model_dir` with its routed experts as megatron-core's
    SequentialMLP and as mrl's GroupedGemmExperts (the same HF weights, this EP rank's experts): the largest
    differences of the logits and of every gradient, and the experts' class of each build."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    from mrl.model.build import build_model, load_hf_weights, transformer_config_from_hf
    from mrl.parallel.groups import init_process_groups
    from mrl.parallel.layout import ParallelDims

    init_process_groups(ParallelDims(ep=ep, world_size=ep))
    hf_config = json.loads((Path(model_dir) / "config.json").read_text())
    weights = load_file(str(Path(model_dir) / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, hf_config["vocab_size"], (2, 24), generator=g)
    positions = torch.arange(24).expand(2, 24)
    runs = {}
    for grouped in (False, True):
        config = transformer_config_from_hf(hf_config, expert_model_parallel_size=ep)
        model = build_model(hf_config, config, grouped_experts=grouped)
        load_hf_weights(model, weights, hf_config)
        logits = model(ids, positions, None)  # [b, s, V]
        (logits.float().logsumexp(-1).mean() - logits[..., 3].mean()).backward()
        experts = {f"{type(m).__name__}: {getattr(m, 'loop_reason', None) or 'no fallback'}"
                   for name, m in model.named_modules() if name.endswith("mlp.experts")}
        runs[grouped] = (logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                           if p.grad is not None}, experts)
    (seq_logits, seq_grads, seq_experts), (grp_logits, grp_grads, grp_experts) = runs[False], runs[True]
    assert seq_grads.keys() == grp_grads.keys()
    return {"logits": (seq_logits - grp_logits).abs().max().item(),
            "grads": max((seq_grads[n] - grp_grads[n]).abs().max().item() for n in seq_grads),
            "expert_grads": sum(1 for n in seq_grads if "local_experts" in n and seq_grads[n].abs().sum() > 0),
            "experts": (sorted(seq_experts), sorted(grp_experts))}
