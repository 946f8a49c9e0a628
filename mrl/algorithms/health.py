"""Run health of a GRPO step: what the step could learn from, a warning naming the cause and the fix when a step
could learn nothing, and a stop when that goes on; before any worker starts, the data that cannot fit
(`check_prompt_budget` for GRPO, `check_sft_rows` for SFT; preference pairs: mrl/algorithms/pairs.py); for SFT, DPO
and reward-model training, a loss that stays exactly 0 (`ZeroLoss`).

Figures, from what the step already has (added to its metrics):
    train/prompts_rejected_fraction   prompts dropped for length (generation.overlong_prompt: reject) / prompts
    train/zero_variance_groups        groups whose rewards are all equal (zero advantage: no signal) / groups
    train/reward_error_fraction       samples the reward failed on (the verifier raised or timed out) / samples
    train/unparsed_fraction           responses that ended in which the reward found no answer / responses that
                                      ended (env.kind arith and math, without a reward model; 0 otherwise)
    train/truncated_fraction          responses cut at generation.max_new_tokens (logged by the loop already)
    train/kept_samples                samples trained on (logged by the loop already)
    train/health_warnings             conditions below that held for the whole step
    train/idle                        1 when the step trained on nothing
Each condition that holds for the whole step is a warning with its figures and the keys that change it. A step
that trained on nothing (no sample kept, or every group's rewards equal with no KL term: every advantage is 0, so
the update is exactly 0) is idle; `grpo.max_idle_steps` idle steps in a row end the run with `IdleTraining`
(exit 2, mrl.cli) before it saves, but for its summary.json saying why: a checkpoint would differ from the start only
in its step number. One such step is not idle: every sample got the same positive reward ("all solved": the model
answered every problem of the step right). It warns, but a run that masters its data is not stuck, and a small recipe
near the end of its training meets such steps by chance (6 prompts x 4 samples at 96% right: one step in three).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from mrl.algorithms.guards import TrainingStopped
from mrl.config.errors import CONFIG_ERROR_EXIT_CODE, ConfigError

if TYPE_CHECKING:
    import torch

#: Exit status of a run stopped by `IdleTraining` (mrl.cli): the configuration's, since the settings or the data
#: cannot train.
IDLE_EXIT_CODE = CONFIG_ERROR_EXIT_CODE


class IdleTraining(TrainingStopped):
    """`grpo.max_idle_steps` steps in a row trained on nothing; the message names the cause and the fix."""

    setting = "grpo.max_idle_steps"


def prompt_token_limit(cfg: Any) -> int:
    """The longest prompt the engine takes whole (what its `fit_prompts` applies): its context less
    generation.max_new_tokens."""
    from mrl.inference.factory import engine_context_length
    from mrl.inference.prompt_limits import max_prompt_tokens

    return max_prompt_tokens(engine_context_length(cfg), cfg.generation.max_new_tokens)


#: The keys that give a prompt more room.
_LENGTH_FIX = (
    "raise policy.max_total_sequence_length (and generation.vllm.max_model_len when set), lower "
    "generation.max_new_tokens"
)
#: Training rows whose prompts are measured before any worker starts (`check_prompt_budget`).
PREFLIGHT_ROWS = 64


def prompt_budget(cfg: Any) -> int:
    """Tokens a prompt may take whole: the engine's limit (`prompt_token_limit`), and data.max_prompt_length."""
    limit = prompt_token_limit(cfg)
    return min(limit, cfg.data.max_prompt_length) if cfg.data.max_prompt_length else limit


