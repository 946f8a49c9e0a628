"""Cross-field rules of the config tree (the environments' in env_checks.py; pydantic's own errors become
ConfigErrors in validation_errors.py).

Rules the runtime applies too are not written here but called: the parallel layout, the length multiple and the
micro-batching rules (mrl.parallel.layout), pass@k (mrl.objectives.passk). Each is written once, so a config
this check accepts is one the workers run. Imports the schema for annotations only (schema.py calls this module).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from mrl.config.env_checks import environment_problems
from mrl.config.errors import ConfigError
from mrl.objectives.passk import pass_k_problem
from mrl.parallel.layout import (
    Violation,
    layout_violations,
    length_multiple,
    micro_batching_violations,
    pipeline_split_violations,
)

if TYPE_CHECKING:
    from mrl.config.schema import MrlConfig, PolicyConfig


def cross_field_problems(cfg: "MrlConfig") -> list[ConfigError]:
    """Every impossible combination in `cfg`, each naming the key to change."""
    return [
        *_parallel_problems(cfg),
        *_batch_problems(cfg),
        *_length_problems(cfg),
        *_misc_problems(cfg),
        *environment_problems(cfg),
        *_ppo_problems(cfg),
    ]


def _from_rule(violation: Violation, section: str = "policy.parallel") -> ConfigError:
    """The rule's violation as a config error; `section`: the parallel section it is about (its keys renamed)."""
    key = violation.key.replace("policy.parallel", section, 1)
    return ConfigError(violation.message, key=key, given=violation.given, allowed=violation.allowed, fix=violation.fix)


@dataclass(frozen=True)
class ModelFacts:
    """What the layout rules need to know of the policy model, before anything starts."""

    heads: int
    kv_heads: int
    layers: Optional[int]  # None: not stated
    experts: Optional[int]  # routed experts per MoE layer; None for a dense model
    latent_attention: bool = False  # multi-latent attention (DeepSeek-V3)


def model_facts(policy: "PolicyConfig") -> Optional[ModelFacts]:
    """The policy model's facts when known before start-up: from `build`, or the HF folder's config.json."""
    if policy.build is not None:
        b = policy.build
        return ModelFacts(
            b.num_attention_heads,
            b.num_key_value_heads or b.num_attention_heads,
            b.num_layers,
            b.num_experts if b.family == "qwen3_moe" else None,
        )
    cfg_file = Path(policy.model_name) / "config.json" if policy.model_name else None
    if cfg_file is None or not cfg_file.is_file():
        return None
    try:
        hf = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ConfigError(
            f"the model folder's config.json is not valid JSON ({error})",
            key="policy.model_name",
            given=policy.model_name,
            fix=f"repair or replace {cfg_file} (an HF model's config, as save_pretrained writes it)",
        ) from error
    if not isinstance(hf, dict):
        raise ConfigError(
            f"the model folder's config.json holds a {type(hf).__name__}, not an HF model's config (an object)",
            key="policy.model_name",
            given=policy.model_name,
            fix=f"repair or replace {cfg_file}",
        )
    heads, layers = hf.get("num_attention_heads"), hf.get("num_hidden_layers")
    if not isinstance(heads, int):
        return None
    experts = hf.get("num_experts") or hf.get("num_local_experts") or hf.get("n_routed_experts")
    return ModelFacts(
        heads,
        hf.get("num_key_value_heads") or heads,
        layers if isinstance(layers, int) else None,
        int(experts) if experts else None,
        latent_attention=bool(hf.get("kv_lora_rank")),
    )


def _model_problems(cfg: "MrlConfig", facts: ModelFacts) -> list[ConfigError]:
    """The configuration against the model: the policy's layout, its MoE settings, the engines'."""
    return _layout_problems(cfg, facts) + _moe_problems(cfg, facts) + _engine_model_problems(cfg, facts)


