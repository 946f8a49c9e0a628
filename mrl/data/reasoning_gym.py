"""Problems from reasoning-gym's procedural tasks (`data.sources[].reasoning_gym`), generated, never downloaded.

    tasks {name: weight}, size, seed, config   -> reasoning-gym's own composite dataset (`reasoning_gym.composite`):
                                                   row i's task drawn by weight from Random(seed + i), each task's rows
                                                   from its own seed; the same settings give the same rows
    val_size                                   -> the same, from another seed; a validation row whose question is
                                                   also a training row's is dropped (counted), so validation is held out

Each row becomes a `Problem` whose `fields` is reasoning-gym's entry (question, answer, metadata), which its task's
scorer reads (mrl/environments/reasoning_gym.py). The prompt is the question, or a field of the metadata
(`prompt_key`, e.g. basic_arithmetic's bare `expression` for a tokenizer without letters).

reasoning-gym 0.1.25 (pinned in requirements/cpu.lock, the `reasoning-gym` extra) validates its configs with
asserts and raises TypeError for an unknown field; both become a ConfigError naming the key here.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from mrl.config.errors import ConfigError, suggest
from mrl.data.datasets import Problem

#: Added to the seed of the validation rows: far from any training row's seed + index.
VAL_SEED_OFFSET = 1_000_003


def generate(rg_cfg: Any, key: str) -> tuple[list[Problem], list[Problem], Counter]:
    """(training problems, validation problems, validation rows dropped by reason) of a reasoning-gym source;
    `key` names it in errors (data.sources[i].reasoning_gym)."""
    _require_installed(key)
    _check_tasks(rg_cfg, key)
    train = _rows(rg_cfg, rg_cfg.size, rg_cfg.seed, key)
    val = _rows(rg_cfg, rg_cfg.val_size, rg_cfg.seed + VAL_SEED_OFFSET, key) if rg_cfg.val_size else []
    seen = {entry["question"] for entry in train}
    held_out = [entry for entry in val if entry["question"] not in seen]
    dropped = Counter({"also a training question": len(val) - len(held_out)} if len(val) > len(held_out) else {})
    to_problems = lambda entries: [_problem(i, entry, rg_cfg.prompt_key, key) for i, entry in enumerate(entries)]  # noqa: E731
    return to_problems(train), to_problems(held_out), dropped


def _require_installed(key: str) -> None:
    try:
        import reasoning_gym  # noqa: F401
    except ImportError:
        raise ConfigError(
            "reasoning-gym is not installed",
            key=key,
            fix="pip install 'mrl[reasoning-gym]' (make install includes it on CPU machines)",
        ) from None


def _check_tasks(rg_cfg: Any, key: str) -> None:
    """Every task name one reasoning-gym knows, else the error with the nearest name and where the list is."""
    from reasoning_gym.factory import DATASETS

    known = sorted(name for name in DATASETS if name != "composite")
    for name in rg_cfg.tasks:
        if name not in known:
            near = suggest(name, known)
            raise ConfigError(
                f"reasoning-gym has no task {name!r}",
                key=f"{key}.tasks",
                given=name,
                allowed=f"{len(known)} tasks, e.g. {', '.join(known[:6])}, ... (reasoning_gym.factory.DATASETS)",
                fix=f"use {near!r}" if near else "pick a task of reasoning_gym.factory.DATASETS",
            )


def _rows(rg_cfg: Any, size: int, seed: int, key: str) -> list[dict]:
    """`size` entries of the weighted composite of the source's tasks."""
    import reasoning_gym
    from reasoning_gym.composite import DatasetSpec

    specs = [DatasetSpec(name, weight, dict(rg_cfg.config.get(name, {}))) for name, weight in rg_cfg.tasks.items()]
    try:
        dataset = reasoning_gym.create_dataset("composite", size=size, seed=seed, datasets=specs)
    except (TypeError, AssertionError, ValueError) as err:
        raise ConfigError(
            f"reasoning-gym refused the tasks' configs: {err or type(err).__name__}",
            key=f"{key}.config",
            given={name: dict(config) for name, config in rg_cfg.config.items()},
            fix="use each task's config fields and bounds (dataclasses.fields of its config class in "
            "reasoning_gym.factory.DATASETS)",
        ) from None
    return [dataset[i] for i in range(size)]


def _problem(index: int, entry: dict, prompt_key: str, key: str) -> Problem:
    """One entry as a Problem: its prompt (the question, or a metadata field), its answer, the entry kept whole."""
    if prompt_key == "question":
        prompt = entry["question"]
    else:
        metadata = entry.get("metadata", {})
        if prompt_key not in metadata:
            task = metadata.get("source_dataset", "?")
            raise ConfigError(
                f"a {task} row's metadata has no {prompt_key!r}",
                key=f"{key}.prompt_key",
                given=prompt_key,
                allowed=", ".join(["question", *sorted(k for k, v in metadata.items() if isinstance(v, str))]),
                fix=f"{key}.prompt_key=question, or a field every task of the source has",
            )
        prompt = str(metadata[prompt_key])
    return Problem(prompt, str(entry["answer"]), index, dict(entry))