def check_prompt_budget(
    cfg: Any, tokenizer: Any, template: Any, problems: Sequence[Any], rows: str = "training", source: str = ""
) -> None:
    """Before any worker starts: a `ConfigError` when the template and instruction alone exceed the prompt budget
    (every prompt would, whatever its problem), or when every one of the first `PREFLIGHT_ROWS` prompts of `problems`
    does (generation.overlong_prompt: reject would drop them all). `rows` says which prompts they are ("training",
    "validation": a validation or an evaluation with nothing to generate), `source` the key of their file."""
    budget = prompt_budget(cfg)
    keys = _LENGTH_FIX + (", raise data.max_prompt_length" if cfg.data.max_prompt_length else "")
    bare = len(template.encode([""], tokenizer)[0][0])
    if bare > budget:
        raise ConfigError(
            f"the prompt template and instruction alone take {bare} tokens, more than the {budget} a prompt may take",
            key="data.instruction",
            given=template.instruction,
            allowed=f"a prompt of at most {budget} tokens",
            fix=f"{keys}, or shorten data.instruction",
        )
    sample = list(problems[:PREFLIGHT_ROWS])
    if cfg.generation.overlong_prompt != "reject" or not sample:
        return
    lengths = [len(ids) for ids in template.encode([p.problem for p in sample], tokenizer)[0]]
    if min(lengths) > budget:
        raise ConfigError(
            f"all {len(sample)} of the first {len(sample)} {rows} prompts{f' ({source})' if source else ''} exceed the "
            f"{budget} tokens a prompt may take (shortest {min(lengths)}, longest {max(lengths)} tokens): "
            "generation.overlong_prompt=reject would drop every one",
            key="generation.overlong_prompt",
            given="reject",
            fix=f"{keys}, shorten data.instruction or the prompts, or set generation.overlong_prompt=truncate",
        )


def check_sft_rows(cfg: Any, tokenizer: Any, template: Any, problems: Sequence[Any]) -> None:
    """Before any worker starts: a `ConfigError` when every one of the first `PREFLIGHT_ROWS` SFT rows has a prompt
    that fills policy.max_total_sequence_length (no response token would be trained); a warning when every one is
    longer than it (each is cut, and no response is learned to its end)."""
    from mrl.data.sft import build_sft_batch

    sample = list(problems[:PREFLIGHT_ROWS])
    if not sample:
        return
    limit, count = cfg.policy.max_total_sequence_length, len(sample)
    rows = build_sft_batch([p.problem for p in sample], [p.answer for p in sample], tokenizer, template)
    lengths = rows.lengths.tolist()
    prompts = [total - int(scored) for total, scored in zip(lengths, rows.loss_mask.sum(dim=1).tolist())]
    if min(prompts) >= limit:
        raise ConfigError(
            f"all {count} of the first {count} training rows have a prompt of {limit} tokens or more (shortest "
            f"{min(prompts)}, longest {max(prompts)}): cut to {limit} tokens, no response token is left to train on",
            key="policy.max_total_sequence_length",
            given=limit,
            allowed=f"more than {min(prompts)}",
            fix="raise policy.max_total_sequence_length, or shorten the prompts (data.instruction, the problems)",
        )
    if min(lengths) > limit:
        print(
            f"[mrl] all {count} of the first {count} training rows are longer than policy.max_total_sequence_length="
            f"{limit} (shortest {min(lengths)}, longest {max(lengths)} tokens): each is cut to its "
            f"first {limit} tokens, so no response is learned to its end. Fix: raise "
            "policy.max_total_sequence_length",
            file=sys.stderr,
            flush=True,
        )


def health_metrics(rollouts: Any, grouped_rewards: torch.Tensor, *, reads_answers: bool = True) -> dict[str, float]:
    """The step's health figures (module docstring) from its rollouts and its rewards [prompts, group] (a tensor:
    this module imports no torch, the command line imports it). `reads_answers`: the environment reads an answer out
    of each response (what `env_reads_answers(cfg)` says), so a response without one is counted."""
    prompts = max(len(grouped_rewards), 1)
    samples = max(int(rollouts.rewards.numel()), 1)
    uniform = 1.0  # no group at all: nothing to learn from either
    if grouped_rewards.numel():
        uniform = float((grouped_rewards.amax(dim=1) == grouped_rewards.amin(dim=1)).float().mean())
    ended = [i for i, cut in enumerate(rollouts.truncated.tolist()) if not cut]
    unparsed = 0.0
    if reads_answers and ended and len(rollouts.extracted_answers) == len(rollouts.truncated):
        unparsed = sum(rollouts.extracted_answers[i] is None for i in ended) / len(ended)
    return {
        "train/prompts_rejected_fraction": rollouts.num_prompts_rejected / prompts,
        "train/zero_variance_groups": uniform,
        "train/reward_error_fraction": rollouts.num_reward_errors / samples,
        "train/unparsed_fraction": unparsed,
    }


def env_reads_answers(cfg: Any) -> bool:
    """Whether the run's reward reads an answer out of each response (so a response without one is a health
    figure): the single-turn arith and math environments, when no reward model replaces their score."""
    envs = list(cfg.envs.values()) or [cfg.env]
    return all(env.kind in _ANSWER_FORMATS and env.reward_model is None for env in envs)


