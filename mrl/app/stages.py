"""`mrl run RECIPE`: the stages of a recipe in order, each starting from the previous stage's final export.

For stage s (see `StageConfig`): the config is the stage's own recipe file (`config:`, relative to the staged
recipe) or the staged recipe itself, then the stage's `overrides`, then the command line's, then
    run.output_dir=<root output dir>/<stage name>
    policy.model_name=<previous stage's final export>, policy.build removed   (when init_from_previous)
    policy.model_name=<stage `init_from`'s final export>                      (when init_from names a stage)
    env.reward_model.model=<stage `reward_model_from`'s final export>         (when reward_model_from names one)
    distillation.teacher=<stage `teacher_from`'s final export>                (when teacher_from names one)
A final export is the stage's `final_hf/`, or its `final_megatron/` when that stage's run.final_format is megatron
(`run.final_format: megatron` in a staged recipe hands every stage on as a Megatron checkpoint: no HF export and no
conversion between stages). A stage whose final export is complete (training) or whose `summary.json` exists (eval)
is done and skipped, so re-running the same command after a crash continues where it stopped (inside a stage, from
its newest checkpoint).

At the end: a table (per stage: time, reward before/after, held-out accuracy before/after), `summary.json`, and
`reward_curve.png` (GRPO training reward per step) in the root output dir, then where the results are (each stage's
folder and model, the TensorBoard command for every stage: mrl/app/results.py). A stage that a guard stops (too many
non-finite or idle steps in a row) ends the run there; the root summary.json is written all the same, with the
stages done and the stopped stage's summary (its `stopped` says why).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Sequence

from mrl.algorithms.guards import TrainingStopped
from mrl.algorithms.health import health_cell
from mrl.app.preflight import check_output_folder, check_stage
from mrl.app.results import DONE_MARKER, REWARD_CURVE, SUMMARY_FILE, final_dir, plot_rewards, staged_report
from mrl.config import load_config
from mrl.config.errors import ConfigError
from mrl.config.recipes import find_recipe
from mrl.config.schema import MrlConfig, StageConfig


def _earlier(stage: StageConfig, key: str, name: str, done: dict[str, Path]) -> Path:
    if name not in done:
        raise ConfigError(
            f"stage '{stage.name}': {key} names no earlier training stage",
            key=f"stages.{key}",
            given=name,
            allowed=", ".join(done) or "none (it is the first stage)",
        )
    return done[name]


def stage_config(
    recipe: Path,
    root: MrlConfig,
    stage: StageConfig,
    overrides: Sequence[str],
    previous: Path | None,
    earlier: dict[str, Path] | None = None,
) -> MrlConfig:
    """The resolved config of one stage (see the module docstring); `previous` and `earlier` (by stage name) are the
    final exports of the training stages before it."""
    index = root.stages.index(stage)  # names are unique (`_reference_problems`)
    source = recipe.parent / stage.config if stage.config else recipe
    if stage.config and not source.is_file():
        raise ConfigError(
            f"stage '{stage.name}': its config file {'is a folder' if source.is_dir() else 'is not found'}: {source}",
            key=f"stages[{index}].config",
            given=stage.config,
            fix=f"a YAML file's path relative to the staged recipe's folder ({recipe.parent}), or no config: (the "
            "stage runs the staged recipe itself)",
        )
    earlier = earlier or {}
    extra = [f"++run.output_dir={Path(root.run.output_dir) / stage.name}"]
    if stage.init_from is not None:
        extra += [
            f"++policy.model_name={_earlier(stage, 'init_from', stage.init_from, earlier)}",
            "++policy.build=null",
        ]
    elif stage.init_from_previous and previous is not None:
        extra += [f"++policy.model_name={previous}", "++policy.build=null"]
    if stage.reward_model_from is not None:
        path = _earlier(stage, "reward_model_from", stage.reward_model_from, earlier)
        extra += [f"++env.reward_model.model={path}"]
    if stage.teacher_from is not None:
        extra += [f"++distillation.teacher={_earlier(stage, 'teacher_from', stage.teacher_from, earlier)}"]
    try:
        return load_config(source, [*stage.overrides, *overrides, *extra])
    except ConfigError as error:
        raise in_stage(error, stage, index) from error


def in_stage(error: ConfigError, stage: StageConfig, index: int | None = None) -> ConfigError:
    """`error`, met in one stage's config or checks, naming the stage (the same key can differ from stage to stage);
    with `index`, a problem with a key that the stage's own overrides set names the override."""
    if error.problems:
        return ConfigError("", problems=[in_stage(problem, stage, index) for problem in error.problems])
    where = f"stage '{stage.name}'"
    set_by = [text for text in stage.overrides if error.key and _override_key(text) == error.key]
    if set_by and index is not None:
        where += f", set by stages[{index}].overrides ({set_by[-1]})"
    return ConfigError(
        f"{where}: {error.message}", key=error.key, given=error.given, allowed=error.allowed, fix=error.fix
    )