def _layout_problems(cfg: "MrlConfig", facts: ModelFacts) -> list[ConfigError]:
    """The policy's parallel sizes against the model: heads over TP, layers over PP, experts over EP."""
    par = cfg.policy.parallel
    tp, pp, ep = par.tensor_parallel_size, par.pipeline_parallel_size, par.expert_parallel_size
    out = []
    if facts.heads % tp:
        out.append(
            ConfigError(
                f"tensor parallel size does not divide the model's {facts.heads} attention heads",
                key="policy.parallel.tensor_parallel_size",
                given=tp,
                allowed=f"a divisor of {facts.heads}: {_divisors(facts.heads)}",
            )
        )
    elif facts.kv_heads % tp:
        out.append(
            ConfigError(
                f"tensor parallel size does not divide the model's {facts.kv_heads} key/value heads",
                key="policy.parallel.tensor_parallel_size",
                given=tp,
                allowed=f"a divisor of {facts.kv_heads}: {_divisors(facts.kv_heads)}",
            )
        )
    if facts.layers is not None:
        out += [
            _from_rule(v)
            for v in pipeline_split_violations(
                layers=facts.layers, pp=pp, first=par.first_stage_layers, last=par.last_stage_layers
            )
        ]
    if ep > 1 and facts.experts is None:
        out.append(
            ConfigError(
                "expert parallelism needs a mixture-of-experts model; this one is dense",
                key="policy.parallel.expert_parallel_size",
                given=ep,
                allowed="1",
            )
        )
    elif (facts.experts is not None or facts.latent_attention) and tp > 1 and not par.sequence_parallel:
        out.append(
            ConfigError(
                "mixture-of-experts and multi-latent-attention models train under tensor parallelism "
                "only with sequence parallelism (Megatron requires it for experts; MLA's rotary key "
                "gradient is summed over TP only then)",
                key="policy.parallel.sequence_parallel",
                given=False,
                fix="set policy.parallel.sequence_parallel=true",
            )
        )
    if facts.experts is not None and facts.experts % ep:
        out.append(
            ConfigError(
                f"expert parallel size does not divide the model's {facts.experts} experts",
                key="policy.parallel.expert_parallel_size",
                given=ep,
                allowed=f"a divisor of {facts.experts}: {_divisors(facts.experts)}",
            )
        )
    return out


def _moe_problems(cfg: "MrlConfig", facts: ModelFacts) -> list[ConfigError]:
    """The policy's mixture-of-experts settings against the model."""
    replay = cfg.policy.moe.router_replay
    if replay != "off" and facts.experts is None:
        return [
            ConfigError(
                "router replay needs a mixture-of-experts model; this one is dense",
                key="policy.moe.router_replay",
                given=replay,
                allowed="off",
            )
        ]
    return []


def _engine_model_problems(cfg: "MrlConfig", facts: ModelFacts) -> list[ConfigError]:
    """The generation engines' settings against the model: what the Megatron dynamic engine runs, vLLM's layout."""
    out = []
    if _dynamic_megatron_engine(cfg) and facts.latent_attention:
        out.append(
            ConfigError(
                "the Megatron dynamic engine does not run multi-latent attention models yet (its latent KV cache)",
                key="generation.megatron.engine",
                given="dynamic",
                allowed="static",
                fix="set generation.megatron.engine=static for this model",
            )
        )
    vllm_tp = cfg.generation.vllm.tensor_parallel_size
    if vllm_tp > 1 and facts.heads % vllm_tp:
        out.append(
            ConfigError(
                f"vLLM tensor parallel size does not divide the model's {facts.heads} heads",
                key="generation.vllm.tensor_parallel_size",
                given=vllm_tp,
                allowed=f"a divisor of {facts.heads}: {_divisors(facts.heads)}",
            )
        )
    vllm_pp = cfg.generation.vllm.pipeline_parallel_size
    if facts.layers is not None and vllm_pp > facts.layers:
        out.append(
            ConfigError(
                f"vLLM pipeline stages outnumber the model's {facts.layers} layers",
                key="generation.vllm.pipeline_parallel_size",
                given=vllm_pp,
                allowed=f"1 to {facts.layers}",
            )
        )
    return out


