"""The problems of a run and their prompts, from the `data` config section.

    data.arith set     -> the synthetic addition task: training pairs, held-out pairs, plain prompts without an
                          instruction ("37+05=")
    data.train / .val  -> problem/answer files (jsonl/parquet); bad rows are skipped and counted, a file with no
                          usable row is a ConfigError naming its key (mrl/data/datasets.py)
Prompts are token ids made with the configured template; a prompt over `data.max_prompt_length` is dropped (or
truncated, per `generation.overlong_prompt`) and counted, never fatal.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from mrl.config.errors import ConfigError
from mrl.config.schema import MrlConfig
from mrl.data.datasets import Problem, load_problems
from mrl.data.templates import PromptTemplate


@dataclass
class TaskData:
    train: list[Problem]
    val: list[Problem]
    template: PromptTemplate
    skipped: dict[str, int] = field(default_factory=dict)
    arith: Any = None  # the ArithTask when the synthetic task is used (SFT labels come from it)


def load_task_data(cfg: MrlConfig, *, val_source: Optional[str] = None) -> TaskData:
    """Training and validation problems of the run; `val_source` overrides data.val (e.g. eval.data)."""
    data = cfg.data
    if data.arith is not None:
        from mrl.data.arith import ArithTask

        task = ArithTask.from_config(data.arith, cfg.run.seed)
        return TaskData(task.train_problems(), task.heldout_problems(), PromptTemplate("plain", ""), arith=task)
    template = PromptTemplate(data.prompt_template, data.instruction)
    problem_key, answer_key = data.problem_key, data.answer_key
    train = (
        load_problems(data.train, key="data.train", problem_key=problem_key, answer_key=answer_key)
        if data.train
        else None
    )
    val_path, val_key = (val_source, "eval.data") if val_source else (data.val, "data.val")
    val = (
        load_problems(val_path, split="test", key=val_key, problem_key=problem_key, answer_key=answer_key)
        if val_path
        else None
    )
    if train is None and val is None:
        raise ConfigError(
            "no data to read",
            key="data.train",
            fix="set data.train (and data.val or eval.data) to a jsonl/parquet file, or data.arith",
        )
    skipped = {f"{part.source}:{reason}": n for part in (train, val) if part for reason, n in part.skipped.items()}
    return TaskData(train.problems if train else [], val.problems if val else [], template, skipped)


def encode_prompts(
    problems: Sequence[Problem], tokenizer: Any, template: PromptTemplate, cfg: MrlConfig
) -> tuple[list[Problem], list[list[int]]]:
    """The problems whose prompts fit, and their token ids (see the module docstring)."""
    ids, kept = template.encode(
        [p.problem for p in problems],
        tokenizer,
        max_length=cfg.data.max_prompt_length,
        overlong=cfg.generation.overlong_prompt,
    )
    return [problems[i] for i in kept], ids
