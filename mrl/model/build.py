"""Megatron-Core model construction from a Hugging Face config, reproducing the HF forward exactly.

The HF config is read once into `converters.ModelDims` (the same record the weight mapping uses), then turned
into a TransformerConfig + layer spec:
- RMSNorm with the HF epsilon, SwiGLU MLP (gated_linear_unit, SiLU), no linear biases except QKV (Qwen2);
- kv_channels = head_dim (Qwen3 and others decouple it from hidden/heads), num_query_groups = kv heads (GQA);
- qk_layernorm for Qwen3's per-head q/k RMSNorm;
- RoPE: base from the config; scaled rope types (linear, llama3, yarn) get the HF inverse frequencies installed on
  the model's RotaryEmbedding after construction, so every type goes through the one formula HF uses; YaRN's cos/sin
  factor becomes the softmax scale (`rope_attention_factor`);
- tied embeddings -> share_embeddings_and_output_weights; vocabulary padded (see converters.resolve_padded_vocab).
- reward models (`*ForSequenceClassification`, `dims.score_head`): the output layer is a column-parallel [rows, h]
  score head (`converters.score_rows(tp)` rows, row 0 the score) instead of the vocabulary projection.
- mixture of experts (`dims.moe`): the routed experts, router score function (softmax: Qwen3-MoE; sigmoid with a
  selection bias, group-limited top-k and a scaling factor: DeepSeek-V3), shared expert and which layers are MoE,
  with the RL router settings (`policy.moe`: router dtype, no auxiliary loss, frozen expert bias by default);
- multi-latent attention (`dims.mla`): MLATransformerConfig with DeepSeek-V3's ranks and head dims; its YaRN (or
  plain) rope is Megatron's own, which reproduces transformers' (inverse frequencies, cos/sin concentration factor,
  softmax scale).
Both build per-layer specs (`mrl.parallel.attention.gpt_layer_spec`), with `TorchCoreAttention` on CPU, and
the model is megatron-core's HybridModel, each transformer layer an attention and an MLP layer (`mrl.model.hybrid`).

Backends: the Megatron *local* spec on CPU (every fusion off; `mrl.cpu.megatron_patches.apply()` patches Megatron's
unconditional CUDA calls), the Transformer Engine spec when TE is importable and CUDA is available.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from converters import ModelDims, hf_to_megatron, model_dims, resolve_padded_vocab, select_ep_experts, select_pp_stage
from converters.layers import SpecNames
from mrl.model import hybrid
from mrl.parallel.attention import gpt_layer_spec, transformer_engine_available


def rope_inv_freq(dims: ModelDims) -> torch.Tensor:
    """RoPE inverse frequencies [head_dim/2], float32, exactly as transformers computes them.

    default: 1 / theta^(2i/d); linear: divided by `factor`; llama3: low frequencies divided by `factor`, high ones
    kept, the band between interpolated (wavelength thresholds from original_max_position_embeddings).
    """
    dim = dims.head_dim
    inv_freq = 1.0 / (dims.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    params = dims.rope_parameters
    if dims.rope_type == "default":
        return inv_freq
    if dims.rope_type == "linear":
        return inv_freq / params["factor"]
    if dims.rope_type == "llama3":
        factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
        old_len = params["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(is_medium, smoothed, scaled)
    if dims.rope_type == "yarn":
        return _yarn_inv_freq(inv_freq, dims)
    raise ValueError(f"rope_type {dims.rope_type!r} is not supported")  # model_dims() rejects it earlier


def _yarn_factor(dims: ModelDims) -> float:
    """YaRN's context extension factor; a config without one implies max / original max positions (as HF)."""
    params = dims.rope_parameters
    if params.get("factor") is not None:
        return float(params["factor"])
    return dims.max_position_embeddings / _yarn_original_length(dims)


def _yarn_original_length(dims: ModelDims) -> int:
    return int(dims.rope_parameters.get("original_max_position_embeddings") or dims.max_position_embeddings)


def _yarn_inv_freq(inv_freq: torch.Tensor, dims: ModelDims) -> torch.Tensor:
    """YaRN (arXiv 2309.00071) as transformers computes it: frequencies that turn fewer than `beta_slow` times over
    the original context are interpolated (divided by the factor), those turning more than `beta_fast` times are
    kept, with a linear ramp over the dims between (the correction range, floored/ceiled unless truncate=False)."""
    params, dim = dims.rope_parameters, dims.head_dim
    base, factor, old_len = dims.rope_theta, _yarn_factor(dims), _yarn_original_length(dims)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # the dim whose wavelength turns `rotations` times in old_len
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp  # 1: keep the frequency, 0: interpolate it
    return inv_freq / factor * (1 - extrapolate) + inv_freq * extrapolate


