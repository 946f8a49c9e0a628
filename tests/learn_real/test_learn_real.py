"""RL that visibly works on a real pretrained model, SmolLM2-135M-Instruct, on held-out questions (`make learn-real`):

- GRPO (recipes/grpo-smollm2-135m-times-cpu.yaml, staged: eval, GRPO, eval) raises greedy accuracy on 80 held-out
  times-table questions by at least 15 points, in at most 40 minutes of wall time on 2 cores, with the engine and
  the trainer agreeing on every step (train/token_mult_prob_error <= 1.01); two seeds.
- DPO on pairs of the model's own answers, a right one over its likeliest wrong ones
  (recipes/dpo-smollm2-135m-times-cpu.yaml), raises the held-out preference accuracy by at least 0.15, and the
  model it exports answers more held-out questions right (greedy) than the model it started from; two seeds.
The held-out questions' operand pairs are never trained on (mrl.app.real_assets.times_tables)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from mrl.app.commands import RUNNERS
from mrl.app import self_pairs
from mrl.app.stages import run_staged
from mrl.config import load_config
from mrl.testing.runs import metrics

pytestmark = [pytest.mark.learn_real, pytest.mark.timeout(3600)]

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
GRPO = RECIPES / "grpo-smollm2-135m-times-cpu.yaml"
DPO = RECIPES / "dpo-smollm2-135m-times-cpu.yaml"
MAX_MINUTES, MIN_LIFT, MAX_MULT_PROB_ERROR, MIN_PREFERENCE_LIFT = 40.0, 0.15, 1.01, 0.15


@pytest.mark.parametrize("seed", [1, 2])
def test_grpo_lifts_held_out_accuracy(real_assets, tmp_path, figure, seed):
    start = time.perf_counter()
    run_staged(GRPO, [f"run.output_dir={tmp_path}", f"run.seed={seed}"])
    minutes = (time.perf_counter() - start) / 60
    s = json.loads((tmp_path / "summary.json").read_text())
    before, after = s["eval-before"]["final"]["val/accuracy"], s["eval-after"]["final"]["val/accuracy"]
    steps = [json.loads(line) for line in open(tmp_path / "grpo" / "logs" / "metrics.jsonl", encoding="utf-8")]
    trained = [m for m in steps if m.get("train/kept_samples", 0) > 0]  # a step of uniform groups trains nothing
    errors = [m["train/token_mult_prob_error"] for m in trained]
    grpo = s["grpo"]
    figure(f"GRPO seed {seed}: held-out accuracy {before:.3f} -> {after:.3f} ({after - before:+.3f}) in {minutes:.1f} "
           f"min; reward first 10 steps {grpo['reward_first10']:.3f}, last 10 {grpo['reward_last10']:.3f}; "
           f"token_mult_prob_error max {max(errors):.4f} over the {len(errors)} of {len(steps)} steps that trained")
    assert (tmp_path / "reward_curve.png").is_file()
    assert len(steps) == load_config(GRPO).grpo.max_num_steps and max(errors) <= MAX_MULT_PROB_ERROR
    # Right means the product itself: every held-out answer counted right reads exactly as the gold number.
    samples = [json.loads(line) for line in open(tmp_path / "eval-after" / "samples.jsonl", encoding="utf-8")]
    assert after == pytest.approx(sum(_reads_as(x["extracted_answer"], x["gold_answer"]) for x in samples) / len(samples))
    assert after - before >= MIN_LIFT
    assert minutes <= MAX_MINUTES


def _reads_as(extracted: str | None, gold: str) -> bool:
    try:
        return float((extracted or "").replace(",", "")) == float(gold)
    except ValueError:
        return False


def _pairs(samples: Path, out: Path, instruction: str) -> int:
    assert self_pairs.main(["--samples", str(samples), "--out", str(out), "--instruction", instruction,
                            "--rejected", "likeliest"]) == 0
    return sum(1 for _ in open(out, encoding="utf-8"))


@pytest.mark.parametrize("seed", [1, 2])
def test_dpo_on_its_own_answers_lifts_held_out_preference_accuracy(real_assets, tmp_path, figure, seed):
    base = [f"run.output_dir={tmp_path}", f"run.seed={seed}"]
    instruction = load_config(DPO).data.instruction
    counts = {}
    for split, data in (("train", None), ("heldout", real_assets / "data" / "times_heldout.jsonl")):
        out = tmp_path / f"sample-{split}"
        sampling = [f"run.output_dir={out}", f"run.seed={seed}", "data.train=null", "data.val=null"]  # no pairs yet
        RUNNERS["eval"](load_config(DPO, sampling + ([f"eval.data={data}"] if data else [])))
        counts[split] = _pairs(out / "samples.jsonl", tmp_path / f"pairs-{split}.jsonl", instruction)
    summary = RUNNERS["dpo"](load_config(DPO, base))
    before = summary["val/preference_accuracy_before"]
    after = summary["val/preference_accuracy_after"]
    val = [m for m in metrics(tmp_path / "logs").values() if "val/chosen_logprob" in m]
    greedy = {name: _greedy_held_out_accuracy(model, tmp_path / f"greedy-{name}", real_assets)
              for name, model in (("before", load_config(DPO).policy.model_name), ("after", tmp_path / "final_hf"))}
    figure(f"DPO seed {seed} on its own answers ({counts['train']} training pairs, {counts['heldout']} held-out): "
           f"held-out preference accuracy {before:.3f} -> {after:.3f} ({after - before:+.3f}) in "
           f"{summary['seconds'] / 60:.1f} min; "
           f"mean logprob per token of the held-out right answers {val[0]['val/chosen_logprob']:.2f} -> "
           f"{val[-1]['val/chosen_logprob']:.2f}, of the wrong ones {val[0]['val/rejected_logprob']:.2f} -> "
           f"{val[-1]['val/rejected_logprob']:.2f}; greedy held-out accuracy {greedy['before']:.3f} -> "
           f"{greedy['after']:.3f}")
    assert after - before >= MIN_PREFERENCE_LIFT
    assert greedy["after"] > greedy["before"]


def _greedy_held_out_accuracy(model, out: Path, real_assets: Path) -> float:
    """The share of the 80 held-out questions `model` answers right, greedy (the GRPO recipe's eval-before)."""
    overrides = [f"run.output_dir={out}", f"policy.model_name={model}", "data.train=null", "data.val=null",
                 f"eval.data={real_assets / 'data' / 'times_heldout.jsonl'}", "eval.num_samples=1",
                 "eval.temperature=0", "eval.pass_k=[1]"]
    return RUNNERS["eval"](load_config(DPO, overrides))["final"]["val/accuracy"]