#: What each environment that reads answers looks for in a response (mrl/environments/arith.py, math.py,
#: reasoning_gym.py).
_ANSWER_FORMATS = {
    "arith": "the first integer of the response",
    "reasoning_gym": "the last <answer>...</answer>, else the whole response",
    "math": "the last \\boxed{...}, else the number after 'final answer is', else the last number",
}


@dataclass(frozen=True)
class Cause:
    """One condition that held for a whole step."""

    name: str
    message: str
    idle: bool  # the step trained on nothing because of it


def _group_advantages_only(cfg: Any) -> bool:
    """Whether equal rewards in a group leave its samples no signal: not under PPO (the critic's values set the
    baseline per token) nor distillation (the teacher's logprobs are the signal)."""
    return cfg.grpo.advantage_estimator == "grpo" and cfg.distillation is None


def step_causes(cfg: Any, metrics: dict[str, float], rollouts: Any) -> list[Cause]:
    """The conditions that held for the whole step, each with its figures and its fix."""
    return _signal_causes(cfg, metrics, rollouts) + _cut_causes(cfg, rollouts) + _reward_causes(cfg, metrics, rollouts)


def _signal_causes(cfg: Any, metrics: dict[str, float], rollouts: Any) -> list[Cause]:
    """Why the step had nothing to learn from: no prompt kept, every advantage 0, no sample kept."""
    kl = cfg.loss.kl_beta > 0
    if metrics["train/prompts_rejected_fraction"] >= 1.0:
        limit = prompt_token_limit(cfg)
        longest_prompt = int(metrics.get("train/prompt_tokens_max", 0))
        message = (
            f"every prompt of the step was rejected for length: the longest has {longest_prompt} tokens, and a "
            f"prompt may take {limit} (the engine's context {limit + cfg.generation.max_new_tokens} less "
            f"generation.max_new_tokens={cfg.generation.max_new_tokens}). Fix: {_LENGTH_FIX}, shorten "
            "data.instruction or the prompts, or set generation.overlong_prompt=truncate"
        )
        return [Cause("prompts too long", message, idle=True)]
    if metrics["train/zero_variance_groups"] >= 1.0 and _group_advantages_only(cfg):
        seen = sorted({round(float(r), 4) for r in rollouts.rewards.tolist()})
        effect = "learns only from the KL term" if kl else "changes nothing"
        if len(seen) == 1 and seen[0] > 0:
            message = (
                f"every sample of the step got the same reward, {seen[0]:g}: the model solves every problem of the "
                f"step, so every advantage is 0 and the step {effect}. Not counted as idle (the run is not stuck); "
                "if it goes on, the data is too easy for the model: harder problems, or fewer steps"
            )
            return [Cause("all solved", message, idle=False)]
        message = (
            f"every group's rewards were equal (rewards seen: {_few(seen)}): "
            f"every advantage is 0, so the step {effect}. {_equal_rewards_fix(cfg)}"
        )
        return [Cause("equal rewards", message, idle=not kl)]
    if metrics.get("train/kept_samples", 1.0) == 0:
        message = (
            "no sample of the step was kept for training (every response empty, or every group dropped by "
            "grpo.dynamic_sampling)"
        )
        return [Cause("no samples", message, idle=True)]
    return []


def _cut_causes(cfg: Any, rollouts: Any) -> list[Cause]:
    """Every response cut at the generation limit."""
    if not _all_cut_or_empty(rollouts):
        return []
    empty = sum(not text.strip() for text in rollouts.responses)
    message = (
        f"every response was cut at generation.max_new_tokens={cfg.generation.max_new_tokens} before it ended"
        + (f" ({empty} of {len(rollouts.responses)} were empty)" if empty else "")
        + ": raise generation.max_new_tokens (and policy.max_total_sequence_length with it), or ask for shorter "
        "answers in data.instruction"
    )
    return [Cause("responses cut", message, idle=False)]


