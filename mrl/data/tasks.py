"""The problems of a run and their prompts, from the `data` config section.

    data.arith set     -> the synthetic addition task: training pairs, held-out pairs, plain prompts without an
                          instruction ("37+05=")
    data.train / .val  -> problem/answer files (jsonl/parquet); bad rows are skipped and counted, a file with no
                          usable row is a ConfigError naming its key (mrl/data/datasets.py)
    data.sources       -> several datasets (each files or the arithmetic task), each problem tagged with its
                          environment (`envs`) and source; the training problems drawn by weight (`mix`), every
                          source's validation problems kept
Prompts are token ids made with the configured template; a prompt over `data.max_prompt_length` is dropped (or
truncated, per `generation.overlong_prompt`) and counted, never fatal.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Sequence

from mrl.config.errors import ConfigError, suggest
from mrl.config.schema import MrlConfig
from mrl.data import nemo_gym
from mrl.data.datasets import Problem, load_problems
from mrl.data.templates import PromptTemplate


@dataclass
class TaskData:
    train: list[Problem]
    val: list[Problem]
    template: PromptTemplate
    skipped: dict[str, int] = field(default_factory=dict)
    arith: Any = None  # the ArithTask when the synthetic task is used (SFT labels come from it)
    templates: list[PromptTemplate] = field(default_factory=list)  # per source of data.sources ([]: `template`)

    def template_of(self, problem: Problem) -> PromptTemplate:
        """The prompt template of a problem's source."""
        return self.templates[problem.source] if self.templates else self.template

    def by_template(self, *, val: bool = False) -> list[tuple[PromptTemplate, list[Problem]]]:
        """Each source's template with its training problems, or with `val` its validation problems (one pair in a
        run with one source)."""
        problems = self.val if val else self.train
        if not self.templates:
            return [(self.template, problems)]
        return [(t, [p for p in problems if p.source == i]) for i, t in enumerate(self.templates)]


def load_task_data(cfg: MrlConfig, *, val_source: Optional[str] = None) -> TaskData:
    """Training and validation problems of the run; `val_source` overrides data.val (e.g. eval.data)."""
    data = cfg.data
    if data.sources:
        return _load_sources(cfg, val_source)
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
        load_problems(
            val_path,
            split="test",
            key=val_key,
            problem_key=problem_key,
            answer_key=answer_key,
            read_before="data.train" if train else None,
        )
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
    problems: Sequence[Problem], tokenizer: Any, data: "TaskData | PromptTemplate", cfg: MrlConfig
) -> tuple[list[Problem], list[list[int]]]:
    """The problems whose prompts fit, and their token ids (see the module docstring); each problem with its
    source's template (`data`: the run's TaskData, or one template for all)."""
    kept_problems, kept_ids = [], []
    max_length, overlong = cfg.data.max_prompt_length, cfg.generation.overlong_prompt
    for problem in problems:
        template = data if isinstance(data, PromptTemplate) else data.template_of(problem)
        if nemo_gym.is_row(problem.fields):  # a conversation of its own, with its tools
            fields = problem.fields
            ids = template.encode_messages(
                nemo_gym.input_messages(fields),
                nemo_gym.chat_tools(fields),
                problem.problem,
                tokenizer,
                max_length=max_length,
                overlong=overlong,
            )
        else:
            encoded, kept = template.encode([problem.problem], tokenizer, max_length=max_length, overlong=overlong)
            ids = encoded[0] if kept else None
        if ids is not None:
            kept_problems.append(problem)
            kept_ids.append(ids)
    return kept_problems, kept_ids


def _load_sources(cfg: MrlConfig, val_source: Optional[str]) -> TaskData:
    """data.sources: each source's problems tagged with its environment and index, the training problems mixed by
    weight, every source's validation problems in source order."""
    if val_source:
        raise ConfigError(
            "eval.data replaces the validation rows of a run with one dataset; this run has several (data.sources)",
            key="eval.data",
            given=val_source,
            fix="drop eval.data (each source's val rows are evaluated), or evaluate one source's file alone",
        )
    trains, vals, templates, skipped = [], [], [], {}
    for index, source in enumerate(cfg.data.sources):
        train, val, template, source_skipped = _load_source(cfg, index, source)
        trains.append(train)
        vals += val
        templates.append(template)
        skipped.update(source_skipped)
    weights = [source.weight for source in cfg.data.sources]
    return TaskData(mix(trains, weights, cfg.run.seed), vals, templates[0], skipped, templates=templates)


