"""Transformer Engine parameter names for every family, tested without Transformer Engine.

(a) The name tables: megatron-core 0.19.2's own TE layer specs (`get_gpt_layer_with_transformer_engine_spec`, through
mrl's `gpt_layer_spec(config, use_te=True)`) are built without TE installed, where megatron-core leaves its TE
classes as MagicMock stand-ins, and walked into the parameter names the layers would hold; they must be exactly the
converters' `names="te"` rules. Only the parameter names of each TE class are written by hand (`_TE_PARAMS`).
(b) A TE-named checkpoint (HF -> Megatron with `names="te"`) renamed by megatron-core's own TE -> local load hook,
loaded strictly into a local-spec GPTModel built by mrl, read back and converted to HF: bit-exact to the HF model;
and the local model's state renamed the other way is the TE-named checkpoint again.
"""

from __future__ import annotations


import pytest
import torch

import converters as C
from converters.hf_io import load_hf_config, load_hf_state
from converters.layers import TE_RENAMES, layer_rules, te_renames
from mrl.testing.tiny_models import build_tiny_hf_model

#: Every family and structure mrl converts: dense GQA (Llama), with a QKV bias (Qwen2), with q/k norms (Qwen3),
#: MoE without shared experts (Qwen3-MoE), with a gated shared expert (Qwen2-MoE), MLA with a q LoRA, a dense first layer, shared experts and an expert bias
#: (DeepSeek-V3), and MLA without a q LoRA (linear_q_proj).
FAMILIES = {
    "llama": ("llama", dict(num_kv_heads=2)),
    "qwen2": ("qwen2", dict(num_kv_heads=2)),
    "qwen3": ("qwen3", dict(num_kv_heads=2)),
    "qwen3_moe": ("qwen3_moe", dict(num_kv_heads=2, num_experts=4)),
    "qwen2_moe": ("qwen2_moe", dict(num_kv_heads=2, num_experts=4)),
    "deepseek_v3": ("deepseek_v3", dict(n_routed_experts=4)),
    "deepseek_v3-no-q-lora": ("deepseek_v3", dict(n_routed_experts=4, q_lora_rank=None)),
}


NO_FUSIONS = dict(bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
                  apply_rope_fusion=False, persist_layer_norm=False)


@pytest.fixture(scope="module")
def megatron_world_of_one():
    from mrl.parallel.groups import destroy_process_groups, init_process_groups
    from mrl.parallel.layout import ParallelDims

    init_process_groups(ParallelDims(), seed=0)
    yield
    destroy_process_groups()


@pytest.fixture(scope="module", params=list(FAMILIES))
def tiny(request, tmp_path_factory) -> tuple[dict[str, torch.Tensor], dict]:
    family, overrides = FAMILIES[request.param]
    path = build_tiny_hf_model(tmp_path_factory.mktemp(request.param), family, hidden=32, layers=2, heads=2,
                               intermediate=32, **overrides)
    return load_hf_state(path), load_hf_config(path)


# ----------------------------------------------------------------------------------------- (a) the name tables
def _te_params():
    """The parameters each TE module class holds (bias-free, RMSNorm, as mrl builds them), by the class objects
    megatron-core exports (MagicMock stand-ins without TE: compared by identity).

    TELayerNormColumnParallelLinear is TE's LayerNormLinear: its norm is `layer_norm_weight`, the name megatron-core
    itself reads (transformer/transformer_layer.py) and renames (post_training/modelopt/gpt/state_dict_hooks.py).
    TENorm (RMSNorm; `_TENormWithResidual` is TENorm built with `has_residual=True`, a plain TE RMSNorm unless
    `fused_residual_rmsnorm` is set), TELinear and its column / row parallel subclasses hold `weight`.
    """
    from megatron.core.extensions import transformer_engine as te
    from megatron.core.extensions import transformer_engine_spec_provider as provider

    return [(te.TELayerNormColumnParallelLinear, ("layer_norm_weight", "weight")), (te.TENorm, ("weight",)),
            (provider._TENormWithResidual, ("weight",)), (te.TELinear, ("weight",)),
            (te.TEColumnParallelLinear, ("weight",)), (te.TERowParallelLinear, ("weight",))]


def _params_of(module, prefix: str, bias: bool = False) -> list[str]:
    from megatron.core.transformer.identity_op import IdentityOp

    if module is IdentityOp:
        return []
    for cls, params in _te_params():
        if module is cls:
            return [prefix + p for p in params] + ([prefix + "bias"] if bias else [])
    raise AssertionError(f"{prefix}: not a TE module of the table: {module!r}")


