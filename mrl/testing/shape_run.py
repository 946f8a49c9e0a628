"""A few GRPO steps of a real-shaped policy from random weights (`tests/gpu/test_gpu_grpo_shape.py`, the GPU tier's
Qwen3-0.6B run): its command-line overrides, the figures of its metrics, and `mrl plan`'s prediction for the same
config. Here so that the parts a GPU session relies on are checked on CPU (tests/unit/test_testing_shape_run.py):
a mistyped key or a missing metric would otherwise cost a lent GPU's minutes."""

from __future__ import annotations

import statistics
from pathlib import Path

from mrl.testing.runs import MACHINERY, metrics

GiB = 2**30
STEPS = 3
RESPONSE_TOKENS = 1024
PROMPTS, GENERATIONS = 8, 8  # 64 responses a step, about 66K tokens
SHAPE = (
    "policy.build.family=qwen3",
    "policy.build.num_layers=28",
    "policy.build.hidden_size=1024",
    "policy.build.num_attention_heads=16",
    "policy.build.num_key_value_heads=8",
    "policy.build.head_dim=128",
    "policy.build.intermediate_size=3072",
    "policy.build.tie_word_embeddings=true",
    "policy.build.vocab_size=151936",
)


def run_overrides(out: Path, shape: tuple[str, ...] = SHAPE, response_tokens: int = RESPONSE_TOKENS) -> list[str]:
    """`mrl grpo --config arith-tiny-cpu.yaml` made a few steps of a real-shaped model (the recipe's own keys
    otherwise): its packing, batch and lengths sized for 16K-token micro-batches."""
    length = 32 + response_tokens  # the task's prompts are a few tokens
    return [
        *shape,
        *MACHINERY,  # every reward is 0: no step can learn, which is not a fault here
        "policy.precision=bfloat16",
        f"policy.max_total_sequence_length={length}",
        "policy.sequence_packing.tokens_per_microbatch=16384",
        # two updates a step: the logprob pass runs (one update takes pi_old from its own forward)
        f"policy.train_global_batch_size={PROMPTS * GENERATIONS // 2}",
        f"policy.train_micro_batch_size={PROMPTS * GENERATIONS // 2}",
        f"policy.logprob_micro_batch_size={PROMPTS * GENERATIONS}",
        "policy.optimizer.lr=1.0e-6",
        "generation.backend=megatron",
        "generation.colocated=true",
        f"generation.max_new_tokens={response_tokens}",
        f"generation.vllm.max_model_len={length}",
        f"grpo.num_prompts_per_step={PROMPTS}",
        f"grpo.num_generations_per_prompt={GENERATIONS}",
        f"grpo.max_num_steps={STEPS}",
        "grpo.val_every=0",
        "data.arith.num_heldout=1",  # validation before and after: one problem
        "eval.num_samples=1",
        "eval.pass_k=[1]",
        "checkpointing.enabled=false",  # a step's speed, not the disk's: an 8 GB checkpoint would cost more than a step
        "logger.log_every=1",
        "cluster.num_nodes=1",
        "cluster.devices_per_node=1",
        f"run.output_dir={out}",
    ]


#: The figures of `step_figures` a GPU session records, with their units (all that a run logged, even a cut one).
FIGURES = (
    ("step_s", "s (median)"),
    ("generation_s", "s (median)"),
    ("train_s", "s (median)"),
    ("logprob_s", "s (median)"),
    ("response_length", "tokens (median of the steps' means)"),
    ("generation_tokens_s", "tokens/s"),
    ("train_tokens_s", "tokens/s"),
    ("logprob_tokens_s", "tokens/s"),
    ("token_mult_prob_error", "ratio (max)"),
)


def logged_rows(log_dir: Path) -> list[dict]:
    """metrics.jsonl's rows in step order (`runs.metrics`) as far as the run got; none when it never logged."""
    return list(metrics(log_dir).values()) if (log_dir / "metrics.jsonl").exists() else []


def step_figures(rows: list[dict]) -> dict[str, float]:
    """The medians over the logged steps after the first of what a step costs (rows: metrics.jsonl's rows; none
    when no step was logged)."""
    logged = [row for row in rows if "timing/step" in row]
    steps = logged[1:] or logged
    if not steps:
        return {}

    def median(f):
        return statistics.median(f(row) for row in steps)

    responses = PROMPTS * GENERATIONS

    def tokens(row):  # the step's sequences' tokens (the prompts' counted at their longest: a few tokens each)
        return responses * (row["train/response_length"] + row["train/prompt_tokens_max"])

    figures = {
        "generation_tokens_s": median(lambda r: responses * r["train/response_length"] / r["timing/generation"]),
        "response_length": median(lambda r: r["train/response_length"]),
        "train_tokens_s": median(lambda r: tokens(r) / r["timing/train"]),
        "logprob_tokens_s": median(lambda r: tokens(r) / r["timing/logprobs"]),
        "step_s": median(lambda r: r["timing/step"]),
        "generation_s": median(lambda r: r["timing/generation"]),
        "train_s": median(lambda r: r["timing/train"]),
        "logprob_s": median(lambda r: r["timing/logprobs"]),
        "token_mult_prob_error": max(r["train/token_mult_prob_error"] for r in steps),
    }
    refits = [row for row in steps if "timing/refit" in row]
    if refits:
        figures["refit_s"] = statistics.median(r["timing/refit"] for r in refits)
        figures["refit_gib_s"] = statistics.median(r["train/refit_bytes"] / GiB / r["timing/refit"] for r in refits)
    for key in (
        "train/peak_memory_gib",
        "train/logprob_peak_memory_gib",
        "memory/generation_device_used_gib",
        "memory/generation_engine_peak_gib",
    ):
        if all(key in row for row in steps):
            figures[key.split("/")[1]] = max(row[key] for row in steps)
    return figures


def planned(config: str | Path, overrides: list[str], model_config: Path, gpu_total: int) -> dict[str, float]:
    """`mrl plan`'s policy bytes for the same run, in GiB: states + the larger activation peak (its train column
    less the CUDA context and slack), the weights + the logprob pass's activations (what a logprob pass holds
    after the hand-over moved the optimizer states out), and its generate column."""
    from mrl.app.plan import make_plan
    from mrl.config import load_config

    cfg = load_config(str(config), overrides)
    plan = make_plan(cfg, model_config_path=str(model_config), gpu_total=gpu_total)
    stage = plan.stages[0]
    acts = stage.activations
    return {
        "train_gib": (stage.states.states + max(acts.train_peak, acts.logprob_peak)) / GiB,
        "logprob_gib": (stage.states.weights + acts.logprob_peak) / GiB,
        "generate_gib": stage.generate_phase / GiB,
    }
