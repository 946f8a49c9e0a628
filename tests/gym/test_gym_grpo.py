"""GRPO through real NeMo Gym servers (`mrl grpo`): the run starts workplace_assistant (multi-turn, tools) and
math_with_judge (single turn) from NeMo Gym's own Python, plays a tiny fresh model's episodes against them beside
mrl's arithmetic check, logs every figure per environment (the servers' own /aggregate_metrics among them), and stops
the servers at its end. Mid-run the workplace server is killed: its episodes from then on score 0 and are counted as
that environment's reward errors, the other environments are untouched, and the run finishes."""

from __future__ import annotations

import json
import time
from pathlib import Path

import psutil
import pytest
import yaml

from mrl.testing.gym import require_gym
from mrl.testing.runs import finish, metrics, mrl

require_gym()
pytestmark = pytest.mark.timeout(900)

STEPS = 4
CONFIG = {
    "run": {"name": "gym-grpo", "seed": 1},
    "cluster": {"num_nodes": 1, "devices_per_node": 1},
    "policy": {
        "build": {"family": "qwen2", "num_layers": 2, "hidden_size": 128, "num_attention_heads": 4,
                  "num_key_value_heads": 4, "intermediate_size": 256, "tie_word_embeddings": True, "tokenizer": "bpe"},
        "precision": "float32",
        "max_total_sequence_length": 448,
        "train_global_batch_size": 24, "train_micro_batch_size": 24, "logprob_micro_batch_size": 24,
        "optimizer": {"name": "adamw", "lr": 1.0e-3},
    },
    "generation": {"backend": "vllm", "temperature": 1.0, "max_new_tokens": 8,
                   "vllm": {"kv_cache_gib": 0.25, "max_model_len": 448}},
    "loss": {"kl_beta": 0.0},
    "grpo": {"num_prompts_per_step": 6, "num_generations_per_prompt": 4, "max_num_steps": STEPS, "val_every": 0,
             "max_idle_steps": 0},
    "eval": {"max_problems": 4, "num_samples": 1},
    "envs": {
        "tools": {"kind": "nemo_gym", "nemo_gym": {"server": "workplace_assistant", "max_turns": 2,
                                                    "max_turn_tokens": 8, "max_total_tokens": 448}},
        "judge": {"kind": "nemo_gym", "nemo_gym": {"server": "math_with_judge", "max_turns": 1, "max_turn_tokens": 8}},
        "add": {"kind": "arith"},
    },
    "data": {
        "prompt_template": "plain",
        "instruction": "",
        "sources": [
            {"env": "tools", "weight": 1, "train": "nemo-gym:workplace_assistant/example.jsonl",
             "val": "nemo-gym:workplace_assistant/example.jsonl"},
            {"env": "judge", "weight": 1, "arith": {"digits": 1, "num_heldout": 4}},  # mrl's rows, NeMo Gym's verifier
            {"env": "add", "weight": 1, "arith": {"digits": 1, "num_heldout": 4}},
        ],
    },
    "checkpointing": {"enabled": False},
    "logger": {"log_every": 1},
}


def _launched(server: str) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info["cmdline"] or []
        if any(part.endswith("nemo_gym/launch.py") for part in cmdline) and server in cmdline:
            found.append(process)
    return found


