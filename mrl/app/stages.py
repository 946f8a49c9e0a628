"""`mrl run RECIPE`: the stages of a recipe in order, each starting from the previous stage's final export.

For stage s (see `StageConfig`): the config is the stage's own recipe file (`config:`, relative to the staged
recipe) or the staged recipe itself, then the stage's `overrides`, then the command line's, then
    run.output_dir=<root output dir>/<stage name>
    policy.model_name=<previous stage's final export>, policy.build removed   (when init_from_previous)
    policy.model_name=<stage `init_from`'s final export>                      (when init_from names a stage)
    env.reward_model.model=<stage `reward_model_from`'s final export>         (when reward_model_from names one)
A final export is the stage's `final_hf/`, or its `final_megatron/` when that stage's run.final_format is megatron
(`run.final_format: megatron` in a staged recipe hands every stage on as a Megatron checkpoint: no HF export and no
conversion between stages). A stage whose final export is complete (training) or whose `summary.json` exists (eval)
is done and skipped, so re-running the same command after a crash continues where it stopped (inside a stage, from
its newest checkpoint).

At the end: a table (per stage: time, reward before/after, held-out accuracy before/after), `summary.json`, and
`reward_curve.png` (GRPO training reward per step) in the root output dir.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Sequence

from mrl.algorithms.health import health_cell
from mrl.app.commands import DONE_MARKER, RUNNERS, SUMMARY_FILE, final_dir
from mrl.config import load_config
from mrl.config.errors import ConfigError
from mrl.config.recipes import find_recipe
from mrl.config.schema import MrlConfig, StageConfig


def _earlier(stage: StageConfig, key: str, name: str, done: dict[str, Path]) -> Path:
    if name not in done:
        raise ConfigError(f"stage '{stage.name}': {key} names no earlier training stage", key=f"stages.{key}",
                          given=name, allowed=", ".join(done) or "none (it is the first stage)")
    return done[name]


def stage_config(recipe: Path, root: MrlConfig, stage: StageConfig, overrides: Sequence[str],
                 previous: Path | None, earlier: dict[str, Path] | None = None) -> MrlConfig:
    """The resolved config of one stage (see the module docstring); `previous` and `earlier` (by stage name) are the
    final exports of the training stages before it."""
    source = recipe.parent / stage.config if stage.config else recipe
    earlier = earlier or {}
    extra = [f"++run.output_dir={Path(root.run.output_dir) / stage.name}"]
    if stage.init_from is not None:
        extra += [f"++policy.model_name={_earlier(stage, 'init_from', stage.init_from, earlier)}",
                  "++policy.build=null"]
    elif stage.init_from_previous and previous is not None:
        extra += [f"++policy.model_name={previous}", "++policy.build=null"]
    if stage.reward_model_from is not None:
        path = _earlier(stage, "reward_model_from", stage.reward_model_from, earlier)
        extra += [f"++env.reward_model.model={path}"]
    return load_config(source, [*stage.overrides, *overrides, *extra])


def _stage_done(cfg: MrlConfig, stage: StageConfig) -> bool:
    out = Path(cfg.run.output_dir)
    if stage.algorithm == "eval":
        return (out / SUMMARY_FILE).is_file()
    return (final_dir(cfg) / DONE_MARKER).is_file() and (out / SUMMARY_FILE).is_file()


def stage_configs(recipe: Path, root: MrlConfig, overrides: Sequence[str]) -> list[MrlConfig]:
    """Every stage's resolved config, each training stage handing its final export on (see the module docstring)."""
    configs: list[MrlConfig] = []
    previous: Path | None = None
    earlier: dict[str, Path] = {}
    for stage in root.stages:
        configs.append(stage_config(recipe, root, stage, overrides, previous, earlier))
        if stage.algorithm != "eval":
            previous = earlier[stage.name] = final_dir(configs[-1])
    return configs


def run_staged(recipe: str | Path, overrides: Sequence[str]) -> dict[str, Any]:
    recipe = find_recipe(recipe)  # a shipped recipe by name: its stages' `config:` files are found beside it
    root = load_config(recipe, overrides)
    if not root.stages:
        raise ConfigError("a staged recipe needs a non-empty `stages:` list", key="stages",
                          fix="use `mrl grpo --config ...` for a single run")
    # Every stage's config is resolved and validated before the first stage starts: a mistake in the last stage
    # must not surface after hours of the first ones.
    configs = stage_configs(recipe, root, overrides)
    summaries: dict[str, Any] = {}
    for index, (stage, cfg) in enumerate(zip(root.stages, configs), 1):
        out = Path(cfg.run.output_dir)
        if _stage_done(cfg, stage):
            print(f"[mrl] stage {index}/{len(root.stages)} '{stage.name}' already done ({out}); skipping",
                  file=sys.stderr, flush=True)
            summaries[stage.name] = json.loads((out / SUMMARY_FILE).read_text())
        else:
            print(f"[mrl] stage {index}/{len(root.stages)} '{stage.name}' ({stage.algorithm}) -> {out}",
                  file=sys.stderr, flush=True)
            summaries[stage.name] = RUNNERS[stage.algorithm](cfg)
    root_dir = Path(root.run.output_dir)
    root_dir.mkdir(parents=True, exist_ok=True)
    (root_dir / SUMMARY_FILE).write_text(json.dumps(summaries, indent=2) + "\n")
    _plot_rewards(summaries, root_dir / "reward_curve.png")
    print(summary_table(summaries))
    return summaries


def _fmt(value: Any) -> str:
    return "-" if value is None else f"{value:.3f}"


def summary_table(summaries: dict[str, Any]) -> str:
    """One row per stage: algorithm, minutes, training reward first/last 10 steps, held-out accuracy (GRPO and
    eval: answers right; DPO: preference accuracy; reward model: pair accuracy), and GRPO's run health ("ok", or the
    steps that warned and those that trained on nothing; mrl/algorithms/health.py)."""
    rows = [("stage", "algorithm", "time", "reward first10", "reward last10", "val acc before", "val acc after",
             "health")]
    for name, s in summaries.items():
        after = s.get("val_accuracy_after", s["final"].get("val/accuracy") if s["algorithm"] == "eval" else None)
        rows.append((name, s["algorithm"], f"{s['seconds'] / 60:.1f} min", _fmt(s.get("reward_first10")),
                     _fmt(s.get("reward_last10")), _fmt(s.get("val_accuracy_before")), _fmt(after), health_cell(s)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _plot_rewards(summaries: dict[str, Any], path: Path) -> None:
    curves = {name: s["reward_curve"] for name, s in summaries.items() if s.get("reward_curve")}
    if not curves:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, curve in curves.items():
        ax.plot(range(1, len(curve) + 1), curve, alpha=0.35, label=f"{name} (per step)")
        window = 10
        smooth = [sum(curve[max(0, i - window + 1): i + 1]) / len(curve[max(0, i - window + 1): i + 1])
                  for i in range(len(curve))]
        ax.plot(range(1, len(curve) + 1), smooth, label=f"{name} (mean of last {window})")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("mean training reward")
    if all(0 <= v <= 1 for curve in curves.values() for v in curve):
        ax.set_ylim(0, 1)  # 0/1 verifier rewards; a reward model's scores keep their own range
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
