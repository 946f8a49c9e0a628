"""Real Slurm clusters for the launcher tests (marker `slurm`, `make test-slurm`): slurm-wlm is installed with
apt-get when missing (as root); slurmctld and slurmd start with a configuration written into a scratch folder, on
loopback (one node) or with a second node in a network namespace (two nodes), and are stopped by their pid files
at the end. Without root, or where slurm-wlm cannot be installed, every test skips with one line saying why."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from mrl.parallel.ports import free_port

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


HOST = socket.gethostname().split(".")[0]
SECOND = "mrl-node2"  # host name of the second node (in its own UTS and network namespaces)


def _write_config(folder: Path, nodes: dict[str, str]) -> Path:
    """slurm.conf for `nodes` (name -> address); the controller runs on the first, each node gets an equal share
    of this machine's cores and memory."""
    import psutil

    for sub in ("state", "log"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    cpus = max(1, (os.cpu_count() or 1) // len(nodes))
    memory_mb = int(psutil.virtual_memory().total / 2**20 * 0.8 / len(nodes))
    lines = [f"NodeName={name} NodeAddr={address} CPUs={cpus} RealMemory={memory_mb} State=UNKNOWN"
             for name, address in nodes.items()]
    text = (HERE / "slurm.conf.template").read_text().format(
        host=HOST, controller_address=nodes[HOST], dir=folder, ctld_port=free_port(), slurmd_port=free_port(),
        node_lines="\n".join(lines), node_names=",".join(nodes))
    conf = folder / "slurm.conf"
    conf.write_text(text)
    return conf


def _stop(folder: Path) -> None:
    for pid_file in [*folder.glob("slurmd-*.pid"), folder / "slurmctld.pid"]:
        try:
            os.kill(int(pid_file.read_text().strip()), signal.SIGTERM)
        except (FileNotFoundError, ProcessLookupError, ValueError):
            pass


def _wait_idle(env: dict[str, str], folder: Path, count: int) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        states = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True, env=env).stdout
        if states.split() == ["idle"] * count:
            return
        time.sleep(0.5)
    log = (folder / "log" / "slurmctld.log").read_text()[-2000:]
    pytest.fail(f"the Slurm nodes did not become idle within 60 s:\n{log}")


@pytest.fixture(scope="session")
def slurm(tmp_path_factory) -> dict[str, str]:
    """The environment (SLURM_CONF) of a running one-node cluster whose node is idle."""
    why = _install_slurm()
    if why:
        pytest.skip(f"no Slurm here: {why}")
    folder = tmp_path_factory.mktemp("slurm")
    env = dict(os.environ, SLURM_CONF=str(_write_config(folder, {HOST: "127.0.0.1"})))
    try:
        subprocess.run(["slurmctld", "-f", env["SLURM_CONF"]], check=True, env=env)
        subprocess.run(["slurmd", "-f", env["SLURM_CONF"], "-N", HOST], check=True, env=env)
        _wait_idle(env, folder, 1)
        yield env
    finally:
        _stop(folder)


def _run(*command: str) -> None:
    subprocess.run(command, check=True, capture_output=True)


@pytest.fixture(scope="session")
def two_node_slurm(tmp_path_factory) -> dict[str, str]:
    """Two nodes on this machine: this one, and a second slurmd in a network namespace of its own (own address
    over a veth pair, own host name via a UTS namespace; same files). Its environment also moves the launcher's Ray
    ports (MRL_RAY_PORT) off the one-node cluster's."""
    why = _install_slurm() or ("" if shutil.which("ip") and shutil.which("nsenter") and shutil.which("unshare")
                               else "iproute2 / util-linux (ip, nsenter, unshare) are missing")
    if why:
        pytest.skip(f"no two-node Slurm here: {why}")
    tag = os.getpid() % 200 + 10
    netns, host_if, node_if = f"mrl{tag}", f"mrl{tag}h", f"mrl{tag}n"
    host_ip, node_ip = f"10.211.{tag}.1", f"10.211.{tag}.2"
    folder = tmp_path_factory.mktemp("slurm2")
    network = [["ip", "netns", "add", netns],
               ["ip", "link", "add", host_if, "type", "veth", "peer", "name", node_if],
               ["ip", "link", "set", node_if, "netns", netns],
               ["ip", "addr", "add", f"{host_ip}/24", "dev", host_if],
               ["ip", "link", "set", host_if, "up"],
               ["ip", "-n", netns, "addr", "add", f"{node_ip}/24", "dev", node_if],
               ["ip", "-n", netns, "link", "set", node_if, "up"],
               ["ip", "-n", netns, "link", "set", "lo", "up"]]
    try:
        for command in network:
            _run(*command)
    except (subprocess.CalledProcessError, OSError) as exc:
        subprocess.run(["ip", "netns", "del", netns], capture_output=True)
        pytest.skip(f"no two-node Slurm here: cannot make a network namespace ({exc})")
    conf = _write_config(folder, {HOST: host_ip, SECOND: node_ip})
    env = dict(os.environ, SLURM_CONF=str(conf), MRL_RAY_PORT="7379")
    try:
        _run("slurmctld", "-f", str(conf))
        _run("slurmd", "-f", str(conf), "-N", HOST)
        _run("nsenter", f"--net=/var/run/netns/{netns}", "unshare", "--uts", "sh", "-c",
             f"hostname {SECOND} && slurmd -f {conf} -N {SECOND}")
        _wait_idle(env, folder, 2)
        yield env
    finally:
        _stop(folder)
        subprocess.run(["ip", "link", "del", host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", netns], capture_output=True)
