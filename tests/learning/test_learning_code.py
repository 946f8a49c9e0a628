"""Code RL learns end to end (`recipes/code-sum-tiny-cpu.yaml`, a few minutes on 2 cores): every program the policy
writes runs with its test in the code environment's sandbox (real bubblewrap), and the reward is whether it passed.

The SFT stage imitates programs right half the time and otherwise near misses (another operator or operand, a program
that does not parse); GRPO, rewarded by running them, has to find the right one. Checked: the recipe's expect: block
(the training reward and the held-out programs that pass rise by clear margins; the trainer's logprobs equal the
engine's), and the reasons the step's programs failed, counted in the metrics, fall."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from mrl.app.stages import run_staged
from mrl.data.code import sum_program_rows
from mrl.environments.code.sandbox import SandboxUnavailable, check_available
from mrl.testing.figures import assert_expected_figures

pytestmark = [pytest.mark.learning, pytest.mark.timeout(1800)]

RECIPE = Path(__file__).parents[2] / "recipes" / "code-sum-tiny-cpu.yaml"



def _write(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.fixture(scope="module")
def run_root(tmp_path_factory):
    try:
        check_available("bwrap")
    except SandboxUnavailable as exc:
        pytest.skip(f"no sandbox here ({exc})")
    root = tmp_path_factory.mktemp("code-sum")
    warmup = _write(root / "warmup.jsonl", sum_program_rows(4000, seed=0, warmup=True))  # the recipe's header's rows
    train = _write(root / "train.jsonl", sum_program_rows(2000, seed=1))
    val = _write(root / "val.jsonl", sum_program_rows(64, seed=2))
    recipe = yaml.safe_load(RECIPE.read_text())
    recipe["defaults"] = str(RECIPE.parent / recipe["defaults"])  # the recipe is written elsewhere
    recipe["data"].update(train=train, val=val)
    recipe["stages"][0]["overrides"] = [
        f"data.train={warmup}" if item.startswith("data.train=") else item for item in recipe["stages"][0]["overrides"]
    ]
    (root / "recipe.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    run_staged(root / "recipe.yaml", [f"run.output_dir={root / 'run'}"])
    return root


def test_the_run_holds_the_figures_its_recipe_expects(run_root, figure):
    summary = json.loads((run_root / "run" / "summary.json").read_text())["grpo"]
    first, last = summary["reward_first10"], summary["reward_last10"]
    before, after = summary["val_accuracy_before"], summary["val_accuracy_after"]
    figure(f"code-sum GRPO reward, first 10 steps {first:.3f} -> last 10 {last:.3f}; held-out programs passing "
           f"{before:.3f} -> {after:.3f}")
    assert_expected_figures(run_root / "run", run_root / "recipe.yaml")


def test_the_failures_the_sandbox_counted_fall(run_root):
    rows = [json.loads(line) for line in (run_root / "run" / "grpo" / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "train/reward" in row]
    failed = lambda row: row.get("train/code/failed_assertion", 0) + row.get("train/code/syntax_error", 0)  # noqa: E731
    assert sum(map(failed, steps[:3])) > 2 * sum(map(failed, steps[-3:]))
    counted = lambda row: sum(v for k, v in row.items() if k.startswith("train/code/"))  # noqa: E731
    assert all(counted(row) == 128 for row in steps)  # every sample of a step (16 prompts x 8) counted once