def _wait_for_step(run, log: Path, step: int, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and run.poll() is None:
        if log.exists() and any(json.loads(line)["step"] == step for line in log.read_text().splitlines()):
            return
        time.sleep(0.1)
    raise AssertionError(f"step {step} never logged:\n{run.communicate()[0][-3000:]}")


def test_grpo_through_real_nemo_gym_servers_logs_each_and_survives_one_dying(tmp_path):
    out = tmp_path / "run"
    config = tmp_path / "gym.yaml"
    config.write_text(yaml.safe_dump({**CONFIG, "run": {**CONFIG["run"], "output_dir": str(out)}}))
    started = time.monotonic()
    run = mrl("grpo", "--config", str(config))
    log = out / "logs" / "metrics.jsonl"
    _wait_for_step(run, log, 2)
    (server,) = _launched("workplace_assistant")
    server.kill()  # step 4 (and most likely step 3) plays against a dead server
    output = finish(run, timeout=600)
    took = time.monotonic() - started
    steps = metrics(out / "logs")
    for step in (1, 2):
        assert steps[step]["train/env/tools/reward_error_fraction"] == 0.0
        assert steps[step]["train/env/tools/samples"] > 0 and steps[step]["train/env/judge/samples"] > 0
        assert "train/env/tools/mean/reward" in steps[step]  # NeMo Gym's own aggregate, under the environment's name
        assert "train/env/judge/mean/reward" in steps[step]
        assert steps[step]["train/env/tools/turns"] >= 1.0
    # Step 3's episodes may have begun (even ended) in the moment before the kill landed; step 4's all met it dead.
    assert steps[4]["train/env/tools/samples"] > 0 and steps[4]["train/env/tools/reward_error_fraction"] == 1.0
    assert steps[4]["train/env/tools/reward"] == 0.0
    for step in (3, 4):
        assert steps[step]["train/env/judge/reward_error_fraction"] == 0.0
        assert steps[step].get("train/env/add/reward_error_fraction", 0.0) == 0.0  # when the step drew add's rows
    assert max(steps) == STEPS
    final = steps[STEPS]
    assert final["val/env/tools/server_errors"] == final["val/env/tools/samples"] > 0  # validated against the dead one
    assert final["val/env/judge/server_errors"] == 0 and final["val/env/judge/samples"] > 0
    assert not _launched("workplace_assistant") and not _launched("math_with_judge")  # the run stopped its servers
    print(f"\nGRPO through NeMo Gym servers: {STEPS} steps in {took:.0f} s (start to exit)")
    assert "NeMo Gym server workplace_assistant (envs.tools) up at http://127.0.0.1:" in output


def test_past_a_configured_error_rate_the_run_stops_naming_the_dead_server(tmp_path):
    out = tmp_path / "run"
    config = tmp_path / "gym.yaml"
    stopping = {**CONFIG["grpo"], "max_env_error_fraction": 0.5}
    config.write_text(yaml.safe_dump({**CONFIG, "grpo": stopping, "run": {**CONFIG["run"], "output_dir": str(out)}}))
    run = mrl("grpo", "--config", str(config))
    _wait_for_step(run, out / "logs" / "metrics.jsonl", 1)
    (server,) = _launched("workplace_assistant")
    server.kill()
    output, _ = run.communicate(timeout=600)
    assert run.returncode == 4, output[-3000:]
    assert "mrl: training stopped: step " in output and "tools on 100% of its samples" in output
    assert "grpo.max_env_error_fraction=0.5" in output
    assert any(f"e.g. {call}" in output for call in ("tool call", "seed_session", "verify"))  # the server's error
    summary = json.loads((out / "summary.json").read_text())
    assert "grpo.max_env_error_fraction" in json.dumps(summary.get("stopped"))
    assert not _launched("math_with_judge")  # stopped with the run


def test_mrl_eval_plays_the_servers_episodes_beside_the_single_turn_samples(tmp_path):
    out = tmp_path / "eval"
    config = tmp_path / "gym.yaml"
    config.write_text(yaml.safe_dump({**CONFIG, "run": {**CONFIG["run"], "output_dir": str(out)}}))
    output = finish(mrl("eval", "--config", str(config)), timeout=600)
    final = json.loads((out / "summary.json").read_text())["final"]
    assert final["val/env/tools/samples"] == final["val/env/judge/samples"] == 4  # eval.max_problems each, 1 sample
    assert final["val/env/tools/server_errors"] == 0 and "val/env/tools/mean/reward" in final
    assert final["val/env/add/samples"] == 4 and "val/accuracy" in final
    assert (out / "samples.jsonl").is_file() and "val/env/judge/accuracy" in output
