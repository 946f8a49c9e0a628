"""The demo's whole staged run on one GPU through Ray, as `mrl run` starts it: recipes/arith-tiny-cpu.yaml (SFT
warm-up on partly wrong labels, GRPO with a 0/1 exact-match reward, held-out evaluation) with the policy in bf16 on
the GPU (a Ray actor), Megatron's own inference engine (`generation.backend=megatron`: no vLLM here) in the
controller process on the same GPU, colocated (a shared-memory refit after every step). What only a whole run
shows: the stages hand on and the GRPO stage learns (held-out accuracy after above before, the training reward
rising), and what a run costs here.

Figures (whole_run.*): held-out accuracy before and after GRPO and of the eval stage, the training reward over the
first and last 10 GRPO steps, the run's wall time and each stage's, GRPO steps/s (median step) and the median refit.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import pytest

from mrl.testing.runs import run_streamed

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "arith-tiny-cpu.yaml"
#: The demo on one GPU. Every stage gets them (`mrl run`'s command-line overrides follow each stage's own).
#: GRPO_STEPS of the demo's 150, meant to keep the whole run within ~4 minutes on an H200; it still learns (on CPU,
#: in fp32, the stage's held-out accuracy levels off well before step 50).
GRPO_STEPS = 60
#: MRL_GPU_WHOLE_PRECISION=float32 runs it in fp32 (default bf16, as on GPUs).
PRECISION = os.environ.get("MRL_GPU_WHOLE_PRECISION", "bfloat16")
#: MRL_GPU_WHOLE_ENGINE=dynamic generates with Megatron's dynamic engine (default: its static loop).
ENGINE = os.environ.get("MRL_GPU_WHOLE_ENGINE", "static")
GPU_OVERRIDES = ("generation.backend=megatron", f"generation.megatron.engine={ENGINE}", "generation.colocated=true",
                 f"policy.precision={PRECISION}",
                 "cluster.num_nodes=1", "cluster.devices_per_node=1", f"grpo.max_num_steps={GRPO_STEPS}",
                 f"grpo.val_every={GRPO_STEPS // 2}", "logger.log_every=10")
TIMEOUT_S = 420


def staged_run_args(out: Path, *overrides: str) -> list[str]:
    """`mrl run` of the demo recipe into `out`, with the GPU overrides and then `overrides`."""
    return ["run", str(RECIPE), *GPU_OVERRIDES, f"run.output_dir={out}", *overrides]


def run_staged(out: Path, *overrides: str, timeout_s: float = TIMEOUT_S) -> tuple[int, str, float]:
    """The staged run (`run_streamed`: killed with every Ray process it started on a timeout): exit status, output,
    seconds."""
    return run_streamed(staged_run_args(out, *overrides), timeout_s)


def _grpo_steps(log_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if "timing/step" in row]


def test_the_demo_learns_as_one_staged_run_on_one_gpu_through_ray(tmp_path, figure):
    pytest.importorskip("ray", reason="Ray is carried in the GPU tier's wheelhouse (make gpu-wheelhouse)")
    out = tmp_path / "run"
    returncode, output, seconds = run_staged(out)
    assert returncode == 0, output[-4000:]

    summary = json.loads((out / "summary.json").read_text())
    sft, grpo, final = summary["sft-warmup"], summary["grpo"], summary["eval"]
    steps = _grpo_steps(out / "grpo" / "logs")
    step_s = statistics.median(row["timing/step"] for row in steps)
    refits = [row["timing/refit"] for row in steps if "timing/refit" in row]
    figure("whole_run.seconds", seconds, "s", grpo_steps=GRPO_STEPS)
    for name, stage in (("sft", sft), ("grpo", grpo), ("eval", final)):
        figure(f"whole_run.{name}_seconds", stage["seconds"], "s")
    figure("whole_run.val_accuracy_before", grpo["val_accuracy_before"], "fraction")
    figure("whole_run.val_accuracy_after", grpo["val_accuracy_after"], "fraction")
    figure("whole_run.eval_accuracy", final["final"]["val/accuracy"], "fraction")
    figure("whole_run.reward_first10", grpo["reward_first10"], "mean reward")
    figure("whole_run.reward_last10", grpo["reward_last10"], "mean reward")
    figure("whole_run.grpo_steps_per_s", 1.0 / step_s, "steps/s", median_step_s=step_s, steps=len(steps))
    if refits:
        figure("whole_run.refit_s", statistics.median(refits), "s (median)", max_s=max(refits))
    if grpo.get("token_mult_prob_error_max") is not None:
        figure("whole_run.token_mult_prob_error_max", grpo["token_mult_prob_error_max"], "ratio")

    assert len(steps) == GRPO_STEPS, f"{len(steps)} GRPO steps logged"
    assert grpo["val_accuracy_after"] > grpo["val_accuracy_before"] + 0.05, grpo
    assert grpo["reward_last10"] > grpo["reward_first10"], grpo
    assert final["final"]["val/accuracy"] > grpo["val_accuracy_before"], final
