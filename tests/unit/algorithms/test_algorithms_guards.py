"""The non-finite guard counts skipped steps (those whose every update was skipped) and stops at the limit in a row."""

from __future__ import annotations

import pytest

from mrl.algorithms.guards import NonFiniteGuard, NonFiniteTraining


def _step(fraction: float, loss: float = float("nan")) -> dict[str, float]:
    return {"train/nonfinite": fraction, "train/loss": loss}


def test_only_steps_whose_every_update_was_skipped_count_and_a_finite_one_resets_the_run(capsys):
    guard = NonFiniteGuard(limit=2)
    seen = [guard.observe(step, _step(f)) for step, f in enumerate([1.0, 0.5, 1.0, 0.0, 1.0], start=1)]
    assert seen == [True, False, True, False, True]
    guard.stop_if_exhausted()  # never two in a row
    assert guard.total == 3 and guard.in_a_row == [5]
    assert capsys.readouterr().err.count("its update was skipped") == 3


def test_the_limit_in_a_row_stops_with_the_steps_the_loss_and_the_fix():
    guard = NonFiniteGuard(limit=3)
    for step in (7, 8):
        metrics = _step(1.0)
        guard.observe(step, metrics)
        guard.stop_if_exhausted()
    metrics = _step(1.0, loss=float("inf"))
    guard.observe(9, metrics)
    assert metrics["train/nonfinite_steps"] == 3.0
    with pytest.raises(NonFiniteTraining, match=r"steps 7\.\.9: the loss \(inf at step 9\)") as raised:
        guard.stop_if_exhausted()
    assert "policy.max_nonfinite_steps=3" in str(raised.value) and "policy.optimizer.lr" in str(raised.value)


def test_a_step_without_training_metrics_is_not_skipped():
    guard = NonFiniteGuard(limit=1)
    assert guard.observe(1, {"train/reward": 0.0}) is False
    guard.stop_if_exhausted()
