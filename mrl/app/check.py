"""`mrl check RUN_DIR RECIPE`: a finished run's figures against the `expect:` block of its recipe.

Data flow: the recipe's `expect:` (`ExpectConfig`: `figures`, each a path into the run's summary.json with a `min`
and/or a `max`) -> RUN_DIR/summary.json (a staged run's holds one summary per stage, so a path opens with the stage:
`grpo.val_accuracy_after`; a single command's is the summary itself: `val_accuracy_after`) -> one line per figure,
ok or missed with the value and its bound. A figure may be the difference of two paths (`grpo.reward_last10 -
grpo.reward_first10`: what the training gained). Keys of the summary that hold dots are not reachable by a path;
its metric names hold slashes (`grpo.final.train/reward`).

Exit 0 when every figure holds; 5 when one is missed (each named with its value and bound); 2 when the recipe has no
`expect:` or a path names nothing in the summary (the fix is in the recipe); 1 when RUN_DIR holds no finished run's
summary: none, one that is not a JSON object, or one without a stage of the recipe that a figure names (the fix is
RUN_DIR: a wrong or unfinished run's folder). A recipe's `expect.verified: false` says its figures come from the plan
and the peers' published runs, not yet from a run of this recipe: a miss is reported the same way, with that said.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mrl.config import ConfigError, MrlConfig
from mrl.config.schema import FigureBound

#: `mrl check`'s exit status when a figure misses its bound.
MISSED_EXIT_CODE = 5
SUMMARY_FILE = "summary.json"


class NoFinishedRun(FileNotFoundError):
    """RUN_DIR holds no finished run's summary of the recipe (module docstring): exit 1, as a file the user named
    that cannot be used, since the fix is the folder, not the recipe."""


@dataclass(frozen=True)
class FigureResult:
    figure: str
    value: float
    bound: FigureBound

    @property
    def ok(self) -> bool:
        low, high = self.bound.min, self.bound.max
        return math.isfinite(self.value) and (low is None or self.value >= low) and (high is None or self.value <= high)

    def line(self) -> str:
        wanted = " and ".join(
            part
            for part in (
                self.bound.min is not None and f">= {self.bound.min:g}",
                self.bound.max is not None and f"<= {self.bound.max:g}",
            )
            if part
        )
        return f"{'ok    ' if self.ok else 'MISSED'} {self.figure} = {self.value:.4g} (expected {wanted})"


def lookup(summary: dict[str, Any], path: str, figure: str, stages: frozenset[str] = frozenset()) -> float:
    """The number at a dotted `path` of the summary; a ConfigError naming the figure when nothing is there, but
    NoFinishedRun when the summary lacks the path's first part and that is one of the recipe's `stages` or the summary
    is empty (the run folder's fault, not the recipe's)."""
    node: Any = summary
    for i, part in enumerate(path.split(".")):
        if i == 0 and part not in summary and (part in stages or not summary):
            raise _no_stage(summary, part, figure, stages)
        if not isinstance(node, dict) or part not in node:
            where = ".".join(path.split(".")[:i]) or "the summary"
            have = ", ".join(sorted(node)) if isinstance(node, dict) else type(node).__name__
            raise ConfigError(
                f"the figure's path {path!r} names nothing: {where} has no {part!r}",
                key=f"expect.figures.{figure}",
                given=path,
                allowed=f"a path into {SUMMARY_FILE} (under {where}: {have})",
                fix="correct the path in the recipe's expect.figures (a staged run's paths open with the stage name)",
            )
        node = node[part]
    if isinstance(node, bool) or not isinstance(node, (int, float)):
        raise ConfigError(
            f"the figure's path {path!r} holds {node!r}, not a number",
            key=f"expect.figures.{figure}",
            given=path,
            allowed="a path to a number in the run's summary.json",
            fix="point the figure at a number (e.g. grpo.val_accuracy_after)",
        )
    return float(node)


def _no_stage(summary: dict[str, Any], part: str, figure: str, stages: frozenset[str]) -> NoFinishedRun:
    what = f"no stage {part!r}" if stages else f"no {part!r}"
    have = ", ".join(sorted(summary)) or "nothing"
    return NoFinishedRun(
        f"the summary holds {what} (it holds: {have}), which the recipe's figure {figure!r} reads: a wrong or "
        f"unfinished run? RUN_DIR must be the run.output_dir of a finished run of this recipe"
        f"{' (a staged run: its root folder)' if stages else ''}"
    )


def figure_value(summary: dict[str, Any], figure: str, stages: frozenset[str] = frozenset()) -> float:
    """A figure is a path, or `path - path` (the difference of two); `stages`: the recipe's stage names (`lookup`)."""
    parts = [part.strip() for part in figure.split(" - ")]
    if len(parts) == 1:
        return lookup(summary, parts[0], figure, stages)
    if len(parts) == 2:
        return lookup(summary, parts[0], figure, stages) - lookup(summary, parts[1], figure, stages)
    raise ConfigError(
        f"the figure {figure!r} is neither a path nor the difference of two",
        key=f"expect.figures.{figure}",
        given=figure,
        allowed="PATH or PATH - PATH (paths into summary.json, e.g. grpo.reward_last10 - grpo.reward_first10)",
        fix="write the figure as one path or as the difference of two",
    )


