"""`mrl check RUN_DIR RECIPE` (mrl/app/check.py): a run's summary.json against the recipe's expect: block, with
summaries written by hand: a staged run's and a single command's, figures that hold, miss, are differences, or name
nothing; the command's exit statuses and its lines."""

from __future__ import annotations

import json

import pytest
import yaml

from mrl.app.check import MISSED_EXIT_CODE, check_run, figure_value, report
from mrl.cli import main
from mrl.config import ConfigError, load_config

STAGED = {
    "sft-warmup": {"algorithm": "sft", "seconds": 10.0, "final": {"train/loss": 0.5}},
    "grpo": {"algorithm": "grpo", "seconds": 60.0, "reward_first10": 0.45, "reward_last10": 0.97,
             "val_accuracy_before": 0.41, "val_accuracy_after": 0.98, "health": {"steps_idle": 0},
             "final": {"train/reward": 0.96}},
}


def _recipe(tmp_path, figures: dict, verified: bool = True, name: str = "recipe.yaml"):
    recipe = tmp_path / name
    recipe.write_text(yaml.safe_dump({"expect": {"verified": verified, "source": "by hand", "figures": figures}}, sort_keys=False))
    return recipe


def _run(tmp_path, summary: dict):
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    (run / "summary.json").write_text(json.dumps(summary))
    return run


def test_paths_reach_into_a_staged_summary_and_differences_subtract():
    assert figure_value(STAGED, "grpo.val_accuracy_after") == 0.98
    assert figure_value(STAGED, "grpo.final.train/reward") == 0.96
    assert figure_value(STAGED, "grpo.health.steps_idle") == 0.0
    assert figure_value(STAGED, "grpo.reward_last10 - grpo.reward_first10") == pytest.approx(0.52)


def test_every_figure_is_judged_against_its_bounds(tmp_path):
    figures = {
        "grpo.val_accuracy_after": {"min": 0.9},  # 0.98: holds
        "grpo.reward_last10 - grpo.reward_first10": {"min": 0.6},  # 0.52: missed
        "grpo.health.steps_idle": {"max": 0},  # 0: holds at the bound
        "grpo.final.train/reward": {"min": 0.5, "max": 0.9},  # 0.96: above its max
    }
    cfg = load_config(str(_recipe(tmp_path, figures)), [])
    results = check_run(_run(tmp_path, STAGED), cfg)
    assert [r.ok for r in results] == [True, False, True, False]
    text = report(results, cfg)
    assert "MISSED grpo.reward_last10 - grpo.reward_first10 = 0.52 (expected >= 0.6)" in text
    assert "MISSED grpo.final.train/reward = 0.96 (expected >= 0.5 and <= 0.9)" in text
    assert "ok     grpo.health.steps_idle = 0 (expected <= 0)" in text
    assert text.splitlines()[-1] == (
        "[mrl check] 2 of 4 figures missed: grpo.reward_last10 - grpo.reward_first10, grpo.final.train/reward "
        "(figures: by hand)"
    )


def test_a_single_commands_summary_is_reached_without_a_stage(tmp_path):
    cfg = load_config(str(_recipe(tmp_path, {"val_accuracy_after": {"min": 0.5}}, verified=False)), [])
    results = check_run(_run(tmp_path, STAGED["grpo"]), cfg)
    assert [r.ok for r in results] == [True]
    assert "UNVERIFIED figures" in report(results, cfg)


def test_a_path_that_names_nothing_is_a_config_error_naming_what_is_there(tmp_path):
    cfg = load_config(str(_recipe(tmp_path, {"grpo.val_acc": {"min": 0.5}})), [])
    with pytest.raises(ConfigError) as err:
        check_run(_run(tmp_path, STAGED), cfg)
    text = err.value.render()
    assert "expect.figures.grpo.val_acc" in text and "grpo has no 'val_acc'" in text
    assert "val_accuracy_after" in text  # what the stage does hold