def _override_key(text: str) -> str:
    """The dotted key an override sets (`++a.b=1`, `~a.b`: a.b)."""
    return text.lstrip("+~").partition("=")[0].strip()


def _check_stage(stage: StageConfig, cfg: MrlConfig) -> None:
    """`check_stage`, its error naming the stage."""
    try:
        check_stage(cfg, stage.algorithm)
    except ConfigError as error:
        raise in_stage(error, stage) from error


def stage_done(cfg: MrlConfig, stage: StageConfig) -> bool:
    """The stage's results are there (its final export and summary.json; an eval's summary.json): a run skips it."""
    out = Path(cfg.run.output_dir)
    if stage.algorithm == "eval":
        return (out / SUMMARY_FILE).is_file()
    return (final_dir(cfg) / DONE_MARKER).is_file() and (out / SUMMARY_FILE).is_file()


#: What a stage reference may name: a reward model's stage, or a language model's (a policy, a teacher).
_REFERENCE_KINDS = {
    "reward_model_from": ("rm",),
    "init_from": ("sft", "dpo", "grpo"),
    "teacher_from": ("sft", "dpo", "grpo"),
}


def _reference_problems(stages: Sequence[StageConfig]) -> list[ConfigError]:
    """Stage names that repeat (the second stage would find the first's results and be skipped), and references to
    an earlier stage of the wrong kind (a GRPO stage scored by an SFT model, a policy started from a reward model)."""
    kinds: dict[str, str] = {}
    out = []
    for stage in stages:
        if stage.name in kinds:
            out.append(
                ConfigError(
                    f"two stages are named '{stage.name}': the second would find the first's results and be skipped",
                    key="stages.name",
                    given=stage.name,
                    allowed="a name no other stage has",
                    fix="rename one of them (a stage's name is its folder under run.output_dir)",
                )
            )
        for key, wanted in _REFERENCE_KINDS.items():
            name = getattr(stage, key)
            if name is None or kinds.get(name, "eval") == "eval" or kinds[name] in wanted:
                continue  # unknown and eval names are `_earlier`'s to refuse
            fitting = [n for n, kind in kinds.items() if kind in wanted]
            out.append(
                ConfigError(
                    f"stage '{stage.name}': {key} names the {kinds[name]} stage '{name}', not a stage of "
                    f"{' / '.join(wanted)}",
                    key=f"stages.{key}",
                    given=name,
                    allowed=", ".join(fitting) or f"none: no earlier {' / '.join(wanted)} stage",
                )
            )
        kinds.setdefault(stage.name, stage.algorithm)
    return out


def stage_configs(recipe: Path, root: MrlConfig, overrides: Sequence[str]) -> list[MrlConfig]:
    """Every stage's resolved config, each training stage handing its final export on (see the module docstring)."""
    problems = _reference_problems(root.stages)
    if problems:
        raise ConfigError("", problems=problems)
    configs: list[MrlConfig] = []
    previous: Path | None = None
    earlier: dict[str, Path] = {}
    for stage in root.stages:
        configs.append(stage_config(recipe, root, stage, overrides, previous, earlier))
        if stage.algorithm != "eval":
            previous = earlier[stage.name] = final_dir(configs[-1])
    return configs