def _reward_causes(cfg: Any, metrics: dict[str, float], rollouts: Any) -> list[Cause]:
    """The reward failed on every sample, or found no answer in any."""
    if metrics["train/reward_error_fraction"] >= 1.0:
        example = rollouts.reward_errors[0] if rollouts.reward_errors else "no message"
        message = (
            f"the reward failed on every sample ({example}), so each scored 0: fix what the message names (a gold "
            "answer the environment cannot read is a data problem; a timeout: raise env.timeout_s)"
        )
        return [Cause("reward failed", message, idle=False)]
    if metrics.get("train/unparsed_fraction", 0.0) >= 1.0:
        named = list(cfg.envs.items()) or [("", cfg.env)]
        formats = [(name, _ANSWER_FORMATS.get(env.kind, f"the answer kind={env.kind} reads")) for name, env in named]
        expected = "; ".join(f"{name}: {form}" if name else form for name, form in formats)
        message = (
            f"the reward found no answer in any response that ended, e.g. {_excerpt(rollouts)}; it reads "
            f"{expected}: ask for that format in data.instruction (or prompt_template), or use an environment that "
            "reads the model's format"
        )
        return [Cause("no answer found", message, idle=False)]
    return []


def _all_cut_or_empty(rollouts: Any) -> bool:
    """Every response was cut at max_new_tokens or is empty (an end-of-sequence token alone), and one was cut: no
    response said anything to its end. (With max_new_tokens 1 this always holds.)"""
    cut = rollouts.truncated.tolist()
    texts = rollouts.responses if len(rollouts.responses) == len(cut) else [""] * len(cut)
    return any(cut) and all(c or not text.strip() for c, text in zip(cut, texts))


def _equal_rewards_fix(cfg: Any) -> str:
    size = cfg.grpo.num_generations_per_prompt
    if size == 1:
        return (
            "Every group is one sample (grpo.num_generations_per_prompt is 1), whose advantage is always 0: "
            "grpo.num_generations_per_prompt=2 or more"
        )
    # The setting proposed is never the one the run has (the run with it is the one that stopped)
    return (
        "All 0: the model never answers right (start from a stronger or SFT-warmed model, easier data, or check "
        "that the reward can read its answers); groups all right beside groups all wrong: the data mixes problems "
        "too easy and too hard for it. More samples per prompt make a differing one likelier: "
        f"grpo.num_generations_per_prompt={2 * size} (now {size}; twice the samples a step)"
    )


def _few(values: list[float]) -> str:
    return ", ".join(f"{v:g}" for v in values[:5]) + (", ..." if len(values) > 5 else "")


def _excerpt(rollouts: Any) -> str:
    """One response that ended, as the warnings quote it."""
    ended = [r for r, cut in zip(rollouts.responses, rollouts.truncated.tolist()) if not cut]
    text = next((r for r in ended if r.strip()), "")
    return repr(text[:120] + ("..." if len(text) > 120 else "")) if text else "an empty response"


@dataclass
class IdleGuard:
    """Warns once per step for each cause (`observe`) and stops the run at `limit` idle steps in a row (0: never)."""

    limit: int
    in_a_row: list[int] = field(default_factory=list)
    _causes: list[Cause] = field(default_factory=list)

    def observe(self, step: int, causes: list[Cause]) -> None:
        """Print each cause of step `step`; count it when it left the step idle."""
        for cause in causes:
            print(f"[mrl] step {step}: {cause.message}", file=sys.stderr, flush=True)
        self._causes = [c for c in causes if c.idle]
        self.in_a_row = [*self.in_a_row, step] if self._causes else []

    def stop_if_exhausted(self) -> None:
        """Raise `IdleTraining` when the last `limit` steps were all idle (before the loop saves)."""
        if self.limit and len(self.in_a_row) >= self.limit:
            first, last = self.in_a_row[0], self.in_a_row[-1]
            raise IdleTraining(
                f"steps {first}..{last} trained on nothing ({len(self.in_a_row)} in a row; grpo.max_idle_steps="
                f"{self.limit}): {self._causes[0].message}. The run stopped before saving step {last}; "
                "grpo.max_idle_steps=0 lets such a run go on"
            )


class EnvironmentFailing(TrainingStopped):
    """An environment's reward failed on more of a step's samples than `grpo.max_env_error_fraction` allows."""

    setting = "grpo.max_env_error_fraction"


