"""`mrl plan` and `mrl submit`'s memory check over what a command runs: one config, or every stage of a staged
recipe (`stages:`, what `mrl run` runs), each stage planned with the workers of its own command (mrl/app/plan.py).

A later stage starts from an earlier stage's export (policy.model_name = <that stage>/final_hf or final_megatron),
which is not written before the recipe runs: it is planned with the model the earlier stage was planned with (an
export keeps its model's shapes), and said so. A stage whose model is a random one (policy.build), or the export of
such a stage, has no published size to plan: it is listed as not planned, and does not fail the recipe.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from mrl.app.plan import Plan, assumption_lines, make_plan, model_config, render
from mrl.app.results import final_dir
from mrl.app.stages import stage_configs
from mrl.config import MrlConfig, load_config
from mrl.config.recipes import find_recipe

Model = tuple[dict[str, Any], str]  # a config.json and where it came from


@dataclass(frozen=True)
class CommandPlan:
    """The plan of one config a command runs: a plain config's (`stage` ""), or one stage's of a staged recipe."""

    stage: str
    command: str
    cfg: MrlConfig
    plan: Plan | None  # None: nothing published to plan (a random model from policy.build)


def plan_command(
    recipe: str | Path,
    overrides: Sequence[str],
    *,
    command: str = "grpo",
    gpu: str = "h100-80gb",
    assume: Sequence[str] = (),
    model_config_path: str | None = None,
) -> list[CommandPlan]:
    """The plan of `command` on a config, or (a staged recipe) of each stage with its own command; a plain config
    without a model to plan is a ConfigError (make_plan's), a stage without one is listed unplanned."""
    path = find_recipe(recipe)
    root = load_config(path, overrides)
    if not root.stages:
        return [
            CommandPlan(
                "",
                command,
                root,
                make_plan(root, gpu=gpu, assume=assume, command=command, model_config_path=model_config_path),
            )
        ]
    exports: dict[str, Model | None] = {}  # a training stage's final export -> the model it was planned with
    out = []
    for stage, cfg in zip(root.stages, stage_configs(path, root, overrides)):
        model, shown = _stage_model(cfg, exports, model_config_path)
        plan = (
            None
            if model is None
            else make_plan(cfg, gpu=gpu, assume=assume, command=stage.algorithm, model=(model[0], shown))
        )
        out.append(CommandPlan(stage.name, stage.algorithm, cfg, plan))
        if stage.algorithm != "eval":
            exports[str(final_dir(cfg))] = model
    return out


def _stage_model(
    cfg: MrlConfig, exports: dict[str, Model | None], model_config_path: str | None
) -> tuple[Model | None, str]:
    """The model a stage is planned with and how the plan names its source: --model-config, the model of the
    earlier stage whose export it starts from (while that export is not written), or its own policy.model_name's;
    None for a random model."""
    name = cfg.policy.model_name
    if model_config_path is not None:
        model = model_config(cfg, model_config_path)
    elif name is None:
        return None, ""
    elif name in exports and not (Path(name) / "config.json").is_file():
        exported = exports[name]
        return exported, "" if exported is None else f"{exported[1]}, as the earlier stage exports it to {name}"
    else:
        model = model_config(cfg)
    return model, model[1]


def fits(plans: Sequence[CommandPlan]) -> bool:
    return all(entry.plan is None or entry.plan.fits for entry in plans)


def render_plans(plans: Sequence[CommandPlan]) -> str:
    """One plan's text, or each stage's under its own heading and the recipe's verdict last."""
    if len(plans) == 1 and not plans[0].stage:
        plan = plans[0].plan
        assert plan is not None  # a plain config is always planned (plan_command: make_plan raises otherwise)
        return render(plan, plans[0].cfg)
    blocks = []
    for index, entry in enumerate(plans, 1):
        heading = f"=== stage {index}/{len(plans)} '{entry.stage}' (mrl {entry.command}) ==="
        body = (
            render(entry.plan, entry.cfg, assumptions=False)
            if entry.plan
            else "not planned: a random model (policy.build), or the export of one, has no published size"
        )
        blocks.append(f"{heading}\n{body}")
    planned = [entry.plan for entry in plans if entry.plan is not None]
    if planned:  # the same for every stage (one --assume for all)
        blocks.append("\n".join(assumption_lines(planned[0])))
    unfit = [f"'{entry.stage}'" for entry in plans if entry.plan is not None and not entry.plan.fits]
    verdict = (
        f"recipe verdict: every stage planned fits ({len(planned)} of {len(plans)} stages planned)"
        if not unfit
        else f"recipe verdict: does NOT fit: stage {', '.join(unfit)} (each stage's verdict above says why)"
    )
    return "\n\n".join([*blocks, verdict])
