"""Where a run leaves its results (mrl/app/results.py): the lines every command ends with name each file that is
there (and only those), a run a guard stops still writes its summary.json saying why, and a single GRPO run draws its
reward curve. Small fakes stand for the loops: no worker starts."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from mrl.algorithms.guards import NonFiniteGuard, NonFiniteTraining
from mrl.algorithms.health import Cause, IdleGuard, IdleTraining
from mrl.app import commands, results
from mrl.app.results import (REWARD_CURVE, SUMMARY_FILE, last_metrics, run_report, save_summary, staged_report,
                             summary_on_stop)
from mrl.config import load_config
from mrl.logging.metrics import MetricsLogger

IDLE = Cause("equal rewards", "every group's rewards were equal", idle=True)


def _config(out: Path, *overrides: str):
    return load_config(None, [f"run.output_dir={out}", *overrides])


def _fake_grpo_loop(logger: MetricsLogger, steps: int, guard: IdleGuard) -> None:
    """What grpo_train does with its metrics and its idle guard: log the step, then stop when the guard says so."""
    for step in range(1, steps + 1):
        guard.observe(step, [IDLE] if step > 1 else [])
        logger.log({"train/reward": 0.25 * step, "train/idle": float(step > 1), "train/health_warnings": 0.0},
                   step=step)
        guard.stop_if_exhausted()


def test_a_run_the_idle_guard_stops_still_writes_its_summary_saying_why(tmp_path):
    logger = MetricsLogger([])
    with pytest.raises(IdleTraining) as stopped:
        with summary_on_stop(tmp_path, lambda: commands._grpo_summary(logger.history, last_metrics(logger.history),
                                                                      12.5)):
            _fake_grpo_loop(logger, steps=10, guard=IdleGuard(limit=2))
    summary = json.loads((tmp_path / SUMMARY_FILE).read_text())
    assert summary["stopped"]["by"] == "grpo.max_idle_steps"
    assert "steps 2..3 trained on nothing (2 in a row" in summary["stopped"]["reason"]
    assert summary["reward_curve"] == [0.25, 0.5, 0.75] and summary["final"]["train/reward"] == 0.75
    assert summary["health"]["steps_idle"] == 2 and summary["seconds"] == 12.5
    assert (tmp_path / REWARD_CURVE).stat().st_size > 1000  # the curve of the steps it made
    # the error goes on (the command line's exit status and message), naming the file
    assert str(tmp_path / SUMMARY_FILE) in str(stopped.value) and "steps 2..3" in str(stopped.value)


def test_a_run_the_nonfinite_guard_stops_writes_its_summary_and_one_that_ends_writes_none(tmp_path):
    guard = NonFiniteGuard(limit=2)
    with pytest.raises(NonFiniteTraining):
        with summary_on_stop(tmp_path, lambda: {"algorithm": "sft", "seconds": 1.0, "final": {}}):
            for step in (1, 2):
                guard.observe(step, {"train/nonfinite": 1.0, "train/loss": float("nan")})
                guard.stop_if_exhausted()
    summary = json.loads((tmp_path / SUMMARY_FILE).read_text())
    assert summary["stopped"]["by"] == "policy.max_nonfinite_steps" and "not finite" in summary["stopped"]["reason"]
    assert not (tmp_path / REWARD_CURVE).exists()  # no reward curve in an SFT summary
    elsewhere = tmp_path / "finished"
    with summary_on_stop(elsewhere, lambda: pytest.fail("summarised without a stop")):
        pass
    with pytest.raises(ValueError):  # not a guard: nothing written, the error unchanged
        with summary_on_stop(elsewhere, lambda: pytest.fail("summarised on another error")):
            raise ValueError("boom")
    assert not elsewhere.exists()


def _lay_out_a_finished_run(out: Path) -> None:
    (out / "final_hf").mkdir(parents=True)
    (out / "final_hf" / ".complete").write_text("")
    save_summary(out, {"algorithm": "grpo", "reward_curve": [0.0, 0.5, 1.0]})
    (out / "logs" / "tensorboard").mkdir(parents=True)
    (out / "logs" / "metrics.jsonl").write_text("{}\n")
    for step in (2, 10):
        (out / "checkpoints" / f"step_{step}").mkdir(parents=True)


def test_the_last_lines_name_every_result_that_is_there(tmp_path):
    out = tmp_path / "my run"
    _lay_out_a_finished_run(out)
    text = run_report(_config(out))
    assert text.splitlines()[0] == f"results in {out}/"
    for path in (out / "final_hf", out / SUMMARY_FILE, out / REWARD_CURVE, out / "logs" / "metrics.jsonl"):
        assert str(path) in text, path
    assert f"tensorboard --logdir {shlex.quote(str(out / 'logs' / 'tensorboard'))}" in text
    assert "newest step_10" in text  # by number, not by name (step_2 sorts after step_10 as text)
    # what is not there is not named: no TensorBoard events, no model yet (a stopped run)
    bare = tmp_path / "bare"
    save_summary(bare, {"algorithm": "sft"})
    text = run_report(_config(bare, "logger.tensorboard=false"), stopped=True)
    assert "stopped" in text.splitlines()[0] and str(bare / SUMMARY_FILE) in text
    assert "tensorboard" not in text.lower() and "final_hf" not in text and "reward curve" not in text


def test_a_command_ends_with_where_its_results_are_also_when_a_guard_stopped_it(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"

    def finished(cfg):
        _lay_out_a_finished_run(out)
        return {"algorithm": "grpo"}

    def stopped(cfg):
        save_summary(out, {"algorithm": "grpo", "stopped": {"by": "grpo.max_idle_steps"}})
        raise IdleTraining("steps 1..3 trained on nothing")

    monkeypatch.setitem(commands.RUNNERS, "grpo", finished)
    assert commands.run_command("grpo", _config(out)) == {"algorithm": "grpo"}
    printed = capsys.readouterr().out
    assert printed.startswith(f"results in {out}/") and str(out / "final_hf") in printed
    assert f"tensorboard --logdir {out / 'logs' / 'tensorboard'}" in printed
    monkeypatch.setitem(commands.RUNNERS, "grpo", stopped)
    with pytest.raises(IdleTraining):
        commands.run_command("grpo", _config(out))
    assert "the run was stopped" in capsys.readouterr().out


def test_a_staged_run_names_each_stage_and_one_tensorboard_command_for_all(tmp_path):
    root = _config(tmp_path)
    stages = [("sft", _config(tmp_path / "sft")), ("grpo", _config(tmp_path / "grpo")),
              ("eval", _config(tmp_path / "eval"))]
    for name in ("sft", "grpo"):
        (tmp_path / name / "final_hf").mkdir(parents=True)
        (tmp_path / name / "final_hf" / ".complete").write_text("")
        (tmp_path / name / "logs" / "tensorboard").mkdir(parents=True)
    save_summary(tmp_path / "eval", {"algorithm": "eval"})
    results.plot_rewards({"grpo": [0.1, 0.9]}, tmp_path / REWARD_CURVE)
    text = staged_report(root, stages)
    assert str(tmp_path / REWARD_CURVE) in text
    assert f"model {tmp_path / 'grpo' / 'final_hf'}/" in text and "(an evaluation: no model)" in text
    assert f"tensorboard --logdir {tmp_path} " in text  # both stages' events under one folder


def test_the_samples_file_is_evals():
    from mrl.algorithms.evaluate import SAMPLES_FILE

    assert results.SAMPLES_FILE == SAMPLES_FILE
