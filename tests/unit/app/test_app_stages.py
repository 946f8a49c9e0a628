"""Stage hand-on in staged recipes: each stage starts from the final export that its source stage's
run.final_format names (final_hf/ or final_megatron/), resolved before any stage runs."""

from __future__ import annotations

from pathlib import Path

from mrl.app.stages import stage_configs, summary_table
from mrl.config import load_config

RECIPE = Path(__file__).resolve().parents[3] / "recipes" / "preference-arith-tiny-cpu.yaml"
STAGED = """defaults: {recipe}
run:
  final_format: megatron
stages:
  - {{name: sft, algorithm: sft, init_from_previous: false, overrides: [run.final_format=hf]}}
  - {{name: rm, algorithm: rm, init_from: sft}}
  - {{name: grpo, algorithm: grpo, init_from: sft, reward_model_from: rm}}
  - {{name: eval, algorithm: eval}}
"""


def test_each_stage_starts_from_the_export_its_source_stage_writes(tmp_path):
    staged = tmp_path / "staged.yaml"
    staged.write_text(STAGED.format(recipe=RECIPE))
    overrides = [f"run.output_dir={tmp_path}"]
    root = load_config(staged, overrides)
    configs = {stage.name: cfg for stage, cfg in zip(root.stages, stage_configs(staged, root, overrides))}
    assert [configs[name].run.final_format for name in ("sft", "rm", "grpo")] == ["hf", "megatron", "megatron"]
    assert configs["rm"].policy.model_name == str(tmp_path / "sft" / "final_hf")
    assert configs["grpo"].policy.model_name == str(tmp_path / "sft" / "final_hf")
    assert configs["grpo"].env.reward_model.model == str(tmp_path / "rm" / "final_megatron")
    assert configs["eval"].policy.model_name == str(tmp_path / "grpo" / "final_megatron")


def test_the_final_table_has_a_health_column_for_grpo_stages():
    grpo = {"algorithm": "grpo", "seconds": 60.0, "reward_first10": 0.25, "reward_last10": 0.75,
            "val_accuracy_before": 0.5, "val_accuracy_after": 0.875, "final": {},
            "health": {"steps_warned": 0, "steps_idle": 0}}
    idle = {**grpo, "health": {"steps_warned": 3, "steps_idle": 2}}
    dpo = {"algorithm": "dpo", "seconds": 30.0, "val_accuracy_before": 0.5, "val_accuracy_after": 0.625, "final": {}}
    lines = summary_table({"rl": grpo, "stuck": idle, "pairs": dpo}).splitlines()
    assert lines[0].split()[-1] == "health"
    assert lines[2].split()[-1] == "ok" and lines[3].endswith("3 warned, 2 idle") and lines[4].split()[-1] == "-"
    assert lines[2].split()[:4] == ["rl", "grpo", "1.0", "min"]