def test_a_figure_without_a_bound_is_refused_when_the_recipe_loads(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(str(_recipe(tmp_path, {"grpo.val_accuracy_after": {}})), [])
    assert "a figure needs a min, a max or both" in err.value.render()


def test_the_command_exits_0_when_every_figure_holds_and_5_naming_a_miss(tmp_path, capsys):
    run = _run(tmp_path, STAGED)
    assert main(["check", str(run), str(_recipe(tmp_path, {"grpo.val_accuracy_after": {"min": 0.9}}))]) == 0
    assert "every figure holds" in capsys.readouterr().out
    missed = _recipe(tmp_path, {"grpo.val_accuracy_after": {"min": 0.99}}, name="strict.yaml")
    assert main(["check", str(run), str(missed)]) == MISSED_EXIT_CODE == 5
    assert "MISSED grpo.val_accuracy_after = 0.98 (expected >= 0.99)" in capsys.readouterr().out
    assert main(["check", str(tmp_path / "nowhere"), str(missed)]) == 1  # no summary.json: the run's folder is wrong
    assert main(["check", str(run), str(tmp_path / "strict.yaml"), "~expect"]) == 2  # a recipe that expects nothing


@pytest.mark.parametrize("summary, found", [
    ("{bad", "summary.json is not valid JSON (Expecting property name"),  # cut short or edited by hand
    ("[]", "summary.json holds a list, not a run's summary (a JSON object)"),
    ("{}", "summary.json holds no stage 'grpo' (it holds: nothing), which the recipe's figure 'grpo.reward_last10'"),
    (json.dumps({"sft-warmup": STAGED["sft-warmup"]}), "holds no stage 'grpo' (it holds: sft-warmup)"),  # unfinished
])
def test_a_run_folder_without_a_finished_runs_summary_is_blamed_not_the_recipe(summary, found, tmp_path, capsys):
    """RUN_DIR is wrong, not the recipe: exit 1 (as for no summary.json), the folder named, no traceback."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(summary)
    recipe = {"grpo.reward_last10": {"min": 0.5}, "sft-warmup.final.train/loss": {"max": 1}}
    staged = tmp_path / "staged.yaml"
    staged.write_text(yaml.safe_dump({"stages": [{"name": "sft-warmup", "algorithm": "sft"},
                                                 {"name": "grpo", "algorithm": "grpo"}],
                                      "expect": {"figures": recipe}}))
    assert main(["check", str(run), str(staged)]) == 1
    err = capsys.readouterr().err
    assert f"mrl: error: {run / 'summary.json'}" in err and found in err, err
    assert "RUN_DIR must be" in err and "expect.figures" not in err and "Traceback" not in err


def test_an_empty_summary_of_a_single_command_is_the_run_folders_fault(tmp_path):
    from mrl.app.check import NoFinishedRun

    cfg = load_config(str(_recipe(tmp_path, {"val_accuracy_after": {"min": 0.5}})), [])
    with pytest.raises(NoFinishedRun, match="holds no 'val_accuracy_after' .it holds: nothing.*wrong or unfinished run"):
        check_run(_run(tmp_path, {}), cfg)
    with pytest.raises(ConfigError, match="the summary has no 'val_acc'"):  # a summary with figures: the path is wrong
        check_run(_run(tmp_path, STAGED["grpo"]), load_config(str(_recipe(tmp_path, {"val_acc": {"min": 0}})), []))


def test_every_shipped_recipe_with_expectations_names_figures_its_kind_of_run_writes():
    """The shipped recipes' figures are paths a run of theirs writes: the stage names of staged recipes, the summary
    keys of their algorithms (mrl/app/results.py)."""
    from mrl.config.recipes import find_recipe, shipped_recipes

    keys = {"reward_first10", "reward_last10", "val_accuracy_before", "val_accuracy_after", "health", "final",
            "token_mult_prob_error_max", "val/preference_accuracy_before", "val/preference_accuracy_after",
            "val/accuracy_before", "val/accuracy_after", "env"}
    checked = 0
    for name in shipped_recipes():
        cfg = load_config(str(find_recipe(name)), [])
        if cfg.expect is None:
            continue
        stages = {stage.name for stage in cfg.stages}
        for figure in cfg.expect.figures:
            for part in figure.split(" - "):
                first, *rest = part.strip().split(".")
                if stages:
                    assert first in stages, (name, figure)
                    first = rest[0]
                assert first in keys, (name, figure)
            checked += 1
    assert checked >= 10