def check_run(run_dir: Path, cfg: MrlConfig) -> list[FigureResult]:
    """Every figure of the recipe's `expect:` against RUN_DIR/summary.json."""
    if cfg.expect is None or not cfg.expect.figures:
        raise ConfigError(
            "the recipe expects nothing",
            key="expect.figures",
            given=None,
            allowed="figures with a min and/or a max, e.g. {grpo.val_accuracy_after: {min: 0.5}}",
            fix="add an expect: block to the recipe (docs/guides/check.md)",
        )
    summary = read_summary(Path(run_dir))
    stages = frozenset(stage.name for stage in cfg.stages)
    try:
        return [
            FigureResult(name, figure_value(summary, name, stages), bound) for name, bound in cfg.expect.figures.items()
        ]
    except NoFinishedRun as error:  # said of this run's file
        raise NoFinishedRun(str(error).replace("the summary", str(Path(run_dir) / SUMMARY_FILE), 1)) from None


def read_summary(run_dir: Path) -> dict[str, Any]:
    """RUN_DIR/summary.json, or NoFinishedRun saying why it cannot be read."""
    path = run_dir / SUMMARY_FILE
    if not path.is_file():
        raise NoFinishedRun(f"{path} does not exist: RUN_DIR must be a finished run's run.output_dir")
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise NoFinishedRun(
            f"{path} is not valid JSON ({error}): RUN_DIR must be a finished run's run.output_dir, whose "
            f"{SUMMARY_FILE} a run writes at its end; pass that folder, or re-run the recipe to write it again"
        ) from None
    if not isinstance(summary, dict):
        raise NoFinishedRun(
            f"{path} holds a {type(summary).__name__}, not a run's summary (a JSON object): RUN_DIR must be a "
            "finished run's run.output_dir"
        )
    return summary


def report(results: list[FigureResult], cfg: MrlConfig) -> str:
    """One line per figure, then the verdict; unverified figures say so."""
    assert cfg.expect is not None  # check_run refused a recipe without one
    lines = [result.line() for result in results]
    missed = [r.figure for r in results if not r.ok]
    source = f" (figures: {cfg.expect.source})" if cfg.expect.source else ""
    if not cfg.expect.verified:
        source += "; UNVERIFIED figures: no run of this recipe has confirmed them yet"
    verdict = f"{len(missed)} of {len(results)} figures missed: {', '.join(missed)}" if missed else "every figure holds"
    return "\n".join([*lines, f"[mrl check] {verdict}{source}"])