def _parallel_problems(cfg: "MrlConfig") -> list[ConfigError]:
    par = cfg.policy.parallel
    world = cfg.policy_world_size
    if world < 1:
        return [
            ConfigError(
                "the engine (and a teacher of its own) take every device, none is left for the policy",
                key="distillation.num_devices" if cfg.teacher_devices else "generation.num_devices",
                given=cfg.teacher_devices or cfg.generation.num_devices,
                allowed=f"< {cfg.cluster.num_nodes * cfg.cluster.devices_per_node} in all",
            )
        ]
    out = [_from_rule(v) for v in _layout_violations(par, world)]
    facts = model_facts(cfg.policy)
    if facts is not None:
        out += _model_problems(cfg, facts)
    return out


def _layout_violations(par: Any, world: int) -> list[Violation]:
    """The layout rules (mrl.parallel.layout) for the parallel section `par` on `world` ranks."""
    return layout_violations(
        tp=par.tensor_parallel_size,
        pp=par.pipeline_parallel_size,
        cp=par.context_parallel_size,
        ep=par.expert_parallel_size,
        sequence_parallel=par.sequence_parallel,
        world_size=world,
    )


def _batch_problems(cfg: "MrlConfig") -> list[ConfigError]:
    out = []
    pol = cfg.policy
    dp = max(cfg.data_parallel_size, 1)
    per_step = pol.train_micro_batch_size * dp
    if pol.train_global_batch_size % per_step:
        out.append(
            ConfigError(
                f"train_global_batch_size must be a multiple of train_micro_batch_size * data-parallel size "
                f"= {pol.train_micro_batch_size} * {dp} = {per_step}",
                key="policy.train_global_batch_size",
                given=pol.train_global_batch_size,
                allowed=f"a multiple of {per_step}",
            )
        )
    if cfg.stages and _runs(cfg, "grpo"):  # a plain config is checked by `mrl grpo` (rollout_problems)
        out += rollout_problems(cfg)
    out += _pair_problems(cfg, dp)
    pass_k = pass_k_problem(cfg.eval.pass_k, cfg.eval.num_samples)
    if pass_k:
        out.append(
            ConfigError(
                pass_k,
                key="eval.pass_k",
                given=cfg.eval.pass_k,
                allowed=f"values in 1..{cfg.eval.num_samples} (eval.num_samples)",
            )
        )
    return out


def rollout_problems(cfg: "MrlConfig") -> list[ConfigError]:
    """The rule of GRPO's batches: a step's rollouts split into whole optimizer batches (SFT, DPO and reward models
    have no rollouts: `mrl sft` with a batch that divides no GRPO default is fine)."""
    rollouts = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
    if not rollouts % cfg.policy.train_global_batch_size:
        return []
    return [
        ConfigError(
            f"the {rollouts} rollouts of a step (grpo.num_prompts_per_step * grpo.num_generations_per_prompt) must "
            "split into whole optimizer batches of policy.train_global_batch_size",
            key="policy.train_global_batch_size",
            given=cfg.policy.train_global_batch_size,
            allowed=f"a divisor of {rollouts}",
            fix="change policy.train_global_batch_size, grpo.num_prompts_per_step or grpo.num_generations_per_prompt",
        )
    ]


def _pair_problems(cfg: "MrlConfig", dp: int) -> list[ConfigError]:
    """DPO and reward models train on pairs kept whole in one micro-batch."""
    if not (cfg.stages and (_runs(cfg, "dpo") or _runs(cfg, "rm"))):
        return []  # a plain config is checked by its command (pair_problems), which knows what it runs
    return pair_problems(cfg, dp)


def pair_problems(cfg: "MrlConfig", dp: int) -> list[ConfigError]:
    """The rule of `mrl dpo` / `mrl rm`: even micro-batches (whole pairs)."""
    pol, out = cfg.policy, []
    for key in ("train_micro_batch_size", "logprob_micro_batch_size"):
        if getattr(pol, key) % 2:
            out.append(
                ConfigError(
                    "preference pairs (chosen + rejected) stay in one micro-batch: it needs an even "
                    "number of sequences",
                    key=f"policy.{key}",
                    given=getattr(pol, key),
                    allowed="an even number",
                )
            )
    return out


