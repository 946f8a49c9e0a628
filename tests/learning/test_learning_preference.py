"""Preference learning end to end (`recipes/preference-arith-tiny-cpu.yaml`, about 8 minutes on 2 cores, so its own
suite: `make test-learning`): SFT on labels that are all near misses leaves a policy that prefers a near miss to the
right sum on held-out operands; then
- DPO on (right sum > near miss) pairs raises the held-out preference accuracy by at least 0.3;
- a reward model trained on the same pairs reaches at least 0.9 pair accuracy on held-out pairs, and transformers
  loads its export;
- GRPO with that reward model as the only reward raises the reward model's score of the policy's samples.
The bounds are the recipe's `expect:` block, checked as `mrl check` checks them (mrl/app/check.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mrl.app.stages import run_staged
from mrl.testing.figures import assert_expected_figures

pytestmark = [pytest.mark.learning, pytest.mark.timeout(1800)]  # the staged recipe takes ~7 min

RECIPE = Path(__file__).parents[2] / "recipes" / "preference-arith-tiny-cpu.yaml"


@pytest.fixture(scope="module")
def summaries(tmp_path_factory):
    out = tmp_path_factory.mktemp("preference")
    run_staged(RECIPE, [f"run.output_dir={out}"])
    return out, json.loads((out / "summary.json").read_text())


def test_reward_model_separates_held_out_pairs_and_exports_for_transformers(summaries, figure):
    import torch
    from transformers import AutoModelForSequenceClassification

    out, s = summaries
    figure(f"reward model held-out pair accuracy {s['rm']['val/accuracy_before']:.3f} -> {s['rm']['val/accuracy_after']:.3f}")
    model = AutoModelForSequenceClassification.from_pretrained(out / "rm" / "final_hf", dtype=torch.float32)
    assert model.score.weight.shape[0] == 1


def test_the_run_holds_the_figures_its_recipe_expects(summaries, figure):
    """DPO's held-out preference accuracy and GRPO's reward-model score rise, the reward model separates held-out
    pairs: the recipe's expect: block."""
    dpo, curve = summaries[1]["dpo"], summaries[1]["grpo"]["reward_curve"]
    before, after = dpo["val/preference_accuracy_before"], dpo["val/preference_accuracy_after"]
    figure(f"DPO held-out preference accuracy {before:.3f} -> {after:.3f}")
    figure(f"GRPO reward-model score, first 5 steps {sum(curve[:5]) / 5:.3f} -> last 5 {sum(curve[-5:]) / 5:.3f}")

    assert_expected_figures(summaries[0], RECIPE)
