"""An environment server that stops answering (SIGSTOP: its port still accepts connections, nothing replies) during
multi-turn GRPO, then comes back (SIGCONT): every call of the stopped step times out after `env.server.timeout_s`,
its episodes score 0 and are counted as server errors (`train/env_server_errors`), the run goes on, and once the
server answers again the episodes are whole again. Nothing hangs: the step with the server stopped costs a few
timeouts, not a watchdog's deadline."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mrl.environments.servers import GuessNumber
from mrl.parallel.ports import free_port
from mrl.testing.runs import MACHINERY, finish, metrics, mrl

pytestmark = pytest.mark.timeout(1200)

RECIPE = str(Path(__file__).resolve().parents[2] / "recipes" / "guess-number-tiny-cpu.yaml")
EPISODES = 4 * 4  # grpo.num_prompts_per_step x grpo.num_generations_per_prompt
RUN = ("grpo.max_num_steps=4", "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4",
       "policy.train_global_batch_size=16", "policy.train_micro_batch_size=16", "grpo.val_every=0",
       "eval.max_problems=4", "env.server.max_turns=3", "logger.log_every=1", "env.server.timeout_s=2", *MACHINERY)


def _logged_steps(log: Path) -> set[int]:
    if not log.exists():
        return set()
    return {json.loads(line)["step"] for line in log.read_text().splitlines() if line.endswith("}")}


def _wait_for_step(proc, log: Path, step: int, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while step not in _logged_steps(log) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert step in _logged_steps(log), proc.communicate()[0][-3000:]


def test_a_server_that_stops_answering_costs_its_episodes_and_the_run_goes_on(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in GuessNumber.rows(32, 0, 3)))
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "mrl.cli", "env", "serve", "guess_number", "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    out = tmp_path / "run"
    try:
        run = mrl("grpo", "--config", RECIPE, *RUN, f"data.train={rows}", f"data.val={rows}",
                  "~env.server.example", f"++env.server.url=http://127.0.0.1:{port}", f"run.output_dir={out}")
        log = out / "logs" / "metrics.jsonl"
        _wait_for_step(run, log, 1)
        os.kill(server.pid, signal.SIGSTOP)  # step 2 plays against a server that never replies
        stopped = time.monotonic()
        _wait_for_step(run, log, 2)
        stopped_for = time.monotonic() - stopped
        os.kill(server.pid, signal.SIGCONT)
        finish(run, timeout=900)
    finally:
        os.kill(server.pid, signal.SIGCONT)
        server.kill()
        server.wait()
    steps = metrics(out / "logs")
    assert steps[1]["train/env_server_errors"] == 0
    assert steps[2]["train/env_server_errors"] == EPISODES and steps[2]["train/reward"] == 0.0
    assert steps[4]["train/env_server_errors"] == 0 and steps[4]["train/env_turns"] > 1.5
    # each episode's calls give up after env.server.timeout_s (2 s); the episodes wait side by side
    print(f"step 2 with the server stopped: {steps[2]['timing/step']:.1f} s (step 3: {steps[3]['timing/step']:.1f} s)")
    assert stopped_for < 60, stopped_for
