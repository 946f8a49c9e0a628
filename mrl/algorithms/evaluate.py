"""Evaluation: sample the held-out problems with the rollout engine, score them, report pass@k, keep every sample.

    problems --encode--> prompts --engine (eval sampling: n = eval.num_samples)--> samples --environment--> rewards
    val/accuracy = mean reward over all samples (pass@1 for 0/1 rewards)
    val/pass@k   = mean over problems of the unbiased pass@k (mrl.objectives.passk), correct = reward > 0.5
Every sample comes back as a `SampleRecord` (prompt, response, gold and extracted answer, reward): `mrl eval` writes
them to samples.jsonl and prints a few, and GRPO's validation writes them per step, so a user can see why accuracy
is what it is. The same code serves `mrl eval` and validation inside GRPO.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence

from mrl.algorithms.env_metrics import per_env_metrics
from mrl.algorithms.rollout import decode_text, generate_and_score
from mrl.config.schema import MrlConfig
from mrl.data.datasets import Problem
from mrl.data.tasks import TaskData, encode_prompts
from mrl.environments.base import Environment
from mrl.inference.factory import sampling_config
from mrl.inference.interface import GenerationBackend, SamplingConfig
from mrl.objectives.passk import pass_at_k, pass_k_problem

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

SAMPLES_FILE = "samples.jsonl"


@dataclass(frozen=True)
class SampleRecord:
    """One evaluated sample, as written to samples.jsonl."""

    problem_index: int  # the row of the problem in its source file (arith: in the held-out set)
    sample_index: int
    problem: str  # the problem as its source gives it (no template, no instruction)
    prompt: str  # what the engine was given
    response: str
    gold_answer: str
    extracted_answer: Optional[str]
    reward: float
    finish_reason: str
    #: The engine's mean logprob per response token (stop token included), of the raw distribution (temperature 1,
    #: unfiltered: vLLM's raw_logprobs); how likely the model finds its own answer (mrl.app.self_pairs reads it).
    mean_logprob: float = 0.0
    env: str = ""  # the environment that scored it, in a run with several (`envs`)


@dataclass
class Evaluation:
    metrics: dict[str, float]
    samples: list[SampleRecord]


def evaluate(
    engine: GenerationBackend,
    env: Environment,
    tokenizer: "PreTrainedTokenizerBase",
    problems: Sequence[Problem],
    prompt_ids: Sequence[Sequence[int]],
    sampling: SamplingConfig,
    pass_k: Sequence[int],
) -> Evaluation:
    """`val/accuracy`, `val/response_length`, `val/pass@k` for each k, and the held-out health (responses cut at
    max_new_tokens, answers the reward could not read), with every sample."""
    problem = pass_k_problem(pass_k, sampling.n)
    if problem:
        raise ValueError(f"eval.pass_k: {problem}; raise eval.num_samples or lower k")
    engine.prepare_for_generation()  # a colocated engine may be asleep (a start-up or a refit left it so)
    rollouts = generate_and_score(engine, env, tokenizer, problems, prompt_ids, sampling)
    correct = (rollouts.rewards > 0.5).view(len(prompt_ids), sampling.n).sum(dim=1).tolist()
    metrics = {
        "val/accuracy": float(rollouts.rewards.mean()),
        "val/response_length": float(rollouts.response_lengths.float().mean()),
        "val/truncated_fraction": float(rollouts.truncated.float().mean()),
        "val/reward_error_fraction": rollouts.num_reward_errors / max(len(rollouts.responses), 1),
        **{f"val/{key}": value for key, value in rollouts.counts.items()},
    }
    for k in pass_k:
        metrics[f"val/pass@{k}"] = sum(pass_at_k(sampling.n, c, k) for c in correct) / len(correct)
    metrics.update(per_env_metrics("val", rollouts, sampling.n))
    prompts = [decode_text(tokenizer, ids, skip_special_tokens=False) for ids in prompt_ids]
    mean_logprobs = response_mean_logprobs(rollouts.generation_logprobs, rollouts.loss_mask)
    samples = [
        SampleRecord(
            problems[row // sampling.n].row,
            row % sampling.n,
            problems[row // sampling.n].problem,
            prompts[row // sampling.n],
            rollouts.responses[row],
            problems[row // sampling.n].answer,
            rollouts.extracted_answers[row],
            float(rollouts.rewards[row]),
            rollouts.finish_reasons[row].value,
            mean_logprobs[row],
            problems[row // sampling.n].env,
        )
        for row in range(len(rollouts.responses))
    ]
    return Evaluation(metrics, samples)


def response_mean_logprobs(logprobs: "torch.Tensor", mask: "torch.Tensor") -> list[float]:
    """Each row's mean logprob over its response tokens ([B, T] each; 0.0 for an empty response)."""
    counts = mask.sum(dim=1)
    return ((logprobs * mask).sum(dim=1) / counts.clamp(min=1)).tolist()


def validate(
    cfg: MrlConfig, engine: GenerationBackend, env: Environment, tokenizer: "PreTrainedTokenizerBase", data: TaskData
) -> Optional[Evaluation]:
    """Evaluate on the run's validation problems (at most eval.max_problems) with the eval sampling settings;
    None when the run has none."""
    if not data.val:
        return None
    problems = data.val[: cfg.eval.max_problems] if cfg.eval.max_problems else data.val
    problems, prompts = encode_prompts(problems, tokenizer, data, cfg)
    if not problems:
        return None
    sampling = sampling_config(cfg, purpose="eval", turn_end_id=data.template.turn_end_id(tokenizer))
    return evaluate(engine, env, tokenizer, problems, prompts, sampling, cfg.eval.pass_k)


def write_samples(path: Path, samples: Sequence[SampleRecord]) -> Path:
    """Every sample as one JSON object per line (written whole, then renamed: never a half file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    with open(partial, "w") as out:
        for sample in samples:
            out.write(json.dumps(asdict(sample)) + "\n")
    partial.replace(path)
    return path


def format_examples(samples: Sequence[SampleRecord], count: int = 3, width: int = 100) -> str:
    """The first sample of the first `count` problems, one block each: prompt, response, gold/extracted, reward."""

    def cut(text: str) -> str:
        text = " ".join(text.split())
        return text if len(text) <= width else text[: width - 3] + "..."

    blocks = []
    for sample in [s for s in samples if s.sample_index == 0][:count]:
        blocks.append(
            f"  prompt:   {cut(sample.prompt)}\n  response: {cut(sample.response)}\n"
            f"  gold: {sample.gold_answer!r}  extracted: {sample.extracted_answer!r}  "
            f"reward: {sample.reward:g}  ({sample.finish_reason})"
        )
    return "\n".join(blocks)
