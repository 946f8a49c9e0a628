"""Multi-turn GRPO against a resource server over real HTTP on loopback (recipes/guess-number-tiny-cpu.yaml,
shortened): real vLLM turns, the GuessNumber server's tools and verifier, the Megatron policy.

- Every episode is several turns, tools are called, and the trainer's logprobs of the engine's multi-turn samples
  equal the engine's (token_mult_prob_error <= 1.001): the model's tokens are never re-tokenised.
- A server that is down costs every episode its reward and is counted; the run finishes all the same.
Whole runs (about a minute each): in `make test-runs`, out of `make test`; the agent loop itself is tested on fakes in
tests/unit/algorithms.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mrl.environments.servers import GuessNumber
from mrl.parallel.ports import free_port
from mrl.testing.runs import finish, metrics, mrl

RECIPE = str(Path(__file__).resolve().parents[2] / "recipes" / "guess-number-tiny-cpu.yaml")
SHORT = ("grpo.max_num_steps=2", "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4",
         "policy.train_global_batch_size=16", "policy.train_micro_batch_size=16", "grpo.val_every=0",
         "eval.max_problems=4", "env.server.max_turns=3", "logger.log_every=1")


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("rows")
    for name, seed in (("train", 0), ("val", 1)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in GuessNumber.rows(32, seed, 3)))
    return str(root / "train.jsonl"), str(root / "val.jsonl")


def test_multi_turn_grpo_has_no_retokenisation_drift(rows, tmp_path):
    out = tmp_path / "game"
    finish(mrl("grpo", "--config", RECIPE, *SHORT, f"data.train={rows[0]}", f"data.val={rows[1]}",
               f"run.output_dir={out}"), timeout=900)
    steps = metrics(out / "logs")
    for step in (1, 2):
        m = steps[step]
        assert m["train/env_turns"] > 1.5 and m["train/env_tool_calls"] > 1  # episodes really are multi-turn
        assert m["train/env_server_errors"] == 0
        assert 1.0 <= m["train/token_mult_prob_error"] <= 1.001  # step 2 samples after step 1's refit
    assert "val/reward" in steps[2] and steps[2]["val/server_errors"] == 0


def test_a_down_server_scores_zero_and_is_counted(rows, tmp_path):
    out = tmp_path / "down"
    down = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    finish(mrl("grpo", "--config", RECIPE, *SHORT, "grpo.max_num_steps=1", f"data.train={rows[0]}",
               f"data.val={rows[1]}", "~env.server.example", f"++env.server.url={down}", "env.server.timeout_s=2",
               f"run.output_dir={out}"), timeout=900)
    step = metrics(out / "logs")[1]
    assert step["train/env_server_errors"] == 16 and step["train/reward"] == 0.0
