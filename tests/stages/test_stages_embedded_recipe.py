"""The embedded recipe, shortened, through the real command line: `mrl run` (SFT -> GRPO -> eval on Ray, Megatron
and vLLM). (GRPO killed with SIGKILL and resumed is in the fault suite: tests/faults/test_faults_resume.py.)

Shortened to a 1-digit task so that 150 SFT steps leave a policy that is partly right (GRPO has a reward signal, so
its weights really move and an inexact resume would show in the metrics).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from mrl.testing.runs import RECIPE, SHORT_ARITH, finish, metrics, mrl

# The staged run (the module's fixture, in its first test's setup) took 405 s on an AVX2-only Zen 3 EPYC with the
# rest of the suite beside it, and the first-generation Zen runs the suite up to 1.5x slower still: the suite-wide 600 s
# (pyproject.toml) is a hang guard, and here it would stop a run that is only slow.
pytestmark = pytest.mark.timeout(1500)

TIMINGS = ("timing/generation", "timing/reward", "timing/logprobs", "timing/train", "timing/refit")


@pytest.fixture(scope="module")
def staged(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("staged")
    (out / "console.txt").write_text(finish(mrl("run", RECIPE, *SHORT_ARITH, f"run.output_dir={out}")))
    return out


def test_staged_recipe_runs_every_stage_and_hands_checkpoints_on(staged):
    from transformers import AutoModelForCausalLM

    summary = json.loads((staged / "summary.json").read_text())
    assert list(summary) == ["sft-warmup", "grpo", "eval"]
    assert summary["eval"]["final"]["val/pass@2"] >= summary["eval"]["final"]["val/pass@1"]
    grpo = metrics(staged / "grpo" / "logs")
    assert sorted(grpo) == [0, 1, 2, 3, 4] and "val/accuracy" in grpo[0] and "val/accuracy" in grpo[4]
    for step in range(1, 5):
        assert all(key in grpo[step] for key in TIMINGS)
        assert grpo[step]["train/token_mult_prob_error"] <= 1.001
        assert grpo[step]["train/refit_bytes"] > 0
    # the GRPO stage started from the SFT stage's export, and its own export loads in transformers
    saved = json.loads((staged / "grpo" / "checkpoints" / "step_4" / "COMPLETE").read_text())
    assert saved["step"] == 4
    assert (staged / "sft-warmup" / "final_hf" / ".complete").is_file()
    AutoModelForCausalLM.from_pretrained(str(staged / "grpo" / "final_hf"))
    assert (staged / "reward_curve.png").stat().st_size > 1000
    rewards = [grpo[s]["train/reward"] for s in range(1, 5)]
    assert 0 < sum(rewards) / 4 < 1  # a partly right policy: the groups carry signal
    # a healthy run: no step warned that it could learn nothing (mrl/algorithms/health.py)
    assert not re.search(r"\[mrl\] step \d+: (every |no sample|the reward )",
                         (staged / "console.txt").read_text())
    assert all(grpo[s]["train/zero_variance_groups"] < 1 and grpo[s]["train/prompts_rejected_fraction"] == 0
               for s in range(1, 5))
    health = summary["grpo"]["health"]  # the run's health, held-out figures included, in summary.json and the table
    assert health["steps_warned"] == health["steps_idle"] == 0 and health["zero_variance_groups"] < 1
    assert 0 <= health["val_truncated_fraction"] < 1 and health["val_reward_error_fraction"] == 0
    assert re.search(r"^grpo +grpo .* ok$", (staged / "console.txt").read_text(), re.MULTILINE)
    # colocated: the engine started and went to sleep before the policy built its model (measured in the workers)
    asleep, built = map(float, re.search(r"colocated start-up: engine up and asleep at \+([\d.]+) s, policy built "
                                         r"from \+([\d.]+) s", (staged / "console.txt").read_text()).groups())
    assert asleep <= built


def test_eval_writes_every_sample_and_shows_a_few(staged):
    """samples.jsonl holds each held-out problem's samples with what the reward read; the console shows examples."""
    from mrl.environments.arith import arith_reward

    rows = [json.loads(line) for line in (staged / "eval" / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 20 * 2  # data.arith.num_heldout x eval.num_samples
    assert {r["sample_index"] for r in rows} == {0, 1}
    for row in rows:
        a, b = (int(x) for x in row["prompt"].rstrip("=").split("+"))
        assert row["gold_answer"] == str(a + b)
        finished = row["finish_reason"] == "stop"
        assert row["reward"] == (arith_reward(row["response"], row["gold_answer"]) if finished else 0.0)
        assert row["reward"] == 0.0 or int(row["extracted_answer"]) == a + b
    summary = json.loads((staged / "eval" / "summary.json").read_text())
    assert summary["final"]["val/accuracy"] == pytest.approx(sum(r["reward"] for r in rows) / len(rows), abs=1e-6)
    console = (staged / "console.txt").read_text()
    assert "examples (40 samples in" in console and console.count("  prompt:   ") == 3
    grpo_val = (staged / "grpo" / "val_samples")
    assert sorted(p.name for p in grpo_val.iterdir()) == ["step_0.jsonl", "step_2.jsonl", "step_4.jsonl"]


def test_any_training_step_exports_to_hf(staged, tmp_path):
    """`mrl convert megatron-to-hf --checkpoint step_N` gives the weights the run exported at that step."""
    import torch

    from converters.hf_io import load_hf_state

    step = staged / "grpo" / "checkpoints" / "step_4"
    finish(mrl("convert", "megatron-to-hf", "--checkpoint", str(step), "--out", str(tmp_path / "hf")))
    exported, final = load_hf_state(tmp_path / "hf"), load_hf_state(staged / "grpo" / "final_hf")
    assert exported.keys() == final.keys() and all(torch.equal(exported[k], final[k]) for k in final)
    incomplete = tmp_path / "step_9"
    incomplete.mkdir()
    proc = mrl("convert", "megatron-to-hf", "--checkpoint", str(incomplete), "--out", str(tmp_path / "x"))
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "not a complete training checkpoint" in out