@dataclass
class EnvironmentErrorGuard:
    """Stops the run (`EnvironmentFailing`, exit 4) after a step on which an environment's reward failed on more than
    `limit` of its samples (a server down or answering garbage, a verifier timing out); None: never, those samples
    score 0 and are counted, and the run goes on. Each environment of a mix is judged on its own samples."""

    limit: float | None
    _failing: list[tuple[str, float]] = field(default_factory=list)
    _step: int = 0
    _example: str = ""

    def observe(self, step: int, metrics: dict[str, float], rollouts: Any) -> None:
        if self.limit is None:
            return
        suffix = "/reward_error_fraction"
        fractions = {
            key.removeprefix("train/env/").removesuffix(suffix): value
            for key, value in metrics.items()
            if key.startswith("train/env/") and key.endswith(suffix)
        } or {"the environment": metrics.get("train/reward_error_fraction", 0.0)}
        self._failing = [(name, value) for name, value in sorted(fractions.items()) if value > self.limit]
        self._step = step
        self._example = rollouts.reward_errors[0] if rollouts.reward_errors else "no message"

    def stop_if_exhausted(self) -> None:
        if not self._failing:
            return
        failing = ", ".join(f"{name} on {value:.0%} of its samples" for name, value in self._failing)
        raise EnvironmentFailing(
            f"step {self._step}: the reward failed for {failing}, past grpo.max_env_error_fraction={self.limit} "
            f"(e.g. {self._example}). The run stopped before saving step {self._step}, whose update learned zeros "
            "nobody judged; once the environment answers again, re-running the command resumes from the last "
            "checkpoint (grpo.max_env_error_fraction=null lets a run go on, those samples scoring 0)"
        )


#: Training steps in a row whose loss is exactly 0 before `ZeroLoss` warns (SFT, DPO, reward model).
ZERO_LOSS_STEPS = 2

_ZERO_LOSS_CAUSES = {
    "sft": "every answer token masked (empty answers, or prompts that fill policy.max_total_sequence_length)",
    "dpo": "no response token in the pairs (empty responses, or prompts that fill policy.max_total_sequence_length)",
    "rm": "no pair scored (empty responses, or prompts that fill policy.max_total_sequence_length)",
}


@dataclass
class ZeroLoss:
    """SFT, DPO and reward-model training: a loss of exactly 0 (no token carried a label; a real NLL, DPO or
    Bradley-Terry loss is never exactly 0 in fp32 short of saturation) for `ZERO_LOSS_STEPS` steps in a row is a
    warning naming the likely cause; each run of such steps warns once."""

    command: str
    in_a_row: int = 0

    def observe(self, step: int, metrics: dict[str, float]) -> None:
        self.in_a_row = self.in_a_row + 1 if metrics.get("train/loss") == 0.0 else 0
        if self.in_a_row == ZERO_LOSS_STEPS:
            grad = metrics.get("train/grad_norm")
            print(
                f"[mrl] step {step}: train/loss has been exactly 0 for {ZERO_LOSS_STEPS} steps in a row"
                + (f" (train/grad_norm {grad:g})" if grad is not None else "")
                + ": the steps learn nothing. "
                f"Likely cause: {_ZERO_LOSS_CAUSES[self.command]}; check the rows (mrl score or the data files)",
                file=sys.stderr,
                flush=True,
            )


#: The figures whose run means `health_summary` reports.
_MEANS = (
    "prompts_rejected_fraction",
    "zero_variance_groups",
    "reward_error_fraction",
    "unparsed_fraction",
    "truncated_fraction",
)


def health_summary(history: dict[str, list[tuple[int, float]]]) -> dict[str, Any]:
    """The run's health for summary.json, from the logged history: steps that warned and steps that trained on
    nothing, the run mean of each step figure, and the last held-out figures (None where never logged)."""

    def values(name: str) -> list[float]:
        return [value for _, value in history.get(name, [])]

    def mean(name: str) -> float | None:
        seen = values(name)
        return sum(seen) / len(seen) if seen else None

    def last(name: str) -> float | None:
        seen = values(name)
        return seen[-1] if seen else None

    summary: dict[str, Any] = {
        "steps_warned": sum(v > 0 for v in values("train/health_warnings")),
        "steps_idle": sum(v > 0 for v in values("train/idle")),
    }
    summary.update({name: mean(f"train/{name}") for name in _MEANS})
    summary.update({f"val_{name}": last(f"val/{name}") for name in ("truncated_fraction", "reward_error_fraction")})
    return summary


def health_cell(summary: dict[str, Any]) -> str:
    """The run's health in one table cell: "ok", or the steps that warned and those that trained on nothing; the
    setting that stopped a run a guard stopped."""
    if summary.get("stopped"):
        return f"stopped ({summary['stopped']['by']})"
    health = summary.get("health")
    if health is None:
        return "-"
    if not health["steps_warned"]:
        return "ok"
    return f"{health['steps_warned']} warned, {health['steps_idle']} idle"
