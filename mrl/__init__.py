"""mrl: RL post-training for LLMs on Megatron-Core, vLLM and Ray.

Importing mrl applies one workaround, here because it must come before anything imports transformers, in every
process mrl starts (the command's, Ray's workers, the ranks): `packages_distributions_from_records`."""

import collections
import csv
import importlib.metadata
import inspect

__version__ = "0.1.0"


def packages_distributions_from_records() -> dict[str, list[str]]:
    """`importlib.metadata.packages_distributions()` without a stat of every installed file.

    transformers calls that function when transformers/utils/import_utils.py is first imported, so in every process
    that imports transformers (directly or through vLLM, Megatron, datasets). For a distribution without a
    top_level.txt, Python 3.12's version infers the top-level names from `Distribution.files`, which checks that each
    file the RECORD lists exists: one stat per file of most of the environment (torch, vLLM, Ray: tens of thousands).
    Here the names are read from the RECORD alone, the same way; the answer differs only for a distribution whose
    RECORD names a top-level folder or module that was deleted after it was installed. tests/unit/test_startup.py
    checks it equals Python's answer on mrl's environment; docs/measurements.md has the time each process saves.
    Upstream: transformers reads the mapping at import (not lazily), Python's `_top_level_inferred` stats every file."""
    mapping: dict[str, list[str]] = collections.defaultdict(list)
    for dist in importlib.metadata.distributions():
        for name in _top_level_names(dist):
            mapping[name].append(dist.metadata["Name"])
    return dict(mapping)


def _top_level_names(dist: importlib.metadata.Distribution) -> set[str]:
    declared = (dist.read_text("top_level.txt") or "").split()
    if declared:
        return set(declared)
    record = dist.read_text("RECORD")
    if record is None:  # not a wheel's install (an egg's): the files as Python lists them
        paths = [str(path) for path in dist.files or ()]
    else:
        paths = [row[0] for row in csv.reader(record.splitlines()) if row]
    names = {_top_level(path) for path in paths}
    return {name for name in names if name is not None and "." not in name}


def _top_level(path: str) -> "str | None":
    """What Python takes from one listed file: its first folder, else its module name (None for a file that is not a
    module), as `PurePosixPath(path).parts` would split it."""
    parts = [part for part in path.split("/") if part not in ("", ".")]
    if path.startswith("/"):
        parts.insert(0, "/")
    return parts[0] if len(parts) > 1 else inspect.getmodulename(path)


python_packages_distributions = importlib.metadata.packages_distributions
"""Python's own, kept for the test that compares the two."""
importlib.metadata.packages_distributions = packages_distributions_from_records
