"""requirements/find_python.sh, which picks the Python 3.12 that make install, the NeMo Gym venv and the GPU lock's
resolver are made with: it runs each candidate and takes the first that is 3.12 (a name alone proves nothing), prints
that interpreter's own path, and prints nothing with exit 1 where none is 3.12. Candidates here are small shell
scripts standing in for interpreters, on a PATH of their own, with pyenv out of reach (HOME elsewhere)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "requirements" / "find_python.sh"


def fake_python(folder: Path, name: str, version: tuple[int, int]) -> Path:
    """A script that answers find_python.sh's two questions as a Python of `version` installed at its own path
    would: the version assertion (exit status) and `print(sys.executable)`."""
    path = folder / name
    ok = "0" if version == (3, 12) else "1"
    path.write_text(
        "#!/bin/sh\n"
        f'case "$2" in *sys.executable*) echo "{path}"; exit 0;; esac\n'
        f"exit {ok}\n"
    )
    path.chmod(0o755)
    return path


def find(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """find_python.sh with a PATH of the fakes in tmp_path/bin and the two tools it uses, no pyenv (HOME elsewhere)."""
    tools = tmp_path / "tools"
    if not tools.exists():
        tools.mkdir()
        for tool in ("ls", "sort"):
            (tools / tool).symlink_to(shutil.which(tool))
    env = {"PATH": f"{tmp_path / 'bin'}:{tools}", "HOME": str(tmp_path / "home")}
    return subprocess.run(["/bin/bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=60,
                          cwd=tmp_path)


def test_the_first_candidate_that_runs_as_3_12_is_printed(tmp_path):
    (tmp_path / "bin").mkdir()
    old = fake_python(tmp_path / "bin", "python3.11", (3, 11))
    fake_python(tmp_path / "bin", "python3.12", (3, 12))
    mine = fake_python(tmp_path, "my-python", (3, 12))
    chosen = find(tmp_path, str(old), str(mine))  # the user's choices first, in order; a 3.11 is passed over
    assert chosen.returncode == 0 and chosen.stdout.strip() == str(mine)
    on_path = find(tmp_path, "")  # nothing chosen: python3.12 on PATH
    assert on_path.returncode == 0 and on_path.stdout.strip() == str(tmp_path / "bin" / "python3.12")


def test_a_python3_that_is_3_12_is_found_and_without_one_nothing_is_printed_and_exit_1(tmp_path):
    (tmp_path / "bin").mkdir()
    fake_python(tmp_path / "bin", "python3", (3, 12))
    found = find(tmp_path)
    assert found.returncode == 0 and found.stdout.strip() == str(tmp_path / "bin" / "python3")
    fake_python(tmp_path / "bin", "python3", (3, 11))
    fake_python(tmp_path / "bin", "python3.12", (3, 11))  # a name that lies (pyenv's shim without 3.12 selected)
    none = find(tmp_path, str(tmp_path / "bin" / "python3"))
    assert none.returncode == 1 and none.stdout == ""
