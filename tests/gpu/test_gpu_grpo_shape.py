"""A few GRPO steps of a Qwen3-0.6B-shaped policy on one GPU through Ray, as `mrl grpo` runs them: random weights
(`policy.build` at Qwen3-0.6B's shape: 28 layers, hidden 1024, 16 query heads of 128 over 8 key/value heads, MLP
3072, 151,936-row tied vocabulary), bf16, Megatron's engine colocated, responses of about RESPONSE_TOKENS tokens
(a random model rarely samples its end token). The task's reward is always 0 (the arithmetic task; the model is
random): the point is what a step costs at a real shape, and that its memory is what `mrl plan` says.

Figures (grpo_shape.*), from the steps after the first (which compiles and warms the allocator): generation
tokens/s, the refit's seconds and GiB/s, train and logprob tokens/s, the policy's allocator peak in its logprob and
train phases against `mrl plan`'s prediction for the same config (the plan's states and activations, without the
CUDA context and slack it adds for a whole GPU), the device's memory in use as generation ends, and the
engine/trainer mismatch in bf16 (`train/token_mult_prob_error`).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mrl.testing.runs import RECIPE, run_streamed
from mrl.testing.shape_run import (
    FIGURES,
    RESPONSE_TOKENS,
    STEPS,
    logged_rows,
    planned,
    run_overrides,
    step_figures,
)


def test_qwen3_06b_shaped_grpo_steps_on_one_gpu(tmp_path, figure):
    pytest.importorskip("ray", reason="Ray is carried in the GPU tier's wheelhouse (make gpu-wheelhouse)")
    import torch

    out = tmp_path / "run"
    overrides = run_overrides(out)
    returncode, output, seconds = run_streamed(["grpo", "--config", RECIPE, *overrides], timeout_s=320)
    # Figures first: a run cut by its limit still tells what its steps cost.
    rows = logged_rows(out / "logs")
    got = step_figures(rows)
    figure("grpo_shape.seconds", seconds, "s", steps=STEPS, exit=returncode,
           steps_logged=sum("timing/step" in row for row in rows))
    for key, unit in FIGURES:
        if key in got:
            figure(f"grpo_shape.{key}", got[key], unit)
    if "refit_s" in got:
        figure("grpo_shape.refit_s", got["refit_s"], "s (median)", gib_s=round(got["refit_gib_s"], 1))
    gpu_total = torch.cuda.get_device_properties(0).total_memory
    model_config = out / "initial_model" / "config.json"  # written before the first step
    plan = planned(Path(RECIPE), overrides, model_config, gpu_total) if model_config.exists() else {}
    for phase, key in (("train", "peak_memory_gib"), ("logprob", "logprob_peak_memory_gib")):
        if key in got and plan:
            figure(f"grpo_shape.{phase}_peak_gib", got[key], "GiB", planned_gib=round(plan[f"{phase}_gib"], 2),
                   measured_over_planned=round(got[key] / plan[f"{phase}_gib"], 3))
    if "generation_device_used_gib" in got and plan:
        figure("grpo_shape.generation_device_used_gib", got["generation_device_used_gib"], "GiB",
               planned_generate_gib=round(plan["generate_gib"], 2),
               engine_peak_gib=round(got["generation_engine_peak_gib"], 2))

    assert returncode == 0, output[-4000:]
    assert "refit_s" in got, "no refit logged"
    assert got["response_length"] > RESPONSE_TOKENS / 2, got  # a random model seldom ends a response early
    assert got["token_mult_prob_error"] < 1.1, got
    for phase, key in (("train", "peak_memory_gib"), ("logprob", "logprob_peak_memory_gib")):
        assert 0.5 < got[key] / plan[f"{phase}_gib"] < 1.5, (phase, got[key], plan)
