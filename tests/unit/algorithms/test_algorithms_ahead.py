"""RolloutsAhead, the schedule of asynchronous GRPO (mrl/algorithms/ahead.py), with a producer standing in for the
engine: which weights generate which step, that generation really overlaps training, that the engine is never
refitted while it generates, and that a checkpoint's in-flight rollouts come back exactly."""

from __future__ import annotations

import io
import threading

import pytest
import torch

from mrl.algorithms.ahead import RolloutsAhead
from mrl.algorithms.rollout import Rollouts
from mrl.inference.interface import FinishReason


def _rollouts(step: int, version: int) -> Rollouts:
    ids = torch.arange(6).view(2, 3) + step
    return Rollouts(ids, torch.ones(2, 3), torch.full((2, 3), -0.5), torch.tensor([1.0, 0.0]), torch.tensor([3, 2]),
                    torch.tensor([False, True]), lengths=torch.tensor([3, 3]), responses=["a", "b"],
                    extracted_answers=["1", None], finish_reasons=[FinishReason.STOP, FinishReason.LENGTH],
                    policy_version=version)


class Engine:
    """Records what the schedule asks of it; refit fails if it comes while a generation runs."""

    def __init__(self, gate: threading.Event | None = None, load_gate: threading.Event | None = None,
                 fail_refit: bool = False) -> None:
        self.generating, self.calls, self.gate = False, [], gate
        self.load_gate, self.fail_refit = load_gate, fail_refit

    def produce(self, step: int, problems: list, version: int):
        self.generating = True
        if self.gate is not None:
            assert self.gate.wait(timeout=30), "training never ran while this step generated"
        self.calls.append(("generate", step, version, tuple(problems)))
        self.generating = False
        return _rollouts(step, version), {"timing/generation": 0.0}

    def refit(self, on_sent=None) -> dict[str, float]:
        assert not self.generating, "refit while the engine generates"
        if self.fail_refit:
            raise ConnectionError("broadcast failed")
        self.calls.append(("refit",))
        if on_sent is not None:
            on_sent()  # the policy's weights are sent; the engine loads them from here on
        if self.load_gate is not None:
            assert self.load_gate.wait(timeout=30), "training never ran while the engine loaded the weights"
        return {"train/refit_bytes": 1.0}


def test_each_step_trains_on_samples_of_the_weights_one_update_older():
    engine = Engine()
    ahead = RolloutsAhead(engine.produce, engine.refit, engine_version=0)
    versions = []
    for step in range(1, 5):
        rollouts, _ = ahead.take(step, lambda: [f"p{step}"])
        if step < 4:
            ahead.start(step + 1, [f"p{step + 1}"], policy_version=step - 1)
        versions.append(rollouts.policy_version)  # ... the policy trains step `step` here (weights -> step)
    ahead.close()
    assert versions == [0, 0, 1, 2]  # staleness (step - 1 - version): 0, 1, 1, 1
    assert engine.calls == [("generate", 1, 0, ("p1",)), ("generate", 2, 0, ("p2",)), ("refit",),
                            ("generate", 3, 1, ("p3",)), ("refit",), ("generate", 4, 2, ("p4",))]


def test_generation_runs_while_the_step_trains():
    gate = threading.Event()
    engine = Engine(gate)
    ahead = RolloutsAhead(engine.produce, engine.refit, engine_version=0)
    ahead.load_state_dict({"step": 1, "rollouts": _rollouts(1, 0).state_dict(), "metrics": {}})
    ahead.take(1, lambda: pytest.fail("step 1 is in flight"))
    ahead.start(2, ["p2"], policy_version=0)
    gate.set()  # "training": step 2's generation can only finish because this ran beside it
    rollouts, metrics = ahead.take(2, lambda: [])
    ahead.close()
    assert rollouts.policy_version == 0 and "timing/wait_rollouts" in metrics


def test_validation_waits_for_the_generation_in_flight_then_refits():
    engine = Engine()
    ahead = RolloutsAhead(engine.produce, engine.refit, engine_version=0)
    ahead.take(1, lambda: ["p1"])
    ahead.start(2, ["p2"], policy_version=0)
    assert ahead.update_engine(1) == {"train/refit_bytes": 1.0} and ahead.engine_version == 1
    assert ahead.update_engine(1) == {}  # already current: no second refit
    rollouts, _ = ahead.take(2, lambda: [])
    assert rollouts.policy_version == 0  # generated before the refit: kept as they were
    ahead.start(3, ["p3"], policy_version=1)  # the engine holds step 1's weights already
    _, metrics = ahead.take(3, lambda: [])
    assert "train/refit_bytes" not in metrics and engine.calls.count(("refit",)) == 1
    ahead.start(3, ["p3"], policy_version=1)  # in flight again, for the check below
    ahead.close()
    with pytest.raises(RuntimeError, match="step 3 are in flight, but step 4"):
        ahead.take(4, lambda: [])


def test_training_starts_once_the_weights_are_sent_and_overlaps_their_loading():
    """`start` returns when the refit reports the policy's weights sent; the engine's load of them (and then the
    generation) runs beside training; the refit's metrics come with the rollouts it made."""
    load_gate = threading.Event()
    engine = Engine(load_gate=load_gate)
    ahead = RolloutsAhead(engine.produce, engine.refit, engine_version=0)
    ahead.start(2, ["p2"], policy_version=1)  # would never return if it waited for the whole refit
    load_gate.set()  # "training"
    rollouts, metrics = ahead.take(2, lambda: [])
    ahead.close()
    assert rollouts.policy_version == 1 and metrics["train/refit_bytes"] == 1.0
    assert engine.calls == [("refit",), ("generate", 2, 1, ("p2",))]


def test_a_refit_that_fails_before_the_weights_are_sent_is_raised_by_start():
    ahead = RolloutsAhead(Engine().produce, Engine(fail_refit=True).refit, engine_version=0)
    with pytest.raises(ConnectionError, match="broadcast failed"):
        ahead.start(2, ["p2"], policy_version=1)
    ahead.close()


def test_in_flight_rollouts_survive_a_checkpoint_bit_for_bit():
    engine = Engine()
    ahead = RolloutsAhead(engine.produce, engine.refit, engine_version=0)
    ahead.take(1, lambda: ["p1"])
    ahead.start(2, ["p2"], policy_version=0)
    buffer = io.BytesIO()
    torch.save({"in_flight": ahead.state_dict()}, buffer)
    ahead.close()
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)["in_flight"]  # what resuming a checkpoint reads

    resumed = RolloutsAhead(engine.produce, engine.refit, engine_version=1)
    resumed.load_state_dict(state)
    got, _ = resumed.take(2, lambda: pytest.fail("step 2 came from the checkpoint"))
    want = _rollouts(2, 0)
    for name in ("input_ids", "loss_mask", "generation_logprobs", "rewards", "response_lengths", "truncated",
                 "lengths"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert (got.responses, got.extracted_answers, got.finish_reasons, got.policy_version) == (
        want.responses, want.extracted_answers, want.finish_reasons, 0)
    assert RolloutsAhead(engine.produce, engine.refit, engine_version=0).state_dict() is None  # nothing in flight
