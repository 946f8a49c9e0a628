"""Multi-turn GRPO learns a game end to end (`recipes/guess-number-tiny-cpu.yaml`, about 5 minutes on 2 cores):
the number-guessing resource server over real HTTP on loopback, real vLLM turns, the Megatron policy.

The SFT stage imitates a naive player whose guesses ignore the server's answers, so the policy GRPO starts from
ignores them too; GRPO alone has to learn to use "higher" / "lower". Checked: the training reward rises by a clear
margin, more held-out games are won, and the trainer's logprobs of the multi-turn samples stay equal to the engine's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from mrl.app.stages import run_staged
from mrl.environments.servers import GuessNumber
from mrl.testing.figures import assert_expected_figures

pytestmark = [pytest.mark.learning, pytest.mark.timeout(1800)]

RECIPE = Path(__file__).parents[2] / "recipes" / "guess-number-tiny-cpu.yaml"
BOUNDS = dict(max_turns=3, low=0, high=4)  # the recipe's game: rows as its header writes them


def _write(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.fixture(scope="module")
def run_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("guess-number")
    warmup = _write(root / "warmup.jsonl", GuessNumber.warmup_rows(4000, seed=0, **BOUNDS))
    train = _write(root / "train.jsonl", GuessNumber.rows(2000, seed=0, **BOUNDS))
    val = _write(root / "val.jsonl", GuessNumber.rows(64, seed=1, **BOUNDS))
    recipe = yaml.safe_load(RECIPE.read_text())
    recipe["data"].update(train=train, val=val)
    recipe["stages"][0]["overrides"] = [f"data.train={warmup}"]
    (root / "recipe.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    run_staged(root / "recipe.yaml", [f"run.output_dir={root / 'run'}"])
    return root


@pytest.fixture(scope="module")
def summary(run_root):
    return json.loads((run_root / "run" / "summary.json").read_text())["grpo"]


def test_the_run_holds_the_figures_its_recipe_expects(run_root, summary, figure):
    """The recipe's expect: block, as `mrl check` checks it: the reward and the held-out games rise, and the
    trainer's logprobs of the multi-turn samples equal the engine's (no retokenisation drift)."""
    first, last = summary["reward_first10"], summary["reward_last10"]
    before, after = summary["val_accuracy_before"], summary["val_accuracy_after"]
    figure(f"guess-number GRPO reward, first 10 steps {first:.3f} -> last 10 {last:.3f}; held-out games found "
           f"{before:.3f} -> {after:.3f}")

    assert_expected_figures(run_root / "run", run_root / "recipe.yaml")
