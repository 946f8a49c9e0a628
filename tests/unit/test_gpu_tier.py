"""The GPU tier's runner (mrl/testing/gpu_tier.py) where there is no GPU: it skips in one line with exit 0, its pin
file parses, and it installs only what a machine lacks or holds out of range."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mrl.testing import gpu_tier

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]


def test_without_cuda_the_runner_skips_in_one_line_and_exits_0(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mrl.testing.gpu_tier", "run", "--wheels", str(tmp_path),
                           "--report", str(tmp_path / "r.json")], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [done.stdout.strip()] and done.stdout.startswith("GPU tier: skipped: no CUDA")
    assert not (tmp_path / "r.json").exists()


def test_the_pins_parse_and_torch_is_the_machines_own():
    pins = {p.name: p for p in gpu_tier.read_pins()}
    assert pins["torch"].source == "machine" and "2.11" in pins["torch"].accepted
    assert pins["megatron-core"].version == "0.16.1" and pins["antlr4-python3-runtime"].source == "build"


def test_a_pin_is_installed_only_where_missing_or_out_of_range(monkeypatch):
    held = {"megatron-core": "0.16.1", "transformers": "5.17.0", "pydantic": "1.10.0"}

    def version(name):
        if name not in held:
            raise gpu_tier.metadata.PackageNotFoundError(name)
        return held[name]

    monkeypatch.setattr(gpu_tier.metadata, "version", version)
    pins = [gpu_tier.Pin("megatron-core", "0.16.1", "==0.16.1", "download"),
            gpu_tier.Pin("transformers", "5.19.0", ">=5.16.1,<5.20", "download"),
            gpu_tier.Pin("pydantic", "2.14.3", ">=2.7,<3", "download"),
            gpu_tier.Pin("omegaconf", "2.3.1", ">=2.3,<2.4", "download"),
            gpu_tier.Pin("torch", "2.13.0", ">=2.11,<2.14", "machine")]
    assert [(p.name, have) for p, have in gpu_tier.missing(pins)] == [("pydantic", "1.10.0"), ("omegaconf", None)]


def test_a_malformed_pin_line_names_the_file_and_line(tmp_path):
    bad = tmp_path / "pins.txt"
    bad.write_text("# fine\nmegatron-core 0.16.1 download\n")
    with pytest.raises(ValueError, match=r"pins.txt:2: .*expected 'name==version accepted"):
        gpu_tier.read_pins(bad)
