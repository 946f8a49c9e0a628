"""PPO and on-policy distillation learn end to end beside GRPO (`recipes/ppo-distill-arith-tiny-cpu.yaml`, about 4
minutes on 2 cores): from one SFT warm-up, GRPO (the baseline), PPO with a critic trained beside the policy on the
same samples, and the SFT model distilled on-policy from GRPO's result with no reward at all.

Checked: the recipe's expect: block (each raises held-out accuracy by a clear margin; PPO ends near GRPO; the
distilled student closes most of its gap to the teacher), the critic's warm-up (the policy's weights stay while only
the critic trains), and distillation's reverse KL to the teacher falling."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mrl.app.stages import run_staged
from mrl.testing.figures import assert_expected_figures
from mrl.testing.runs import metrics

pytestmark = [pytest.mark.learning, pytest.mark.timeout(1800)]

RECIPE = Path(__file__).parents[2] / "recipes" / "ppo-distill-arith-tiny-cpu.yaml"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ppo-distill")
    run_staged(RECIPE, [f"run.output_dir={out}"])
    return out


def test_the_run_holds_the_figures_its_recipe_expects(run_dir, figure):
    summary = json.loads((run_dir / "summary.json").read_text())
    for stage in ("grpo", "ppo", "distill"):
        s = summary[stage]
        figure(f"{stage}: held-out {s['val_accuracy_before']:.3f} -> {s['val_accuracy_after']:.3f}, reward first 10 "
               f"steps {s['reward_first10']:.3f} -> last 10 {s['reward_last10']:.3f}, {s['seconds']:.0f} s")
    assert_expected_figures(run_dir, RECIPE)


def test_ppo_warms_its_critic_up_then_trains_both_and_distillation_nears_its_teacher(run_dir, figure):
    ppo, distill = metrics(run_dir / "ppo" / "logs"), metrics(run_dir / "distill" / "logs")
    steps = [step for step in ppo if step > 0]
    warm = [step for step in steps if ppo[step].get("train/critic_warmup")]
    assert warm == list(range(1, 11))  # ppo.critic_warmup_steps
    assert all("train/pg_loss" not in ppo[step] for step in warm)  # the policy did not train
    assert all("train/pg_loss" in ppo[step] and "train/critic/value_loss" in ppo[step] for step in steps[10:])
    kl = [distill[step]["train/distill/reverse_kl"] for step in sorted(distill) if step > 0]
    figure(f"distillation reverse KL to the teacher, first 10 steps {sum(kl[:10]) / 10:.3f} -> last 10 "
           f"{sum(kl[-10:]) / 10:.3f}")
    assert sum(kl[-10:]) < 0.7 * sum(kl[:10])
