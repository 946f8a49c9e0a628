"""A real one-node Slurm for the launcher tests (marker `slurm`, `make test-slurm`): slurm-wlm is installed with
apt-get when missing (as root), slurmctld and slurmd start on loopback with a configuration written into a scratch
folder, and both are stopped by their pid files at the end. Without root, or where slurm-wlm cannot be installed,
every test skips with one line saying why."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def _install_slurm() -> str:
    """'' when the Slurm daemons are there (installed now if need be), else why not."""
    if shutil.which("slurmctld") and shutil.which("sbatch"):
        return ""
    if os.geteuid() != 0:
        return "slurm-wlm is not installed and installing it needs root"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for command in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "slurm-wlm"]):
        done = subprocess.run(command, capture_output=True, text=True, env=env)
        if done.returncode and command[1] == "install":
            return f"apt-get install slurm-wlm failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}"
    return "" if shutil.which("slurmctld") else "slurm-wlm installed no slurmctld"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_config(folder: Path) -> Path:
    import psutil

    for sub in ("state", "spool", "log"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    text = (HERE / "slurm.conf.template").read_text().format(
        host=socket.gethostname().split(".")[0], dir=folder, ctld_port=_free_port(), slurmd_port=_free_port(),
        cpus=os.cpu_count(), memory_mb=int(psutil.virtual_memory().total / 2**20 * 0.8))
    conf = folder / "slurm.conf"
    conf.write_text(text)
    return conf


def _stop(folder: Path) -> None:
    for name in ("slurmd.pid", "slurmctld.pid"):
        pid_file = folder / name
        if pid_file.is_file():
            try:
                os.kill(int(pid_file.read_text().strip()), signal.SIGTERM)
            except (ProcessLookupError, ValueError):
                pass


@pytest.fixture(scope="session")
def slurm(tmp_path_factory) -> dict[str, str]:
    """The environment (SLURM_CONF) of a running one-node cluster whose node is idle."""
    why = _install_slurm()
    if why:
        pytest.skip(f"no Slurm here: {why}")
    folder = tmp_path_factory.mktemp("slurm")
    env = dict(os.environ, SLURM_CONF=str(_write_config(folder)))
    for daemon in ("slurmctld", "slurmd"):
        subprocess.run([daemon, "-f", env["SLURM_CONF"]], check=True, env=env)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            state = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, env=env).stdout
            if state.strip() == "idle":
                break
            time.sleep(0.5)
        else:
            log = (folder / "log" / "slurmctld.log").read_text()[-2000:]
            pytest.fail(f"the Slurm node did not become idle within 60 s:\n{log}")
        yield env
    finally:
        _stop(folder)