def context_length(dims: ModelDims) -> int:
    """Tokens the model serves, by vLLM's rule: max_position_embeddings, times the factor of linear rope scaling
    (YaRN and llama3 configs carry the extended length in max_position_embeddings already)."""
    if dims.rope_type == "linear":
        return int(dims.max_position_embeddings * float(dims.rope_parameters["factor"]))
    return dims.max_position_embeddings


def rope_attention_factor(dims: ModelDims) -> float:
    """The factor transformers multiplies RoPE's cos and sin by (YaRN's `attention_factor`, 1 otherwise).

    Given, or from the factor: 0.1 ln(factor) + 1, or the ratio of that with `mscale` / `mscale_all_dim` when both
    are set (DeepSeek's form). Multi-latent attention applies it inside Megatron's own YaRN instead."""
    params = dims.rope_parameters
    if dims.rope_type != "yarn":
        return 1.0
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor = _yarn_factor(dims)

    def mscale(weight: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * weight * math.log(factor) + 1.0

    if params.get("mscale") and params.get("mscale_all_dim"):
        return mscale(float(params["mscale"])) / mscale(float(params["mscale_all_dim"]))
    return mscale()


def transformer_config_from_hf(
    hf_config: Mapping[str, Any] | Any,
    *,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    context_parallel: int = 1,
    sequence_parallel: bool = False,
    params_dtype: torch.dtype = torch.float32,
    use_te: bool | None = None,
    compiled_fusions: bool | None = None,
    **overrides: Any,
) -> Any:
    """The Megatron TransformerConfig of an HF model. `overrides` go to TransformerConfig, counted in transformer
    layers as HF counts them (`num_layers`, the first/last pipeline stage's layers, a per-layer `moe_layer_freq`);
    the config counts the HybridModel's layers, two per transformer layer (`mrl.model.hybrid`). Without Transformer
    Engine, `compiled_fusions` (None: on a GPU where torch.compile works) runs SwiGLU and RoPE as kernels
    torch.compile generates (`compiled_fusion_flags`)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    dims = model_dims(hf_config)
    te = transformer_engine_available() if use_te is None else use_te
    fusions = te  # the fused kernels need CUDA (and mostly TE/Apex); on CPU every fusion is off
    compiled = not te and (torch_compile_works_here() if compiled_fusions is None else compiled_fusions)
    kwargs: dict[str, Any] = dict(
        num_layers=dims.num_layers,
        hidden_size=dims.hidden_size,
        ffn_hidden_size=dims.ffn_hidden_size,
        num_attention_heads=dims.num_heads,
        num_query_groups=dims.num_kv_heads,
        kv_channels=dims.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=dims.norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=dims.qkv_bias,
        qk_layernorm=dims.qk_norm or dims.mla is not None,  # MLA: the q/kv latent norms
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        apply_query_key_layer_scaling=False,
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        context_parallel_size=context_parallel,
        sequence_parallel=sequence_parallel,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=not torch.cuda.is_available(),
        gradient_accumulation_fusion=False,
        bias_activation_fusion=fusions,
        masked_softmax_fusion=fusions,
        bias_dropout_fusion=fusions,
        apply_rope_fusion=fusions,
        persist_layer_norm=fusions,
        # Which backend megatron-core asks for modules it picks itself (0.19: MLA's q/kv projections): TE's only
        # where TE is used, the local one otherwise (TE's names are stand-ins without TE).
        transformer_impl="transformer_engine" if te else "local",
    )
    kwargs.update(_moe_kwargs(dims) if dims.moe else {})
    kwargs.update(_mla_kwargs(dims) if dims.mla else _rope_scale_kwargs(dims))
    kwargs.update(compiled_fusion_flags(dims, context_parallel) if compiled else {})
    kwargs.update(overrides)
    kwargs = hybrid.gpt_config_fields(kwargs)  # the model is a HybridModel: two layers per transformer layer
    if dims.mla:
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        return MLATransformerConfig(**kwargs)
    return TransformerConfig(**kwargs)


def torch_compile_works_here() -> bool:
    """Whether torch.compile generates kernels on this process's GPU (False without one)."""
    from mrl.model.compiled_kernels import inductor_works

    return torch.cuda.is_available() and inductor_works()


def compiled_fusion_flags(dims: ModelDims, context_parallel: int) -> dict[str, bool]:
    """TransformerConfig's fusion flags for kernels torch.compile generates, without Transformer Engine:
    megatron-core's SwiGLU fusion (its `jit_fuser` is torch.compile) and the fused RoPE that
    `mrl.model.compiled_kernels` provides in TE's place. Those cover neither context parallelism nor multi-latent
    attention (whose latent rotation megatron-core sends to TE-only kernels under the flag): RoPE stays unfused
    there."""
    from mrl.model.compiled_kernels import provide_rope_kernels

    rope = dims.mla is None and context_parallel == 1 and provide_rope_kernels()
    return {"bias_activation_fusion": True, "apply_rope_fusion": rope}


def _rope_scale_kwargs(dims: ModelDims) -> dict[str, Any]:
    """YaRN's cos/sin factor m scales q and k, so q.k by m^2: the same as a softmax scale m^2 / sqrt(head_dim)."""
    factor = rope_attention_factor(dims)
    return {} if factor == 1.0 else {"softmax_scale": factor**2 / math.sqrt(dims.head_dim)}


def _moe_kwargs(dims: ModelDims) -> dict[str, Any]:
    """TransformerConfig fields of the experts, reproducing the HF router (see converters/family.py `MoEDims`).

    Defaults for RL (the router settings a run may override with `policy.moe`): router in fp32 (HF's DeepSeek-V3
    router computes in fp32 too), no load-balancing loss, an expert bias that is not updated during training. The
    all-to-all dispatcher with grouped GEMM and permute fusion off is the combination that runs on CPU.
    """
    moe = dims.moe
    assert moe is not None
    kwargs: dict[str, Any] = dict(
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.topk,
        moe_ffn_hidden_size=moe.ffn_hidden_size,
        moe_layer_freq=[int(is_moe) for is_moe in moe.layers],  # a list: Megatron reads an int N as i % N == 0
        moe_router_score_function=moe.score_function,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_router_dtype="fp32",
    )
    if moe.score_function == "softmax":  # top-k of the logits, softmax over the k = HF's renormalised top-k
        kwargs["moe_router_pre_softmax"] = not moe.normalize_topk
    if moe.scaling_factor != 1.0:
        kwargs["moe_router_topk_scaling_factor"] = moe.scaling_factor
    if moe.expert_bias:
        kwargs.update(moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.0)
    if moe.num_groups:
        kwargs.update(moe_router_num_groups=moe.num_groups, moe_router_group_topk=moe.group_topk)
    if moe.shared_ffn_hidden_size:
        kwargs["moe_shared_expert_intermediate_size"] = moe.shared_ffn_hidden_size
        kwargs["moe_shared_expert_gate"] = moe.shared_expert_gate  # Qwen2-MoE: sigmoid(x . w) * shared(x)
    return kwargs


def _mla_kwargs(dims: ModelDims) -> dict[str, Any]:
    """MLATransformerConfig fields of multi-latent attention and its rope (Megatron applies it inside attention)."""
    mla, rope = dims.mla, dims.rope_parameters
    assert mla is not None
    kwargs: dict[str, Any] = dict(
        multi_latent_attention=True,
        q_lora_rank=mla.q_lora_rank,
        kv_lora_rank=mla.kv_lora_rank,
        qk_head_dim=mla.qk_nope_head_dim,
        qk_pos_emb_head_dim=mla.qk_rope_head_dim,
        v_head_dim=mla.v_head_dim,
        kv_channels=mla.v_head_dim,
        rotary_base=dims.rope_theta,
    )
    if dims.rope_type != "yarn":
        return {**kwargs, "rope_type": "rope", "rotary_scaling_factor": 1.0}
    return {
        **kwargs,
        "rope_type": "yarn",
        "rotary_scaling_factor": float(rope["factor"]),
        "original_max_position_embeddings": int(rope["original_max_position_embeddings"]),
        "beta_fast": float(rope.get("beta_fast") or 32),
        "beta_slow": float(rope.get("beta_slow") or 1),
        "mscale": float(rope.get("mscale") or 1.0),
        "mscale_all_dim": float(rope.get("mscale_all_dim") or 0.0),
    }


def router_settings(
    dims: ModelDims,
    *,
    expert_parallel: int = 1,
    router_dtype: str = "fp32",
    aux_loss_coeff: float = 0.0,
    expert_bias_update_rate: float = 0.0,
) -> dict[str, Any]:
    """TransformerConfig overrides of a run's expert layout and router settings (`policy.moe`); {} for a dense
    model. A load-balancing loss is added only with a positive coefficient."""
    if dims.moe is None:
        return {}
    settings: dict[str, Any] = dict(
        expert_model_parallel_size=expert_parallel,
        moe_router_dtype=router_dtype,
        moe_aux_loss_coeff=aux_loss_coeff,
        moe_router_load_balancing_type="aux_loss" if aux_loss_coeff > 0 else "none",
    )
    if dims.moe.expert_bias:
        settings["moe_router_bias_update_rate"] = expert_bias_update_rate
    return settings


def freeze_routers(model: Any) -> int:
    """Routers get no gradient and no optimizer update (`policy.moe.freeze_router`: in RL the routing then moves
    only through the experts, and the engine routes as the trainer does). Returns the number of frozen tensors."""
    frozen = [param for name, param in model.named_parameters() if ".router." in name]
    for param in frozen:
        param.requires_grad_(False)
    return len(frozen)


def moe_transformer_config(
    hf_config: Mapping[str, Any] | Any,
    *,
    num_experts: int,
    router_topk: int = 2,
    moe_ffn_hidden_size: int | None = None,
    expert_parallel: int = 1,
    **kwargs: Any,
) -> Any:
    """The TransformerConfig of a mixture-of-experts variant of a dense HF model: every MLP becomes `num_experts`
    SwiGLU experts (hidden `moe_ffn_hidden_size`, default the dense size) behind a top-`router_topk` softmax router.

    Dropless (no capacity factor) and without auxiliary or load-balancing loss, so each token's output depends on
    that token alone, whatever the expert-parallel layout. The all-to-all dispatcher with grouped GEMM and permute
    fusion off is the combination that runs on CPU (`mrl.cpu.megatron_patches` MoE patches); the router runs in fp32.
    No HF converter maps MoE weights yet: such a model starts from Megatron's initialisation (or a Megatron
    checkpoint). `kwargs` go to `transformer_config_from_hf` (parallel sizes, dtype, TransformerConfig overrides).
    """
    moe = dict(
        num_moe_experts=num_experts,
        moe_router_topk=router_topk,
        moe_ffn_hidden_size=moe_ffn_hidden_size or model_dims(hf_config).ffn_hidden_size,
        expert_model_parallel_size=expert_parallel,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_router_dtype="fp32",
    )
    return transformer_config_from_hf(hf_config, **{**moe, **kwargs})


def build_model(
    hf_config: Mapping[str, Any] | Any,
    config: Any,
    *,
    padded_vocab: int | None = None,
    pre_process: bool | None = None,
    post_process: bool | None = None,
    use_te: bool | None = None,
    vp_stage: int | None = None,
    grouped_experts: bool = False,
) -> Any:
    """The transformer of the HF model as megatron-core's HybridModel (this rank's TP shard and PP stage; pattern
    `*-` or `*E` per transformer layer, `mrl.model.hybrid`); weights are random until loaded.
    `grouped_experts`: the routed experts run as grouped GEMMs (`mrl.model.grouped_experts`: the same parameters),
    on the local spec or Transformer Engine's.

    Model-parallel state must be initialised. pre/post_process default to whether this rank is the first/last
    pipeline stage. `padded_vocab` defaults to Megatron's rule for this TP size; pass the checkpoint's value when
    loading one written at another TP (the vocabulary size is part of the checkpoint's tensor shapes).
    """
    from megatron.core import parallel_state
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    from mrl.cpu import megatron_patches

    megatron_patches.apply()  # without CUDA every patch; with CUDA those for a missing TE, if it is
    dims = model_dims(hf_config)
    te = transformer_engine_available() if use_te is None else use_te
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    layer_spec = gpt_layer_spec(config, use_te=te)
    if grouped_experts:
        from mrl.model.grouped_experts import use_grouped_experts  # imports Megatron: after megatron_patches.apply()

        use_grouped_experts(layer_spec)
    pattern = hybrid.layer_pattern(config)  # before the split moves into it
    with hybrid.split_by_pattern(config):
        model = HybridModel(
            config=config,
            hybrid_stack_spec=hybrid.stack_spec(getattr(layer_spec, "layer_specs", [layer_spec])),
            vocab_size=resolve_padded_vocab(dims, tp, padded_vocab),
            max_sequence_length=dims.max_position_embeddings,
            hybrid_layer_pattern=pattern,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=dims.tied,
            position_embedding_type="rope",
            rotary_percent=1.0,
            rotary_base=dims.rope_theta,
            vp_stage=vp_stage,
        )
    if dims.mla is None:  # MLA applies its own rope inside attention
        device = model.rotary_pos_emb.inv_freq.device
        model.rotary_pos_emb.inv_freq = rope_inv_freq(dims).to(device)  # exact HF frequencies for every rope type
    if dims.score_head and post_process:
        model.output_layer = _score_head(config, tp, model.pg_collection.tp)
    _params_in_dtype(model, config.params_dtype)
    if torch.cuda.is_available():
        # Megatron's parallel layers allocate on the GPU (use_cpu_initialization=False), its torch norms
        # (no TE, no Apex) and the score head on the default device, the CPU: every module goes to this rank's
        # GPU, as Megatron's own trainer does after building (megatron/training/training.py get_model:
        # model_module.cuda(torch.cuda.current_device())). Seen on an H100 without TE: rms_norm's weight on cpu.
        model.cuda(torch.cuda.current_device())
    return model


def _params_in_dtype(model: Any, dtype: torch.dtype) -> None:
    """Every floating parameter in the model's `params_dtype`, as Megatron's own trainer has them (its Float16Module
    casts the whole model). Without Transformer Engine or Apex the local spec's norms are torch's, made in the
    default dtype (fp32) whatever `params_dtype` says; Megatron's mixed-precision optimizers then number the
    parameters of a checkpoint inconsistently and a bf16 save fails, on CPU and on GPUs alike. In megatron-core
    0.19.2 the plain one (`Float16OptimizerWithFloat16Params.sharded_state_dict`) maps ids over its bf16 parameters
    alone; the distributed one finds a parameter's state by its place among its group's parameters in buffer order
    (`_build_optimizer_group_ranges`), while its inner optimizer lists the fp32 parameters' shards first
    (`_build_model_and_main_param_groups`), so the two orders can disagree when a group mixes dtypes."""
    for param in model.parameters():
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)


