"""Problem/answer datasets: local jsonl, json or parquet files (DeepScaleR's `problem`, `answer` columns by default),
or a dataset folder laid out as a hub repo (a hub id is resolved to its snapshot folder before the run starts,
mrl/app/hub_ids.py; the asked split's files are read, mrl/data/hub.py `split_files`).

Bad rows never crash a run: a row that is not a JSON object, lacks the problem or the answer, or has an empty
problem is skipped and counted by reason (`ProblemSet.skipped`); only a source with no usable row at all is an
error, and that error names the columns that were found so the fix (`data.problem_key=...`) is obvious.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

from mrl.data.hub import local_split

logger = logging.getLogger(__name__)

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
INVALID_JSON = object()  # stands for a jsonl line that does not parse


@dataclass(frozen=True)
class Problem:
    """One prompt with its gold answer; `row` is its index in the source (for error reports)."""

    problem: str
    answer: str
    row: int = -1
    fields: dict = field(default_factory=dict, compare=False, hash=False)  # the whole source row (server sessions)


@dataclass
class ProblemSet:
    problems: list[Problem]
    source: str
    skipped: Counter = field(default_factory=Counter)  # reason -> rows skipped

    @property
    def num_skipped(self) -> int:
        return sum(self.skipped.values())

    def __len__(self) -> int:
        return len(self.problems)


def load_problems(source: str | Path, *, problem_key: str = "problem", answer_key: str = "answer",
                  split: str = "train", max_rows: Optional[int] = None) -> ProblemSet:
    """Read a jsonl/parquet file (or an HF dataset name) into `Problem`s, skipping and counting bad rows."""
    rows, columns = read_rows(str(source), split)
    result = ProblemSet([], str(source))
    for index, row in rows:
        problem, reason = _to_problem(index, row, problem_key, answer_key)
        if problem is None:
            result.skipped[reason] += 1
            continue
        result.problems.append(problem)
        if max_rows is not None and len(result.problems) >= max_rows:
            break
    if not result.problems:
        raise ValueError(f"{source}: no usable row (skipped: {dict(result.skipped) or 'none, the source is empty'}); "
                         f"columns found: {sorted(columns)}; the problem and answer columns are set by "
                         f"data.problem_key (now {problem_key!r}) and data.answer_key (now {answer_key!r})")
    if result.num_skipped:
        logger.warning("%s: skipped %d bad rows %s", source, result.num_skipped, dict(result.skipped))
    return result


def _to_problem(index: int, row: Any, problem_key: str, answer_key: str) -> tuple[Optional[Problem], str]:
    if row is INVALID_JSON:
        return None, "invalid JSON"
    if not isinstance(row, dict):
        return None, "not an object"
    problem, answer = row.get(problem_key), row.get(answer_key)
    if problem is None:
        return None, f"missing {problem_key!r}"
    if answer is None:
        return None, f"missing {answer_key!r}"
    if not isinstance(problem, str) or not problem.strip():
        return None, f"empty {problem_key!r}"
    answer_text = answer if isinstance(answer, str) else _scalar_text(answer)
    if answer_text is None or not answer_text.strip():
        return None, f"empty {answer_key!r}"
    return Problem(problem.strip(), answer_text.strip(), index, dict(row)), ""


def _scalar_text(value: Any) -> Optional[str]:
    """Numbers are valid answers (`"answer": 42`); lists, dicts and bools are not."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def read_rows(source: str, split: str) -> tuple[Iterable[tuple[int, Any]], set[str]]:
    """Every row of a data file, or of `split`'s files in a dataset folder (numbered on across files)."""
    path = Path(source)
    if path.is_dir():
        rows = []
        for file in local_split(path, split, source=source):
            rows += [(len(rows) + i, row) for i, (_, row) in enumerate(_file_rows(file))]
    elif path.is_file():
        rows = list(_file_rows(path))
    elif path.suffix.lower() in JSONL_SUFFIXES + PARQUET_SUFFIXES:
        raise FileNotFoundError(f"data file {source} does not exist (check data.train / data.val / eval.data)")
    else:
        raise FileNotFoundError(f"{source!r} is neither a data file (.jsonl / .json / .parquet), a dataset folder nor "
                                "a hub id (org/name[@revision]) resolved before the run: check data.train / data.val "
                                "/ eval.data")
    columns = {k for _, r in rows[:100] if isinstance(r, dict) for k in r}
    return rows, columns


def _file_rows(path: Path) -> list[tuple[int, Any]]:
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        array = _json_array(path) if suffix == ".json" else None
        return list(enumerate(array)) if array is not None else list(_jsonl_rows(path))
    if suffix in PARQUET_SUFFIXES:
        return list(enumerate(_parquet_rows(path)))
    raise ValueError(f"{path}: unknown data format {path.suffix!r}; use .jsonl (one JSON object per line), .json or "
                     ".parquet")


def _json_array(path: Path) -> Optional[list]:
    """The rows of a .json file holding one array (how some hub datasets ship, e.g. DeepScaleR's deepscaler.json);
    None for a file of one row per line (jsonl under a .json name, even one whose first line is a list)."""
    text = path.read_text(encoding="utf-8")
    if not text.lstrip("\ufeff \t\r\n").startswith("["):
        return None
    try:
        array = json.loads(text)
    except json.JSONDecodeError:
        return None
    return array if isinstance(array, list) else None


def _jsonl_rows(path: Path) -> Iterator[tuple[int, Any]]:
    with path.open(encoding="utf-8") as f:
        for index, line in enumerate(f):
            if not line.strip():
                continue
            try:
                yield index, json.loads(line)
            except json.JSONDecodeError:
                yield index, INVALID_JSON


def _parquet_rows(path: Path) -> list[dict]:
    try:
        import pyarrow.parquet as pq
    except ImportError as err:
        raise ImportError(f"reading {path} needs pyarrow (pip install pyarrow), or convert it to jsonl") from err
    return pq.read_table(path).to_pylist()
