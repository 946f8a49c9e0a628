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


def test_repeated_names_and_references_of_the_wrong_kind_are_refused_before_any_stage(tmp_path):
    import pytest

    from mrl.config.errors import ConfigError

    staged = tmp_path / "staged.yaml"
    wrong = (STAGED.replace("reward_model_from: rm", "reward_model_from: sft")  # an SFT model as the reward
             .replace("{{name: rm, algorithm: rm, init_from: sft}}", "{{name: rm, algorithm: rm, init_from: sft}}\n"
                      "  - {{name: rm, algorithm: rm}}\n  - {{name: pol, algorithm: dpo, init_from: rm}}"))
    staged.write_text(wrong.format(recipe=RECIPE))
    overrides = [f"run.output_dir={tmp_path}"]
    with pytest.raises(ConfigError) as info:
        stage_configs(staged, load_config(staged, overrides), overrides)
    problems = {(p.key, p.given): p for p in info.value.problems}
    assert problems.keys() == {("stages.name", "rm"), ("stages.init_from", "rm"), ("stages.reward_model_from", "sft")}
    assert "second would find the first's results" in problems["stages.name", "rm"].message
    assert "the rm stage 'rm'" in problems["stages.init_from", "rm"].message
    assert problems["stages.init_from", "rm"].allowed == "sft"
    assert problems["stages.reward_model_from", "sft"].allowed == "rm"


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


def test_a_stage_a_guard_stops_ends_the_staged_run_with_its_summary_and_where_the_results_are(tmp_path, monkeypatch,
                                                                                            capsys):
    """Fakes stand for the stages' runs: SFT finishes, GRPO is stopped by the idle guard (it writes its summary,
    saying why, as mrl/app/results.py summary_on_stop does); the staged run writes its own summary.json and reward
    curve all the same, its table says which stage stopped, and it prints where the results are."""
    import json

    import pytest

    from mrl.algorithms.health import IdleTraining
    from mrl.app import commands
    from mrl.app.results import save_summary
    from mrl.app.stages import run_staged

    def sft(cfg):
        out = Path(cfg.run.output_dir)
        (out / "final_hf").mkdir(parents=True)
        (out / "final_hf" / ".complete").write_text("")
        summary = {"algorithm": "sft", "seconds": 6.0, "final": {}}
        save_summary(out, summary)
        return summary

    def grpo(cfg):
        save_summary(Path(cfg.run.output_dir), {"algorithm": "grpo", "seconds": 3.0, "final": {},
                                                "reward_curve": [0.0, 0.0, 0.0],
                                                "stopped": {"by": "grpo.max_idle_steps", "reason": "idle"}})
        raise IdleTraining("steps 1..3 trained on nothing")

    monkeypatch.setitem(commands.RUNNERS, "sft", sft)
    monkeypatch.setitem(commands.RUNNERS, "grpo", grpo)
    monkeypatch.setitem(commands.RUNNERS, "eval", lambda cfg: pytest.fail("a stage after the stopped one ran"))
    with pytest.raises(IdleTraining):
        run_staged("arith-tiny-cpu", [f"run.output_dir={tmp_path}"])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert list(summary) == ["sft-warmup", "grpo"] and summary["grpo"]["stopped"]["by"] == "grpo.max_idle_steps"
    assert (tmp_path / "reward_curve.png").is_file() and (tmp_path / "grpo" / "reward_curve.png").is_file()
    printed = capsys.readouterr().out
    assert "stopped (grpo.max_idle_steps)" in printed
    assert f"stage sft-warmup: {tmp_path}/sft-warmup/   (model {tmp_path}/sft-warmup/final_hf/)" in printed
    assert f"stage grpo:       {tmp_path}/grpo/   (stopped: its summary.json says why)" in printed
    assert f"stage eval:       {tmp_path}/eval/   (not run)" in printed


def test_a_stage_s_bad_override_or_missing_config_file_names_the_stage(tmp_path):
    import pytest

    from mrl.config.errors import ConfigError

    staged = tmp_path / "staged.yaml"
    staged.write_text("stages:\n  - {name: a, algorithm: sft, overrides: [grpo.num_generation_per_prompt=4]}\n")
    with pytest.raises(ConfigError) as info:
        stage_configs(staged, load_config(staged), [])
    assert info.value.key == "grpo.num_generation_per_prompt"
    assert info.value.message == ("stage 'a', set by stages[0].overrides (grpo.num_generation_per_prompt=4): "
                                  "unknown key")
    assert info.value.fix == "did you mean 'grpo.num_generations_per_prompt'?"
    staged.write_text("stages:\n  - {name: a, algorithm: sft}\n  - {name: b, algorithm: sft, config: nothere.yaml}\n")
    with pytest.raises(ConfigError) as info:
        stage_configs(staged, load_config(staged), [])
    assert info.value.key == "stages[1].config" and info.value.given == "nothere.yaml"
    assert info.value.message == f"stage 'b': its config file is not found: {tmp_path / 'nothere.yaml'}"
