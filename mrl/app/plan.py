"""`mrl plan --config R [--gpu NAME] [--assume key=value ...]`: what a recipe costs on each GPU, before it is queued.

Data flow: the config (validated as for a run) -> the model's config.json (a local folder, the hub cache, or the
published configs shipped for the cluster recipes' models, mrl/_shipped/hf_configs) -> per pipeline stage, the
policy rank's model states (mrl/app/plan_memory.py: exact, checked against megatron-core's own model; PPO's critic
and distillation's teacher on the same GPU) and activations (mrl/app/plan_activations.py: an estimate) -> the
engine GPU's weights and KV cache -> the two phases a colocated GPU goes through (training while the engine sleeps;
generation while the policy keeps what `policy.offload_when_generating` does not move) against the GPU's memory ->
a verdict, and the settings that would make a layout that does not fit fit (mrl/app/plan_verdict.py). Every figure
that is not arithmetic on the config is an assumption, printed with its source; `--assume key=value` replaces it
with the user's own measurement. The step's time per phase is an estimate from rates (mrl/app/plan_time.py).

A staged recipe (`stages:`, `mrl run`) is planned stage by stage, each with the workers its command starts (GRPO:
the policy and the engine; SFT, DPO and reward models: the policy; eval: the engine), one plan and verdict each; a
stage that starts from an earlier stage's export not written yet is planned with the model that stage started from
(an export keeps its model's shapes). An engine whose weights cannot fit its GPUs at any `gpu_memory_utilization`
is named as such, with the engine layouts and GPUs that hold them.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from converters.spec import ModelDims, model_dims
from mrl.app.plan_activations import Activations, stage_activations
from mrl.app.plan_memory import (
    GiB,
    Layout,
    PolicyBytes,
    engine_stage_bytes,
    kv_capacity_tokens,
    layout_of,
    padded_vocab,
    policy_bytes,
    stage_params,
)
from mrl.app.plan_time import StepTime, step_time
from mrl.app.plan_verdict import GPUS, engine_layout, gib, judge
from mrl.config import ConfigError, MrlConfig
from mrl.data import hub
from mrl.model.lora import LoraSettings

SHIPPED_CONFIGS = Path(__file__).resolve().parents[1] / "_shipped" / "hf_configs"

#: The workers each command starts, as the plan counts them (mrl/app/commands.py): policy ranks, engines.
POLICY_COMMANDS = ("grpo", "sft", "dpo", "rm")
ENGINE_COMMANDS = ("grpo", "eval")


@dataclass(frozen=True)
class Assumption:
    value: float
    unit: str
    source: str
    kind: str = "size"  # its range (RANGES): a size may be 0; a rate or length may not; a share is also at most 1


#: The values each kind of assumption may take (`--assume` refuses others, and nan and inf).
RANGES: dict[str, str] = {"size": ">= 0", "positive": "above 0", "share": "above 0 and at most 1"}


#: Figures the plan cannot derive from the config; `--assume key=value` replaces one.
ASSUMPTIONS: dict[str, Assumption] = {
    "cuda_context_gib": Assumption(
        0.6,
        "GiB per process on a GPU",
        "CUDA context and the NCCL communicators, typical of an H100 (nvidia-smi of an idle torch process with NCCL)",
    ),
    "engine_overhead_gib": Assumption(
        2.0,
        "GiB",
        "vLLM's non-KV memory besides the weights: the profile run's "
        "activation peak, CUDA graphs, non-torch memory (vLLM's start-up log prints "
        "each: 'Memory profiling takes ...')",
    ),
    "engine_asleep_gib": Assumption(
        0.3,
        "GiB",
        "what a sleeping colocated engine keeps (level 2 frees weights and "
        "KV cache; level 1 moves the weights to host memory)",
    ),
    "allocator_slack": Assumption(
        0.05,
        "fraction of the live tensors",
        "the caching allocator's fragmentation on top "
        "of the live tensors (PyTorch's reserved minus allocated, typical)",
    ),
    "mfu": Assumption(
        0.35,
        "of the GPU's dense bf16 peak",
        "Megatron-Core bf16 training and prefill, typical of "
        "published runs of models of this size (35-45%); your run's train time gives yours",
        "share",
    ),
    "decode_efficiency": Assumption(
        0.6,
        "of the HBM bandwidth",
        "a vLLM decode step reading the weights and KV cache at a large batch (50-70% is typical)",
        "share",
    ),
    "mean_prompt_tokens": Assumption(
        256,
        "tokens",
        "a math problem with the chat template (DeepScaleR's: about "
        "100-300); your data's train/prompt_tokens_max bounds it",
        "positive",
    ),
    "mean_response_fraction": Assumption(
        0.5,
        "of generation.max_new_tokens",
        "the mean response's length: a run's train/response_length over max_new_tokens",
        "share",
    ),
    "refit_gib_per_s": Assumption(
        200,
        "GiB/s per engine GPU",
        "CUDA IPC between colocated processes, below what the "
        "GPU tier measured on an H100 (docs/measurements.md, GPU tier)",
        "positive",
    ),
    "node_broadcast_gib_per_s": Assumption(
        150,
        "GiB/s",
        "a refit bucket broadcast from policy rank 0 over the "
        "policy's ranks of one node (NVLink 4: 900 GB/s per H100, a broadcast "
        "reaches a share of it; nccl-tests' broadcast_perf measures yours)",
        "positive",
    ),
    "cluster_broadcast_gib_per_s": Assumption(
        40,
        "GiB/s",
        "the same broadcast across nodes (one 400 Gb/s "
        "InfiniBand NIC per GPU, 50 GB/s, of which NCCL reaches 80-90%; "
        "nccl-tests' broadcast_perf over the nodes measures yours)",
        "positive",
    ),
}


@dataclass(frozen=True)
class StagePlan:
    states: PolicyBytes
    activations: Activations
    layers: tuple[int, int]
    train_phase: int  # bytes on the GPU while training (engine asleep)
    generate_phase: int  # bytes on the GPU while a colocated engine generates (0: not colocated)


@dataclass(frozen=True)
class EnginePlan:
    gpus: int  # GPUs of one engine (its TP x PP)
    weights: int
    budget: int  # gpu_memory_utilization x the GPU
    kv_bytes: int
    kv_tokens: int
    sequence_tokens: int  # one sequence at the configured lengths
    block_size: int = 16
    stages: int = 1  # its pipeline stages (weights and KV cache: the stage with the most weights)

    @property
    def sequences(self) -> int:
        return self.kv_tokens // self.sequence_tokens


@dataclass(frozen=True)
class RefitPlan:
    """The refit's buckets (mrl.policy.export.plan_buckets, as the policy plans them: layers cut at the bound)."""

    buckets: int
    largest: int  # bytes of the largest bucket's HF tensors (bf16)
    total: int  # bytes of every HF tensor (bf16)