def _length_problems(cfg: "MrlConfig") -> list[ConfigError]:
    out = []
    pol = cfg.policy
    for section in (pol.sequence_packing, pol.dynamic_batching):
        budgets = {section.budget(), section.budget(logprob=True)}  # one where no logprob budget is set
        out += [
            ConfigError(
                "the token budget must hold the longest sequence (policy.max_total_sequence_length)",
                key=key,
                given=budget,
                allowed=f">= {pol.max_total_sequence_length}",
            )
            for key, budget in sorted(budgets)
            if section.enabled and budget < pol.max_total_sequence_length
        ]
    par = pol.parallel
    packing, dynamic = pol.sequence_packing, pol.dynamic_batching
    multiple = length_multiple(
        par.tensor_parallel_size, par.context_parallel_size, sequence_parallel=par.sequence_parallel
    )
    chosen = packing if packing.enabled else dynamic
    train_key = chosen.budget()[0]
    for key, budget in sorted({chosen.budget(), chosen.budget(logprob=True)}):
        out += [
            _from_rule(v)
            for v in micro_batching_violations(
                packing=packing.enabled,
                dynamic_batching=dynamic.enabled,
                pp=par.pipeline_parallel_size,
                multiple=multiple,
                tokens_per_microbatch=budget,
                budget_key=key,
            )
            if key == train_key or v.key == key  # the logprob budget adds only its own violations
        ]
    if cfg.generation.max_new_tokens >= pol.max_total_sequence_length:
        out.append(
            ConfigError(
                "responses must leave room for the prompt within policy.max_total_sequence_length",
                key="generation.max_new_tokens",
                given=cfg.generation.max_new_tokens,
                allowed=f"< {pol.max_total_sequence_length}",
            )
        )
    if cfg.grpo.overlong_buffer >= cfg.generation.max_new_tokens:
        out.append(
            ConfigError(
                "the overlong buffer must be shorter than generation.max_new_tokens",
                key="grpo.overlong_buffer",
                given=cfg.grpo.overlong_buffer,
                allowed=f"< {cfg.generation.max_new_tokens}",
            )
        )
    return out


def _misc_problems(cfg: "MrlConfig") -> list[ConfigError]:
    out = []
    if not cfg.generation.colocated and cfg.generation.num_devices is None:
        out.append(
            ConfigError(
                "a non-colocated engine needs its own devices",
                key="generation.num_devices",
                fix="set generation.num_devices, or generation.colocated=true",
            )
        )
    if cfg.grpo.max_off_policy_steps and _runs(cfg, "grpo"):
        out += _async_problems(cfg)
    if cfg.policy.lora is not None and cfg.run.final_format == "megatron":
        out.append(
            ConfigError(
                "a LoRA run's Megatron checkpoint holds the base and its adapters apart; the next stage or command "
                "would start from the base alone",
                key="run.final_format",
                given="megatron",
                allowed="hf (the merged model)",
                fix="set run.final_format=hf with policy.lora",
            )
        )
    if cfg.loss.icepop_low >= cfg.loss.icepop_high:
        out.append(
            ConfigError(
                "ICE-POP needs icepop_low < icepop_high",
                key="loss.icepop_low",
                given=cfg.loss.icepop_low,
                allowed=f"< {cfg.loss.icepop_high}",
            )
        )
    arith_tasks = [("data.arith", cfg.data.arith)] + [
        (f"data.sources[{i}].arith", source.arith) for i, source in enumerate(cfg.data.sources)
    ]
    for key, arith in arith_tasks:
        half = (10**arith.digits) ** 2 // 2 if arith is not None else 0  # half of mrl/data/arith.py's pairs
        if arith is not None and arith.num_heldout > half:
            out.append(
                ConfigError(
                    f"{arith.digits}-digit addition has {2 * half} pairs; at most half may be held out",
                    key=f"{key}.num_heldout",
                    given=arith.num_heldout,
                    allowed=f"1..{half}",
                    fix=f"{key}.num_heldout={min(half, 20)}, or raise {key}.digits",
                )
            )
    return out