def staged_recipe(recipe: str | Path, overrides: Sequence[str]) -> tuple[MrlConfig, list[MrlConfig]]:
    """The staged recipe's own config and every stage's (`stage_configs`); a recipe without stages is refused."""
    recipe = find_recipe(recipe)  # a shipped recipe by name: its stages' `config:` files are found beside it
    root = load_config(recipe, overrides)
    if not root.stages:
        raise ConfigError(
            "a staged recipe needs a non-empty `stages:` list",
            key="stages",
            fix="use `mrl grpo --config ...` for a single run",
        )
    return root, stage_configs(recipe, root, overrides)


def run_staged(recipe: str | Path, overrides: Sequence[str]) -> dict[str, Any]:
    from mrl.app.commands import RUNNERS

    # Every stage's config is resolved and validated before the first stage starts, and what each stage still to
    # run reads is checked (mrl/app/preflight.py): a mistake in the last stage must not surface after hours of the
    # first ones.
    root, configs = staged_recipe(recipe, overrides)
    check_output_folder(root.run.output_dir)
    for stage, cfg in zip(root.stages, configs):
        if not stage_done(cfg, stage):
            _check_stage(stage, cfg)
    summaries: dict[str, Any] = {}
    try:
        for index, (stage, cfg) in enumerate(zip(root.stages, configs), 1):
            out = Path(cfg.run.output_dir)
            if stage_done(cfg, stage):
                print(
                    f"[mrl] stage {index}/{len(root.stages)} '{stage.name}' already done ({out}); skipping",
                    file=sys.stderr,
                    flush=True,
                )
                summaries[stage.name] = json.loads((out / SUMMARY_FILE).read_text())
            else:
                print(
                    f"[mrl] stage {index}/{len(root.stages)} '{stage.name}' ({stage.algorithm}) -> {out}",
                    file=sys.stderr,
                    flush=True,
                )
                summaries[stage.name] = RUNNERS[stage.algorithm](cfg)
    except TrainingStopped:
        stopped, cfg = root.stages[len(summaries)], configs[len(summaries)]
        written = Path(cfg.run.output_dir) / SUMMARY_FILE  # by the stopped stage (mrl/app/results.py summary_on_stop)
        summaries[stopped.name] = json.loads(written.read_text())
        _finish(root, configs, summaries)
        raise
    _finish(root, configs, summaries)
    return summaries


def _finish(root: MrlConfig, configs: list[MrlConfig], summaries: dict[str, Any]) -> None:
    """The root summary.json and reward curve, the table, and where the results are."""
    root_dir = Path(root.run.output_dir)
    root_dir.mkdir(parents=True, exist_ok=True)
    (root_dir / SUMMARY_FILE).write_text(json.dumps(summaries, indent=2) + "\n")
    plot_rewards({name: s.get("reward_curve") or [] for name, s in summaries.items()}, root_dir / REWARD_CURVE)
    print(summary_table(summaries))
    print(staged_report(root, [(stage.name, cfg) for stage, cfg in zip(root.stages, configs)]), flush=True)


def _fmt(value: Any) -> str:
    return "-" if value is None else f"{value:.3f}"


def summary_table(summaries: dict[str, Any]) -> str:
    """One row per stage: algorithm, minutes, training reward first/last 10 steps, held-out accuracy (GRPO and
    eval: answers right; DPO: preference accuracy; reward model: pair accuracy), and GRPO's run health ("ok", or the
    steps that warned and those that trained on nothing; mrl/algorithms/health.py)."""
    rows = [
        ("stage", "algorithm", "time", "reward first10", "reward last10", "val acc before", "val acc after", "health")
    ]
    for name, s in summaries.items():
        after = s.get("val_accuracy_after", s["final"].get("val/accuracy") if s["algorithm"] == "eval" else None)
        rows.append(
            (
                name,
                s["algorithm"],
                f"{s['seconds'] / 60:.1f} min",
                _fmt(s.get("reward_first10")),
                _fmt(s.get("reward_last10")),
                _fmt(s.get("val_accuracy_before")),
                _fmt(after),
                health_cell(s),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