def refit_plan(cfg: MrlConfig, dims: ModelDims) -> RefitPlan:
    from converters.mapping import expected_hf_shapes
    from mrl.policy.export import plan_buckets

    hf_bytes = {name: 2 * math.prod(shape) for name, shape in expected_hf_shapes(dims).items()}
    buckets = plan_buckets(dims, "local", cfg.generation.refit_bucket_mb << 20, 2, split_units=True)
    sizes = [sum(hf_bytes[name] for piece in bucket for name in piece.hf) for bucket in buckets]
    return RefitPlan(len(sizes), max(sizes, default=0), sum(hf_bytes.values()))


@dataclass
class Plan:
    model: str
    model_source: str
    gpu: str
    gpu_bytes: int
    dims: ModelDims
    stages: list[StagePlan]  # the policy's pipeline stages (none for `eval`: no policy)
    engine: EnginePlan | None  # None for sft, dpo and rm: no engine
    time: StepTime | None  # a GRPO step's; None for the other commands
    refit: RefitPlan | None  # with a policy and an engine
    assumptions: dict[str, Assumption]
    problems: list[str] = field(default_factory=list)
    fixes: list[str] = field(default_factory=list)
    command: str = "grpo"

    @property
    def fits(self) -> bool:
        return not self.problems


def parse_assumptions(pairs: Sequence[str]) -> dict[str, Assumption]:
    """ASSUMPTIONS with `key=value` pairs applied; an unknown key, or a value that is not a finite number in the
    assumption's range (RANGES), is a ConfigError."""
    out = dict(ASSUMPTIONS)
    for pair in pairs:
        key, _, value = pair.partition("=")
        if key not in ASSUMPTIONS:
            raise ConfigError(
                "not an assumption of the plan",
                key="--assume",
                given=pair,
                allowed=", ".join(ASSUMPTIONS),
                fix="--assume KEY=NUMBER with one of those keys",
            )
        try:
            number = float(value)
        except ValueError:
            raise ConfigError(
                "the value is not a number",
                key="--assume",
                given=pair,
                fix=f"--assume {key}=NUMBER ({ASSUMPTIONS[key].unit})",
            ) from None
        default = ASSUMPTIONS[key]
        below = number < 0 if default.kind == "size" else number <= 0
        if not math.isfinite(number) or below or (default.kind == "share" and number > 1):
            raise ConfigError(
                f"{key} is out of its range",
                key="--assume",
                given=pair,
                allowed=f"a number {RANGES[default.kind]} ({default.unit}), not nan or inf",
                fix=f"--assume {key}=NUMBER within that range (the plan's default: {default.value:g})",
            )
        out[key] = replace(default, value=number, source="given with --assume")
    return out