def _load_source(cfg: MrlConfig, index: int, source: Any) -> tuple[list[Problem], list[Problem], PromptTemplate, dict]:
    """One source's (train, val, template, skipped rows), each problem tagged with its environment and source."""
    key = f"data.sources[{index}]"
    train, val, skipped = _source_rows(cfg, key, source)
    generated = source.arith is not None or source.reasoning_gym is not None  # no instruction unless the source says
    default = "" if generated else cfg.data.instruction
    template = PromptTemplate(cfg.data.prompt_template, default if source.instruction is None else source.instruction)
    path = {"train": source.train, "val": source.val}

    def tagged(problems: list[Problem], split: str) -> list[Problem]:
        return [replace(p, env=source.env or _row_env(cfg, key, path[split], p), source=index) for p in problems]

    return tagged(train, "train"), tagged(val, "val"), template, skipped


def _source_rows(cfg: MrlConfig, key: str, source: Any) -> tuple[list[Problem], list[Problem], dict]:
    """A source's untagged (train, val, skipped rows): the arithmetic task's pairs, reasoning-gym's rows, or files."""
    if source.arith is not None:
        from mrl.data.arith import ArithTask

        task = ArithTask.from_config(source.arith, cfg.run.seed)
        return task.train_problems(), task.heldout_problems(), {}
    if source.reasoning_gym is not None:
        from mrl.data.reasoning_gym import generate

        train, val, dropped = generate(source.reasoning_gym, f"{key}.reasoning_gym")
        return train, val, {f"{key}.reasoning_gym.val:{reason}": n for reason, n in dropped.items()}
    problem_key = source.problem_key or cfg.data.problem_key
    answer_key = source.answer_key or cfg.data.answer_key
    sets = {}
    for name, split, path in (("train", "train", source.train), ("val", "test", source.val)):
        if path:
            read_before = f"{key}.train" if "train" in sets else None  # the same column keys: the same columns
            sets[name] = load_problems(
                path,
                split=split,
                key=f"{key}.{name}",
                problem_key=problem_key,
                answer_key=answer_key,
                read_before=read_before,
            )
    skipped = {f"{part.source}:{reason}": n for part in sets.values() for reason, n in part.skipped.items()}
    problems = {name: part.problems for name, part in sets.items()}
    return problems.get("train", []), problems.get("val", []), skipped


def _row_env(cfg: MrlConfig, key: str, path: str, problem: Problem) -> str:
    """The environment a row names in the column data.env_key (a source without `env`): one of `envs`, else the
    ConfigError naming the row, the name and the names allowed."""
    column, names = cfg.data.env_key, sorted(cfg.envs)
    name = problem.fields.get(column)
    if name in cfg.envs:
        return str(name)
    if name is None:
        raise ConfigError(
            f"{path}: row {problem.row} names no environment (no column {column!r})",
            key=f"{key}.env",
            allowed=", ".join(names),
            fix=f"give every row its environment in the column {column!r} (data.env_key), or set {key}.env",
        )
    near = suggest(str(name), names)
    raise ConfigError(
        f"{path}: row {problem.row} names the environment {name!r}, which this run does not define",
        key=f"{key}.env",
        given=name,
        allowed=", ".join(names),
        fix=f"{'correct it to ' + repr(near) if near else 'correct the row'}, or add envs.{name}",
    )


def mix(parts: Sequence[Sequence[Problem]], weights: Sequence[float], seed: int) -> list[Problem]:
    """The training problems of several sources, source i giving weight_i / sum(weights) of them: as many in all as
    the sources with a weight hold, each source's share (largest remainders) taken from a shuffle of its problems
    (seeded by `seed` and the source), cycled when the share is larger than the source. The loader shuffles the
    whole; the same sources, weights and seed give the same list (an exact resume rebuilds it)."""
    total = sum(len(part) for part, weight in zip(parts, weights) if weight > 0)
    exact = [weight / sum(weights) * total for weight in weights]  # sum(weights) > 0: the config check
    counts = [int(share) for share in exact]
    by_remainder = sorted(range(len(parts)), key=lambda i: (counts[i] - exact[i], i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    out: list[Problem] = []
    for i, (part, count) in enumerate(zip(parts, counts)):
        if not part or not count:
            continue
        order = list(range(len(part)))
        random.Random(seed * 1_000_003 + i).shuffle(order)
        out += [part[order[j % len(part)]] for j in range(count)]
    return out