def _built_by(builder):
    """The class an mlp builder makes and its submodules: megatron-core 0.19.2's builders are
    functools.partial(MLP.as_mlp_submodule | MoELayer | SequentialMLP | _build_shared_experts, submodules=...)."""
    return getattr(builder.func, "__self__", builder.func), builder.keywords["submodules"]


def _linear_names(sub, prefix: str) -> list[str]:
    return _params_of(sub.linear_fc1, prefix + "linear_fc1.") + _params_of(sub.linear_fc2, prefix + "linear_fc2.")


def _mlp_names(spec, config, prefix: str) -> list[str]:
    """Names of an MLP / MoELayer builder (megatron-core 0.19.2 transformer/mlp.py, transformer/moe/moe_layer.py)."""
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer

    built, sub = _built_by(spec)
    if built is not MoELayer:
        return _linear_names(sub, prefix)
    # moe_layer.py: self.router = TopKRouter (weight; expert_bias with moe_router_enable_expert_bias), then experts
    names = [prefix + "router.weight"] + ([prefix + "router.expert_bias"] if config.moe_router_enable_expert_bias
                                         else [])
    experts, expert_sub = _built_by(sub.experts)
    assert experts is SequentialMLP  # moe_grouped_gemm=False: one MLP per expert, local_experts.{e}
    for e in range(config.num_moe_experts):
        names += _linear_names(expert_sub, f"{prefix}experts.local_experts.{e}.")
    if config.moe_shared_expert_intermediate_size:
        names += _linear_names(_built_by(sub.shared_experts)[1], prefix + "shared_experts.")
        if config.moe_shared_expert_gate:  # transformer/moe/shared_experts.py: a Parameter of the module
            names.append(prefix + "shared_experts.gate_weight")
    return names


def _attention_names(spec, config, prefix: str) -> list[str]:
    """Names of a SelfAttention / MLASelfAttention spec. MLA builds linear_q_proj without a q LoRA, else
    linear_q_down_proj, q_layernorm, linear_q_up_proj, with the classes megatron-core's own resolver picks from the
    spec (transformer/mla_qk_norm_config.py, as MLASelfAttention.__init__ calls it)."""
    from megatron.core.transformer.mla_qk_norm_config import QKNormConfigResolver
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    sub = spec.submodules
    if spec.module is not MLASelfAttention:
        return (_params_of(sub.linear_qkv, prefix + "linear_qkv.", bias=config.add_qkv_bias)
                + _params_of(sub.linear_proj, prefix + "linear_proj.")
                + _params_of(sub.q_layernorm, prefix + "q_layernorm.")
                + _params_of(sub.k_layernorm, prefix + "k_layernorm."))
    resolved = QKNormConfigResolver(config, sub).resolve()
    if config.q_lora_rank is None:
        names = _params_of(resolved["linear_q_proj"], prefix + "linear_q_proj.")
    else:
        names = (_params_of(sub.linear_q_down_proj, prefix + "linear_q_down_proj.")
                 + _params_of(resolved["q_layernorm"], prefix + "q_layernorm.")
                 + _params_of(resolved["linear_q_up_proj"], prefix + "linear_q_up_proj."))
    return names + (_params_of(sub.linear_kv_down_proj, prefix + "linear_kv_down_proj.")
                    + _params_of(resolved["kv_layernorm"], prefix + "kv_layernorm.")
                    + _params_of(resolved["linear_kv_up_proj"], prefix + "linear_kv_up_proj.")
                    + _params_of(sub.linear_proj, prefix + "linear_proj."))


def _layer_names(spec, config, prefix: str) -> list[str]:
    sub = spec.submodules
    return (_params_of(sub.input_layernorm, prefix + "input_layernorm.")
            + _attention_names(sub.self_attention, config, prefix + "self_attention.")
            + _params_of(sub.pre_mlp_layernorm, prefix + "pre_mlp_layernorm.")
            + _mlp_names(sub.mlp, config, prefix + "mlp."))


@pytest.fixture
def te_spec_without_te(monkeypatch):
    """megatron-core's TE spec functions, callable without TE: gpt_layer_specs imports TESpecProvider and TENorm only
    when TE imports (L42-48), and the provider asks TE's version (taken as a current TE, >= 1.9: TENorm for q/k
    norms and TE linears for the experts, transformer_engine_spec_provider.py L50, L80)."""
    from megatron.core.extensions import transformer_engine as te
    from megatron.core.extensions import transformer_engine_spec_provider as provider
    from megatron.core.models.gpt import gpt_layer_specs

    monkeypatch.setattr(gpt_layer_specs, "TESpecProvider", provider.TESpecProvider, raising=False)
    monkeypatch.setattr(gpt_layer_specs, "TENorm", te.TENorm, raising=False)
    monkeypatch.setattr(provider, "is_te_min_version", lambda *args, **kwargs: True)