def _score_head(config: Any, tp: int, tp_group: Any) -> Any:
    """A reward model's output layer: hidden -> `score_rows(tp)` values, split over TP like the vocabulary (not
    gathered: `mrl.policy.logprobs.score_values` gathers and keeps row 0)."""
    from megatron.core import tensor_parallel

    from converters import score_rows

    return tensor_parallel.ColumnParallelLinear(
        config.hidden_size,
        score_rows(tp),
        config=config,
        init_method=config.init_method,
        bias=False,
        skip_bias_add=False,
        gather_output=False,
        tp_group=tp_group,
    )


def stage_layer_offset(model: Any) -> int:
    """Global index of this pipeline stage's first transformer layer (GPT's and HF's index, not the hybrid one)."""
    return hybrid.stage_gpt_layers(model)[0]


def check_expert_layout() -> None:
    """Experts are split over TP like the dense layers (expert tensor parallel size = TP size, Megatron's default):
    a rank's expert shard is the one its TP rank gives."""
    from megatron.core import parallel_state as ps

    if (ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()) != (
        ps.get_tensor_model_parallel_world_size(),
        ps.get_tensor_model_parallel_rank(),
    ):
        raise ValueError("expert tensor parallelism other than the tensor-parallel layout is not supported")


def load_hf_weights(
    model: Any,
    hf_state: Mapping[str, torch.Tensor],
    hf_config: Mapping[str, Any] | Any,
    *,
    names: SpecNames | None = None,
) -> None:
    """Copy an HF state dict into this rank's model (its TP shard, its PP stage's layers, its EP rank's experts).

    Every model parameter must be covered and every converted tensor used: a mismatch raises naming the keys.
    `names` ("local" | "te") defaults to the spec the model was built with.
    """
    from megatron.core import parallel_state

    dims = model_dims(hf_config)
    own = {k for k in model.state_dict() if not k.endswith("_extra_state")}
    if names is None:
        names = "te" if any(k.endswith("layer_norm_weight") for k in own) else "local"  # TE fuses norms (MLA too)
    full = hf_to_megatron(
        hf_state,
        dims,
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_world_size(),
        padded_vocab=model.vocab_size,
        names=names,  # the model's vocab_size: the global padded size
    )
    offset, layers = hybrid.stage_gpt_layers(model)
    stage = select_pp_stage(
        full,
        offset,
        layers,
        pre_process=model.pre_process,
        post_process=model.post_process,
        tied=dims.tied,
    )
    if dims.moe is not None:
        check_expert_layout()
        stage = select_ep_experts(
            stage,
            dims,
            parallel_state.get_expert_model_parallel_rank(),
            parallel_state.get_expert_model_parallel_world_size(),
        )
    if dims.tied and "output_layer.weight" not in own:
        stage.pop("output_layer.weight", None)
    stage = {hybrid.to_hybrid(name): tensor for name, tensor in stage.items()}
    if set(stage) != own:
        raise ValueError(
            f"converted state does not match the model: missing {sorted(own - set(stage))[:8]}, "
            f"unexpected {sorted(set(stage) - own)[:8]}"
        )
    model.load_state_dict(stage, strict=False)