def gpu_bytes(name: str) -> int:
    if name not in GPUS:
        raise ConfigError(
            "unknown GPU",
            key="--gpu",
            given=name,
            allowed=", ".join(GPUS),
            fix="name one of those (the memory nvidia-smi reports for it)",
        )
    return GPUS[name]


def model_config(cfg: MrlConfig, path: str | None = None) -> tuple[dict[str, Any], str]:
    """The policy's config.json and where it came from: `path` (--model-config), policy.model_name's folder, the
    hub cache, or the published config shipped for a cluster recipe's model."""
    if path is not None:
        return _read_config(Path(path), "--model-config"), path
    name = cfg.policy.model_name
    if name is None:
        raise ConfigError(
            "the plan needs the model's config.json",
            key="policy.model_name",
            given=None,
            fix="set policy.model_name, or pass --model-config FILE",
        )
    folder = Path(name)
    if (folder / "config.json").is_file():
        return _read_config(folder / "config.json", "policy.model_name"), str(folder / "config.json")
    ref = hub.parse_hub_id(name)
    if ref is not None:
        snapshot = hub.cached_snapshot(ref, "model")
        if snapshot is not None and (snapshot / "config.json").is_file():
            return _read_config(snapshot / "config.json", "policy.model_name"), f"{ref.repo_id} (hub cache)"
        shipped = SHIPPED_CONFIGS / f"{ref.repo_id.replace('/', '--')}_config.json"
        if shipped.is_file():
            return _read_config(shipped, "policy.model_name"), f"{ref.repo_id} (published config.json shipped with mrl)"
    fix = f"`{hub.download_command(ref, 'model')}` on a machine with network" if ref else "a folder with config.json"
    raise ConfigError(
        "no config.json found for the model: not a local folder, not in the hub cache, and not one "
        "of the models whose published config mrl ships",
        key="policy.model_name",
        given=name,
        fix=f"{fix}, or pass --model-config FILE",
    )


def check_this_gpu(cfg: MrlConfig, gpu_total: int) -> Plan | None:
    """`cluster.memory_check` before a run starts on a GPU of `gpu_total` bytes: the plan when it does not fit (after
    printing it, with `warn`), a ConfigError with it (`refuse`); None when it fits, is off, or there is no published
    model to plan (a random model from policy.build)."""
    if cfg.cluster.memory_check == "off" or cfg.policy.model_name is None:
        return None
    plan = make_plan(cfg, gpu_total=gpu_total)
    if plan.fits:
        return None
    text = render(plan, cfg)
    if cfg.cluster.memory_check == "refuse":
        raise ConfigError(
            f"the layout does not fit this GPU:\n{text}\n",
            key="cluster.memory_check",
            given="refuse",
            allowed="refuse, warn, off",
            fix="one of the settings the plan names, or cluster.memory_check=warn to start anyway",
        )
    print(
        f"[mrl] warning: the layout may not fit this GPU (cluster.memory_check=warn):\n{text}",
        file=sys.stderr,
        flush=True,
    )
    return plan