#: What a name in `envs` may hold: it becomes part of metric names (train/env/<name>/reward).
def _async_problems(cfg: "MrlConfig") -> list[ConfigError]:
    """Asynchronous GRPO trains on samples of the policy before the last update: the loss must correct for that, and
    the engine must generate while the policy trains (devices of its own)."""
    out = []
    if cfg.loss.importance_sampling == "none":
        out.append(
            ConfigError(
                "asynchronous GRPO trains on samples of an older policy: the loss must correct for it",
                key="loss.importance_sampling",
                given="none",
                allowed="tis, icepop",
                fix="set loss.importance_sampling=tis (or grpo.max_off_policy_steps=0)",
            )
        )
    if cfg.generation.colocated:
        out.append(
            ConfigError(
                "asynchronous GRPO generates while the policy trains, so the engine needs devices of its own",
                key="generation.colocated",
                given=True,
                allowed="false",
                fix="set generation.colocated=false and generation.num_devices (or grpo.max_off_policy_steps=0)",
            )
        )
    if cfg.generation.backend != "vllm":
        out.append(
            ConfigError(
                "asynchronous GRPO needs engines in their own processes",
                key="generation.backend",
                given=cfg.generation.backend,
                allowed="vllm",
                fix="set generation.backend=vllm (or grpo.max_off_policy_steps=0)",
            )
        )
    return out


def _ppo_problems(cfg: "MrlConfig") -> list[ConfigError]:
    """PPO's critic and distillation's teacher: synchronous steps, one signal at a time, layouts that fit the world."""
    gae, teacher = cfg.grpo.advantage_estimator == "gae", cfg.distillation is not None
    if not (gae or teacher) or not _runs(cfg, "grpo"):
        return []
    out = []
    what = "PPO (grpo.advantage_estimator=gae)" if gae else "on-policy distillation"
    if cfg.grpo.max_off_policy_steps:
        out.append(
            ConfigError(
                f"{what} runs synchronous steps only (its values or teacher scores come from the samples' own step)",
                key="grpo.max_off_policy_steps",
                given=cfg.grpo.max_off_policy_steps,
                allowed="0",
            )
        )
    if cfg.grpo.dynamic_sampling:
        out.append(
            ConfigError(
                f"{what} keeps every sample (its signal is per token, not the group's spread)",
                key="grpo.dynamic_sampling",
                given=True,
                allowed="false",
            )
        )
    if gae and teacher:
        out.append(
            ConfigError(
                "distillation's per-token advantage replaces GAE's; one run uses one of them",
                key="grpo.advantage_estimator",
                given="gae",
                allowed="grpo with a distillation section",
                fix="drop the distillation section, or set grpo.advantage_estimator=grpo",
            )
        )
    own = cfg.teacher_devices  # a teacher on devices of its own: its layout (or the policy's) over them
    teacher_par = cfg.distillation.parallel if cfg.distillation is not None else None
    if own and teacher_par is None:
        teacher_par = cfg.policy.parallel
    for key, par, world in (
        ("ppo.critic.parallel", cfg.ppo.critic.parallel if gae else None, cfg.policy_world_size),
        ("distillation.parallel", teacher_par, own or cfg.policy_world_size),
    ):
        if par is not None:  # the policy's layout rules, about this section
            out += [_from_rule(v, section=key) for v in _layout_violations(par, world)]
    return out


def _runs(cfg: "MrlConfig", algorithm: str) -> bool:
    """Whether the config runs `algorithm` (a plain config always may; a staged one if a stage names it)."""
    return not cfg.stages or any(s.algorithm == algorithm for s in cfg.stages)


def _dynamic_megatron_engine(cfg: "MrlConfig") -> bool:
    return cfg.generation.backend == "megatron" and cfg.generation.megatron.engine == "dynamic"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
