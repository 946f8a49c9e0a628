"""The staged long-context twin (`recipes/grpo-staged-long-tiny-cpu.yaml`) through `mrl run`: three GRPO stages at
1K, 2K and 4K tokens (the last at CP2), each starting from the previous stage's export.

Checked per stage: its sequences really grow past the previous stage's budget and stay within its own; no prompt
is rejected; vLLM's logprobs equal the trainer's on every step (YaRN past the native 1024 positions on both sides,
context parallelism in the last stage); the stage started from the previous stage's final export, whose weights the
previous stage's updates had moved.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import yaml

from mrl.testing.runs import finish, metrics, mrl

RECIPE = str(Path(__file__).resolve().parents[2] / "recipes" / "grpo-staged-long-tiny-cpu.yaml")
BUDGETS = {"grpo-1K": 1024, "grpo-2K": 2048, "grpo-4K": 4096}
SHORT = ("grpo.max_num_steps=2", "checkpointing.save_every=2",  # 2 steps a stage (the recipe runs 4)
         "eval.max_problems=4")  # validation (before and after each stage) is not what this checks


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def test_staged_long_context_twin_grows_the_context_and_hands_checkpoints_on(tmp_path):
    finish(mrl("run", RECIPE, *SHORT, f"run.output_dir={tmp_path}"), timeout=900)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert list(summary) == list(BUDGETS)
    previous_budget, previous_stage = 0, None
    for stage, budget in BUDGETS.items():
        steps = metrics(tmp_path / stage / "logs")
        train = [steps[s] for s in sorted(steps) if s > 0]
        longest = max(m["train/sequence_length_max"] for m in train)
        assert previous_budget < longest <= budget, (stage, longest)
        assert all(m["train/prompts_rejected"] == 0 for m in train)
        assert all(abs(m["train/token_mult_prob_error"] - 1) <= 1e-3 for m in train), stage
        config = yaml.safe_load((tmp_path / stage / "checkpoints" / "step_2" / "config.yaml").read_text())
        assert config["policy"]["max_total_sequence_length"] == budget
        if previous_stage is not None:
            assert Path(config["policy"]["model_name"]) == tmp_path / previous_stage / "final_hf"
        previous_budget, previous_stage = budget, stage
    cp = yaml.safe_load((tmp_path / "grpo-4K" / "checkpoints" / "step_2" / "config.yaml").read_text())
    assert cp["policy"]["parallel"]["context_parallel_size"] == 2
    # the first stage's updates moved the weights it handed on
    start, handed_on = _weights(tmp_path / "grpo-1K" / "initial_model"), _weights(tmp_path / "grpo-1K" / "final_hf")
    assert max((handed_on[k] - w).abs().max().item() for k, w in start.items()) > 1e-5
