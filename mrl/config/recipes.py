"""The files that ship inside the package: the recipes (`recipes/*.yaml`) and the Slurm launcher (`slurm/`).

In the checkout `mrl/_shipped/recipes` and `mrl/_shipped/slurm` are symlinks to `recipes/` and `slurm/`; the wheel
holds real copies there (pyproject.toml, `[tool.setuptools.package-data]`). So one path serves a checkout, an editable
install and `pip install mrl-*.whl` alike.

A config path names a file; where none exists, a bare name (`arith-tiny-cpu`, `arith-tiny-cpu.yaml`, or the
checkout-relative `recipes/arith-tiny-cpu.yaml` that the docs write) is the shipped recipe of that name. An existing
file always wins. A staged recipe's `config:` files and a recipe's `defaults:` resolve relative to the recipe, so
they are found next to a shipped one.
"""

from __future__ import annotations

from pathlib import Path

from mrl.config.errors import ConfigError

SHIPPED = Path(__file__).resolve().parents[1] / "_shipped"
RECIPES = SHIPPED / "recipes"
SLURM_LAUNCHER = SHIPPED / "slurm" / "ray-sbatch.sh"


def shipped_recipes() -> list[str]:
    """The names of the shipped recipes (file names without .yaml), sorted."""
    return sorted(p.stem for p in RECIPES.glob("*.yaml"))


def find_recipe(path: str | Path) -> Path:
    """The config file `path` names: the file itself when it exists, else the shipped recipe of that name (see the
    module docstring); a ConfigError naming the file, the shipped recipes and the fix when neither exists."""
    given = Path(path)
    if given.is_file():
        return given
    name = _shipped_name(given)
    if name is not None:
        for candidate in (RECIPES / name, RECIPES / f"{name}.yaml"):
            if candidate.is_file():
                return candidate.resolve()
    raise ConfigError(
        f"config file {'is a folder, not a config file' if given.is_dir() else 'not found'}: {given.resolve()}",
        given=str(path),
        allowed="a YAML file, or a shipped recipe by name: " + ", ".join(shipped_recipes()),
        fix="check the path, or name a shipped recipe (e.g. arith-tiny-cpu)",
    )


def _shipped_name(given: Path) -> str | None:
    """The recipe name a path can stand for: a bare file name, or one under a relative `recipes/`; else None."""
    parent = given.parent.as_posix()
    return given.name if parent in (".", "recipes") and given.name else None