def _read_config(path: Path, key: str) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read a config.json: {exc}", key=key, given=str(path)) from None
    config.pop("quantization_config", None)  # an fp8 checkpoint trains and generates in bf16 here
    return config


def make_plan(
    cfg: MrlConfig,
    *,
    gpu: str = "h100-80gb",
    assume: Sequence[str] = (),
    model_config_path: str | None = None,
    gpu_total: int | None = None,
    command: str = "grpo",
    model: tuple[dict[str, Any], str] | None = None,
) -> Plan:
    """The whole plan of a config (module docstring) for `command`'s workers; `gpu_total`: the memory of the GPU at
    hand instead of the named one's (whose rates the time estimate still uses); `model`: the model's config.json and
    where it came from, when the caller has it (a staged recipe's later stages)."""
    assumptions = parse_assumptions(assume)
    total = gpu_bytes(gpu) if gpu_total is None else gpu_total
    config, source = model or model_config(cfg, model_config_path)
    dims = model_dims(config)
    engine = _engine(cfg, dims, total, assumptions) if command in ENGINE_COMMANDS else None
    stages = (
        _policy_stages(cfg, dims, engine, assumptions, reference=command == "dpo" or cfg.loss.kl_beta > 0)
        if command in POLICY_COMMANDS
        else []
    )
    refit = refit_plan(cfg, dims) if engine and stages else None
    time = None
    if command == "grpo":
        assert engine is not None and refit is not None  # grpo is an engine and a policy command
        time = step_time(
            cfg,
            dims,
            gpu,
            {key: a.value for key, a in assumptions.items()},
            kv_tokens=engine.kv_tokens,
            engine_weights=engine.weights,
            refit_bytes=refit.total,
        )
    label = gpu if gpu_total is None else "this GPU"
    plan = Plan(
        cfg.policy.model_name or "",
        source,
        label,
        total,
        dims,
        stages,
        engine,
        time,
        refit,
        assumptions,
        command=command,
    )
    judge(cfg, plan)
    return plan


def _policy_stages(
    cfg: MrlConfig,
    dims: ModelDims,
    engine: EnginePlan | None,
    assumptions: Mapping[str, Assumption],
    *,
    reference: bool,
) -> list[StagePlan]:
    """A policy rank's bytes per pipeline stage, while training and (beside a colocated engine) while generating;
    `reference`: the run keeps a reference model (DPO, or GRPO's KL term)."""
    layout = layout_of(cfg)
    context = int(assumptions["cuda_context_gib"].value * GiB)
    slack = 1 + assumptions["allocator_slack"].value
    colocated = cfg.generation.colocated and engine is not None
    asleep = int(assumptions["engine_asleep_gib"].value * GiB) + context if colocated else 0
    stages = []
    lora = LoraSettings.of(cfg.policy.lora) if cfg.policy.lora else None
    for stage in stage_params(dims, layout, freeze_router=cfg.policy.moe.freeze_router, lora=lora):
        states = policy_bytes(
            stage,
            layout,
            precision=cfg.policy.precision,
            distributed_optimizer=cfg.policy.optimizer.use_distributed_optimizer,
            reference=reference and not cfg.policy.offload_reference,
        )
        states = _beside(cfg, states, dims, layout)
        acts = stage_activations(
            cfg, dims, stage.layers, last_stage=stage.stage == layout.pp - 1, padded_vocab=padded_vocab(dims, layout.tp)
        )
        train = int((states.states + max(acts.train_peak, acts.logprob_peak)) * slack) + context + asleep
        generate = _resident(cfg, states) + context + engine.budget if colocated and engine is not None else 0
        stages.append(StagePlan(states, acts, stage.layers, train, generate))
    return stages