def test_te_names_are_those_of_megatron_cores_te_layer_spec(tiny, te_spec_without_te, megatron_world_of_one):
    from mrl.model.build import transformer_config_from_hf
    from mrl.parallel.attention import gpt_layer_spec

    hf, cfg = tiny
    dims = C.model_dims(cfg)
    config = transformer_config_from_hf(cfg, use_te=True, **NO_FUSIONS)  # the fused kernels need TE; names do not
    spec = gpt_layer_spec(config, use_te=True)
    # the config counts the HybridModel's layers, two per transformer layer: layer i's whole spec is the one at 2i+1
    layer_specs = spec.layer_specs[1::2] if hasattr(spec, "layer_specs") else [spec] * dims.num_layers
    for i, layer_spec in enumerate(layer_specs):
        want = _layer_names(layer_spec, config, f"decoder.layers.{i}.")
        assert sorted(r.megatron for r in layer_rules(dims, i, "te")) == sorted(want), i
    if dims.mla is not None:  # the MLA renames the review asked about: the norms go into the up projections only
        names = {r.megatron for r in C.param_rules(dims, "te")}
        assert "decoder.layers.0.input_layernorm.weight" in names
        assert ("decoder.layers.0.self_attention.linear_q_up_proj.layer_norm_weight" in names) == \
            (dims.mla.q_lora_rank is not None)
        assert "decoder.layers.0.self_attention.linear_kv_up_proj.layer_norm_weight" in names


def test_te_renames_table_is_megatron_cores_own_te_to_local_hook():
    """The four renames are exactly those megatron-core's load hook undoes (its bias and Mamba entries aside)."""
    from megatron.core.post_training.modelopt.gpt.state_dict_hooks import mcore_gpt_load_te_state_dict_pre_hook

    state = {f"decoder.layers.0.{r.te}": torch.zeros(1) for r in TE_RENAMES}
    mcore_gpt_load_te_state_dict_pre_hook(state, "", {}, True, [], [], [])
    assert sorted(state) == sorted(f"decoder.layers.0.{r.local}" for r in TE_RENAMES)
    assert all(r.source for r in TE_RENAMES)


# ------------------------------------------------------------------- (b) a TE checkpoint into the local spec and back
def test_te_checkpoint_loads_into_the_local_spec_and_back_bit_exact(tiny, megatron_world_of_one):
    from megatron.core.post_training.modelopt.gpt.state_dict_hooks import mcore_gpt_load_te_state_dict_pre_hook

    from mrl.model.build import build_model, transformer_config_from_hf
    from mrl.model.hybrid import to_gpt, to_hybrid

    hf, cfg = tiny
    dims = C.model_dims(cfg)
    te_state = C.hf_to_megatron(hf, cfg, names="te")
    assert {r.megatron for r in C.param_rules(dims, "te")} == set(te_state)
    # TE -> local by megatron-core's own hook, into a local-spec model built by mrl (strict: every key used)
    renamed = dict(te_state)
    mcore_gpt_load_te_state_dict_pre_hook(renamed, "", {}, True, [], [], [])
    model = build_model(cfg, transformer_config_from_hf(cfg, use_te=False, perform_initialization=False),
                            use_te=False)
    own = model.state_dict()
    extra = {k: v for k, v in own.items() if k.endswith("_extra_state")}
    model.load_state_dict({**{to_hybrid(k): v for k, v in renamed.items()}, **extra}, strict=True)
    local = {to_gpt(k): v.cpu() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    assert set(local) == {r.megatron for r in C.param_rules(dims, "local")}
    back = dict(C.megatron_to_hf(local, cfg))
    assert back.keys() == hf.keys()
    assert [k for k in hf if not torch.equal(back[k], hf[k])] == []
    # and back to TE names: the converters' local -> TE renames give the TE checkpoint again
    to_te = {}
    for i in range(dims.num_layers):
        to_te.update({f"decoder.layers.{i}.{a}": f"decoder.layers.{i}.{b}" for a, b in te_renames(dims, i).items()})
    again = {to_te.get(k, k): v for k, v in local.items()}
    assert again.keys() == te_state.keys()
    assert [k for k in te_state if not torch.equal(again[k], te_state[k])] == []
    assert dict(C.megatron_to_hf(again, cfg)).keys() == hf.keys()


def test_rule_for_knows_te_names_of_mla(tiny):
    hf, cfg = tiny
    dims = C.model_dims(cfg)
    for te_rule, local_rule in zip(C.param_rules(dims, "te"), C.param_rules(dims, "local")):
        assert C.rule_for(te_rule.megatron, dims) == te_rule
        assert te_rule.hf == local_rule.hf and te_rule.kind == local_rule.kind and te_rule.tp_dim == local_rule.tp_dim
