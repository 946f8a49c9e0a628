"""A run that cannot learn says so, through the real command line (mrl/algorithms/health.py): every prompt longer
than the engine's context leaves for it, on a 1-digit task from the random initial model.

Checked: each step warns with the longest prompt, the limit and the keys that change them; the run stops with exit 2
after grpo.max_idle_steps such steps, with that message and no traceback, and saves nothing from the idle steps;
the step's health figures are in the metrics.
"""

from __future__ import annotations

import re

from mrl.testing.runs import RECIPE, SHORT_ARITH, metrics, mrl

#: 8 tokens of context less 6 new ones: a prompt may take 2 tokens, and "3+4=" takes more.
TOO_LONG = ("policy.max_total_sequence_length=8", "generation.max_new_tokens=6", "generation.vllm.max_model_len=8")


def test_every_prompt_too_long_warns_each_step_and_stops_with_exit_2(tmp_path):
    proc = mrl("grpo", "--config", RECIPE, *SHORT_ARITH, *TOO_LONG, f"run.output_dir={tmp_path}",
               "grpo.max_idle_steps=2", "grpo.max_num_steps=4", "grpo.val_every=0", "checkpointing.save_every=1")
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 2, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    warnings = re.findall(r"\[mrl\] step (\d): every prompt of the step was rejected for length: the longest has "
                          r"(\d+) tokens, and a prompt may take 2 ", out)
    assert [step for step, _ in warnings] == ["1", "2"], out[-4000:]
    assert all(int(longest) > 2 for _, longest in warnings)
    assert "mrl: training stopped: steps 1..2 trained on nothing (2 in a row; grpo.max_idle_steps=2)" in out
    assert "generation.overlong_prompt=truncate" in out
    logged = metrics(tmp_path / "logs")
    assert logged[2]["train/prompts_rejected_fraction"] == 1.0 and logged[2]["train/kept_samples"] == 0
    assert (tmp_path / "checkpoints" / "step_1").is_dir()  # one idle step, under the limit: saved as usual
    assert not (tmp_path / "checkpoints" / "step_2").exists()  # stopped before the second one's save