def _beside(cfg: MrlConfig, states: PolicyBytes, dims: ModelDims, layout: Layout) -> PolicyBytes:
    """`states` with PPO's critic (the policy's states once more) and distillation's teacher (its weights over the
    policy's TP x PP) on the same GPU (plan_memory's module docstring)."""
    critic = states.weights + states.gradients + states.optimizer if cfg.grpo.advantage_estimator == "gae" else 0
    teacher = 0
    if cfg.distillation is not None and not cfg.teacher_devices:  # a teacher of its own devices: not on this GPU
        teacher_dims = _teacher_dims(cfg.distillation.teacher) or dims
        width = 2 if cfg.policy.precision == "bfloat16" else 4
        params = sum(stage.total for stage in stage_params(teacher_dims, Layout(tp=layout.tp, world_size=layout.tp)))
        teacher = -(-params // layout.pp) * width
    return replace(states, critic=critic, teacher=teacher)


def _teacher_dims(teacher: str) -> Optional[ModelDims]:
    """The teacher's dims from its config.json (an HF folder, or a Megatron folder's hf/), None when not at hand."""
    for candidate in (Path(teacher) / "config.json", Path(teacher) / "hf" / "config.json"):
        if candidate.is_file():
            return model_dims(_read_config(candidate, "distillation.teacher"))
    return None


def _resident(cfg: MrlConfig, states: PolicyBytes) -> int:
    """What a policy rank keeps on its GPU while a colocated engine generates (the critic keeps what the policy
    does: the same offload settings)."""
    off = cfg.policy.offload_when_generating
    kept = (
        (0 if off.weights else states.weights)
        + (0 if off.gradients else states.gradients)
        + (0 if off.optimizer_states else states.optimizer)
    )
    return kept * (2 if states.critic else 1) + states.reference + states.teacher


def _engine(cfg: MrlConfig, dims: ModelDims, total: int, assumptions: Mapping[str, Assumption]) -> EnginePlan:
    tp, pp = cfg.generation.vllm.tensor_parallel_size, cfg.generation.vllm.pipeline_parallel_size
    stages = engine_stage_bytes(dims, tp, pp)
    budget = int(cfg.generation.vllm.gpu_memory_utilization * total)
    free = [budget - weights - int(assumptions["engine_overhead_gib"].value * GiB) for weights in stages]
    block = 16
    tokens = kv_capacity_tokens(dims, tp, free, pp=pp, block_size=block)
    sequence = cfg.generation.vllm.max_model_len or cfg.policy.max_total_sequence_length
    return EnginePlan(tp * pp, max(stages), budget, max(min(free), 0), tokens, sequence, block, pp)


def _refit_line(refit: RefitPlan, cfg: MrlConfig) -> str:
    return (
        f"refit: {refit.total / GiB:.1f} GiB in {refit.buckets} buckets of at most "
        f"{refit.largest / 2**20:.0f} MiB (generation.refit_bucket_mb={cfg.generation.refit_bucket_mb})"
    )


def _offload_lines(plan: Plan, cfg: MrlConfig) -> list[str]:
    """What a colocated policy GPU of the largest stage hands over while the engine generates."""
    if not cfg.generation.colocated:
        return []
    states = max(plan.stages, key=lambda s: s.states.states).states
    off = cfg.policy.offload_when_generating
    parts = [
        ("optimizer states to host memory", "optimizer_states", off.optimizer_states, states.optimizer),
        ("gradients freed", "gradients", off.gradients, states.gradients),
        ("weights to host memory", "weights", off.weights, states.weights),
    ]
    moved = ", ".join(f"{what} {size / GiB:.1f} GiB" for what, _, on, size in parts if on) or "nothing"
    kept = ", ".join(f"{key} {size / GiB:.1f} GiB" for _, key, on, size in parts if not on) or "nothing"
    return [
        f"while the engine generates, a policy GPU hands over: {moved}; keeps {kept} (policy.offload_when_generating)"
    ]


def _time_line(t: StepTime) -> str:
    if t.generation == float("inf"):
        return "step time: not estimated (no sequence fits the engine's KV cache)"
    return (
        f"step time, an estimate: generation {t.generation:.0f} s, logprobs {t.logprobs:.0f} s, train "
        f"{t.train:.0f} s, refit {t.refit:.1f} s; {t.total:.0f} s a step"
    )


def _workers_line(plan: Plan, cfg: MrlConfig) -> str:
    par = cfg.policy.parallel
    parts = []
    if plan.stages:
        parts.append(
            f"policy: {cfg.policy_world_size} GPUs, TP {par.tensor_parallel_size} PP "
            f"{par.pipeline_parallel_size} CP {par.context_parallel_size} EP {par.expert_parallel_size}, "
            f"{cfg.policy.precision}, distributed optimizer "
            f"{'on' if cfg.policy.optimizer.use_distributed_optimizer else 'off'}, recompute "
            f"{'on' if cfg.policy.activation_checkpointing else 'off'}"
            + (f", LoRA rank {cfg.policy.lora.rank} (the base frozen)" if cfg.policy.lora else "")
        )
    if plan.engine is not None:
        placed = "" if not plan.stages else ", colocated" if cfg.generation.colocated else ", on its own GPUs"
        parts.append(f"engine {engine_layout(plan.engine, cfg)}{placed}")
    return "; ".join(parts) + f" (what `mrl {plan.command}` starts)"


def _policy_table(plan: Plan) -> list[str]:
    lines = [
        "policy GPU, per pipeline stage (GiB)",
        f"  {'stage':>5} {'layers':>9} {'params':>9} {'weights':>8} {'grads':>7} {'optim':>7} {'ref':>6} "
        f"{'beside':>7} {'act':>7} {'logprob':>8} {'train':>7} {'generate':>9}",
    ]
    for s in plan.stages:
        g = s.states
        lines.append(
            f"  {g.stage:>5} {f'{s.layers[0]}-{s.layers[1] - 1}':>9} {g.params / 1e9:>8.2f}B "
            f"{g.weights / GiB:>8.1f} {g.gradients / GiB:>7.1f} {g.optimizer / GiB:>7.1f} "
            f"{g.reference / GiB:>6.1f} {(g.critic + g.teacher) / GiB:>7.1f} {s.activations.train_peak / GiB:>7.1f} "
            f"{s.activations.logprob_peak / GiB:>8.1f} {s.train_phase / GiB:>7.1f} "
            f"{(s.generate_phase / GiB if s.generate_phase else 0):>9.1f}"
        )
    return lines + [""]


def _engine_line(e: EnginePlan, cfg: MrlConfig) -> str:
    return (
        f"engine GPU{' (its largest pipeline stage)' if e.stages > 1 else ''}: weights {gib(e.weights)}, "
        f"budget {gib(e.budget)} (gpu_memory_utilization {cfg.generation.vllm.gpu_memory_utilization:g}), KV "
        f"cache {gib(e.kv_bytes)} = {e.kv_tokens:,} tokens = {e.sequences} sequences of {e.sequence_tokens} "
        "tokens"
    )


def assumption_lines(plan: Plan) -> list[str]:
    return [
        "assumptions (--assume KEY=VALUE replaces one):",
        *(f"  {k} = {a.value:g} {a.unit}: {a.source}" for k, a in plan.assumptions.items()),
    ]


def render(plan: Plan, cfg: MrlConfig, *, assumptions: bool = True) -> str:
    """The plan as the text `mrl plan` prints (`assumptions`: with the assumptions' list; a staged recipe's plans
    print it once)."""
    lines = [
        f"mrl plan: {plan.model} on {plan.gpu} ({gib(plan.gpu_bytes)} per GPU)",
        f"  model: {plan.model_source}",
        f"  {_workers_line(plan, cfg)}",
        "",
    ]
    if plan.stages:
        lines += _policy_table(plan)
    if plan.engine is not None:
        lines += [_engine_line(plan.engine, cfg), ""]
    if plan.refit is not None:
        lines += [_refit_line(plan.refit, cfg), *_offload_lines(plan, cfg), ""]
    if plan.time is not None:
        lines += [_time_line(plan.time), ""]
    if assumptions:
        lines += [*assumption_lines(plan), ""]
    lines += _verdict(plan)
    return "\n".join(lines)


def _verdict(plan: Plan) -> list[str]:
    if plan.fits:
        return ["verdict: fits"]
    return [
        "verdict: does NOT fit",
        *(f"  - {p}" for p in plan.problems),
        "  would fit with one or more of:",
        *(f"  - {f}" for f in plan.fixes),
    ]
