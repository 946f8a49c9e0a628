"""A config path that names no file is the shipped recipe of that name; an existing file always wins."""

from pathlib import Path

import pytest

from mrl.config import ConfigError, load_config
from mrl.config.recipes import RECIPES, SLURM_LAUNCHER, find_recipe, shipped_recipes

ROOT = Path(__file__).resolve().parents[3]


def test_the_shipped_files_are_the_checkouts():
    assert RECIPES.resolve() == ROOT / "recipes" and SLURM_LAUNCHER.resolve() == ROOT / "slurm" / "ray-sbatch.sh"
    assert shipped_recipes() == sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml"))


def test_a_name_finds_the_shipped_recipe(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    want = ROOT / "recipes" / "arith-tiny-cpu.yaml"
    for name in ("arith-tiny-cpu", "arith-tiny-cpu.yaml", "recipes/arith-tiny-cpu.yaml"):
        assert find_recipe(name) == want, name
    cfg = load_config("arith-tiny-moe-cpu")
    assert (cfg.run.name, cfg.policy.optimizer.lr) == ("arith-tiny-moe-cpu", 3.0e-3)  # its `defaults:` beside it


def test_an_existing_file_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "arith-tiny-cpu.yaml").write_text("run: {name: mine}\n")
    assert find_recipe("arith-tiny-cpu.yaml") == Path("arith-tiny-cpu.yaml")
    assert load_config("arith-tiny-cpu.yaml").run.name == "mine"


def test_a_missing_file_names_itself_the_shipped_recipes_and_the_fix(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as err:
        load_config("arith-tiny-gpu.yaml")
    text = err.value.render()
    assert f"config file not found: {tmp_path / 'arith-tiny-gpu.yaml'}" in text
    assert "arith-tiny-cpu, arith-tiny-moe-cpu" in text and "fix: check the path" in text
    with pytest.raises(ConfigError, match="config file not found"):  # a path with a folder is never a shipped name
        find_recipe(tmp_path / "arith-tiny-cpu.yaml")
