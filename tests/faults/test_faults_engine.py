"""The vLLM engine killed (SIGKILL) in the middle of a generation and in the middle of a refit, in one GRPO run of the
command line: both times the run replaces the engine, refits it with the policy's current weights, does the
interrupted work again, and ends with the metrics of an uninterrupted run of the same seed (requests are seeded on
CPU), `train/engine_restarts` counting the replacements. The kills come from the named fault points of
mrl/distributed/faults.py (`MRL_INJECT_FAULT`): a real SIGKILL of the engine's process, at a chosen place.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from mrl.testing.runs import metrics, mrl, training_metrics, warm_grpo_args

# The SFT warm-up (`warm`, tests/faults/conftest.py), then a faulted GRPO run beside the uninterrupted one
# (`sync_reference`, the first time): minutes on an AVX2-only EPYC.
pytestmark = pytest.mark.timeout(1500)


def _grpo(warm: Path, out: Path, env: dict[str, str]):
    return mrl(*warm_grpo_args(warm, out), env=env)


def _lines_with_times(proc) -> list[tuple[float, str]]:
    """The command's output lines with the wall time each arrived (read on a thread while it runs)."""
    lines: list[tuple[float, str]] = []

    def read() -> None:
        for line in proc.stdout:
            lines.append((time.time(), line))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    proc.wait(timeout=900)
    reader.join(timeout=30)
    return lines


def test_an_engine_killed_mid_generation_and_mid_refit_is_replaced_and_the_run_is_unchanged(warm, sync_reference,
                                                                                              tmp_path):
    generation_kill, refit_kill = tmp_path / "killed-generating", tmp_path / "killed-refitting"
    # Counted in each engine process: the 1st engine validates at step 0 (generation 1), generates step 1 (2), loads
    # step 1's refit (bucket 1) and dies generating step 2 (generation 3). Its replacement loads the replacement's
    # refit (bucket 1), generates step 2, loads step 2's refit (2), generates step 3 and dies in step 3's refit (3).
    faults = f"engine.generate@3:{generation_kill},engine.refit_bucket@3:{refit_kill}"
    faulted_run = _grpo(warm, tmp_path / "faulted", env={"MRL_INJECT_FAULT": faults})
    lines = _lines_with_times(faulted_run)  # read as they come: the times of the deaths' reports
    reference = sync_reference.metrics()
    out = "".join(line for _, line in lines)
    assert faulted_run.returncode == 0, out[-4000:]

    faulted = metrics(tmp_path / "faulted" / "logs")
    assert reference[1]["train/refit_buckets"] == 1.0  # the counts above assume one bucket per refit
    kills = [json.loads(path.read_text()) for path in (generation_kill, refit_kill)]
    assert [k["point"] for k in kills] == ["engine.generate", "engine.refit_bucket"]
    assert kills[0]["pid"] != kills[1]["pid"]  # the second death is the replacement's
    died = [(t, line) for t, line in lines if "[mrl] engine rank 0 died" in line]
    assert [("'generate_shard'" in line, "'load_payload'" in line) for _, line in died] == [(1, 0), (0, 1)], out
    detected = [seen - kill["time"] for kill, (seen, _) in zip(kills, died)]
    print(f"deaths reported {detected[0]:.1f} s and {detected[1]:.1f} s after the kills; steps 2 and 3 took "
          f"{faulted[2]['timing/step']:.1f} s and {faulted[3]['timing/step']:.1f} s (uninterrupted: "
          f"{reference[2]['timing/step']:.1f} s, {reference[3]['timing/step']:.1f} s)")
    assert max(detected) < 30  # Ray reports the actor's death in about a second

    assert [faulted[step]["train/engine_restarts"] for step in (1, 2, 3, 4)] == [0.0, 1.0, 2.0, 2.0]
    assert [reference[step]["train/engine_restarts"] for step in (1, 2, 3, 4)] == [0.0] * 4
    for step in (1, 2, 3, 4):
        same = training_metrics(reference[step])
        assert {k: faulted[step][k] for k in same} == same, step
    assert faulted[4]["val/accuracy"] == reference[4]["val/accuracy"]


def test_an_engine_killed_in_its_sleep_and_in_its_wake_up_is_replaced_and_the_run_is_unchanged(warm, sync_reference,
                                                                                               tmp_path):
    """The colocated engine's memory hand-over, the calls around every generation (on CPU the sleep-mode contract,
    mrl/cpu/vllm_sleep_mode.py): a death there was not covered before (exit 4: "died while running
    'prepare_for_generation' ... The group cannot continue")."""
    sleep_kill, wake_kill = tmp_path / "killed-sleeping", tmp_path / "killed-waking"
    # Counted in each engine process: the 1st engine sleeps once started (sleep 1), wakes to validate at step 0
    # (wake 1), sleeps (2), wakes for step 1 (2), generates and dies going to sleep before step 1 trains (sleep 3).
    # Its replacement (refitted, awake) sleeps (1), is refitted after step 1, wakes for step 2 (1), step 3 (2), and
    # dies waking for step 4 (3).
    faults = f"engine.sleep@3:{sleep_kill},engine.wake@3:{wake_kill}"
    faulted_run = _grpo(warm, tmp_path / "faulted", env={"MRL_INJECT_FAULT": faults})
    lines = _lines_with_times(faulted_run)  # read as they come: the times of the deaths' reports
    reference = sync_reference.metrics()
    out = "".join(line for _, line in lines)
    assert faulted_run.returncode == 0, out[-4000:]
    assert "Traceback" not in out, out[-4000:]

    faulted = metrics(tmp_path / "faulted" / "logs")
    kills = [json.loads(path.read_text()) for path in (sleep_kill, wake_kill)]
    assert [k["point"] for k in kills] == ["engine.sleep", "engine.wake"]
    assert kills[0]["pid"] != kills[1]["pid"]  # the second death is the replacement's
    died = [line for _, line in lines if "[mrl] engine rank 0 died" in line]
    assert [("'finish_generation'" in line, "'prepare_for_generation'" in line) for line in died] == \
        [(1, 0), (0, 1)], out
    assert [faulted[step]["train/engine_restarts"] for step in (1, 2, 3, 4)] == [1.0, 1.0, 1.0, 2.0]
    for step in (1, 2, 3, 4):
        same = training_metrics(reference[step])
        assert {k: faulted[step][k] for k in same} == same, step
    assert faulted[4]["val/accuracy"] == reference[4]["val/accuracy"]
