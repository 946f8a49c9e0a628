"""Warm rank processes for `run_on_ranks`: per rank index, a zygote process that imported torch, megatron-core and
transformers once, and forks a fresh rank process for each run instead of starting Python again.

    test process --request (workdir, rank, environment, cwd, log)--> zygote of that rank index
    zygote --fork--> rank process: the log as its stdout and stderr, the run's environment, then the same
                     `mrl.testing.rank_process.main` a started rank runs
    zygote --its pid--> test process, which polls it like a started process (`RankProcess`)
    zygote: reaps its children, writing each one's exit status to `<workdir>/rank<r>.exit`

Importing megatron-core is most of a rank's start on the test machines (it imports torch's inductor and distributed
tensors); every multi-process test paid it once per rank per run. A forked rank is still a fresh process for the
run: nothing ran in its zygote but imports (one thread, no process group, no patch applied, no state of mrl's), and
each rank index has a zygote of its own, started with its own random hash seed, so two ranks still order sets of
strings differently, as processes started apart do.

A zygote serves only runs whose environment is the one it started with, apart from variables read where they are
used (the rank's own, pytest's, Ray's, vLLM's: `_READ_WHEN_USED`): a variable a library reads when the process
starts (OMP_NUM_THREADS, malloc's, MRL_CPU_ISA's import hook) needs a process started with it, so `start_rank`
answers None and the caller starts the rank itself. MRL_RANK_ZYGOTE_LOG=FILE appends to FILE which variables made
a run start its ranks; MRL_RANK_ZYGOTE=0 turns the zygotes off. Where a CUDA device is visible the zygotes decline
(torch refuses CUDA in a process forked after CUDA was queried, which importing megatron-core does) and every rank
is started.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

#: What a zygote imports before it forks: the bulk of every rank's imports, none of which changes global state that
#: a run could see (the CPU patches are applied by the rank, in `init_process_groups`).
PRELOAD = ("torch", "megatron.core", "megatron.core.models.hybrid.hybrid_model", "transformers")

#: Variables that differ from run to run and that no library reads when a process starts.
_PER_RUN = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
#: Variables the test process sets along the way that a fork may take from the run's environment: read where they
#: are used, after the fork, or deciding nothing a test checks. `ray.init` sets PYTHONBREAKPOINT (read by each
#: `breakpoint()`) and RAY_* (read by Ray's import); importing vLLM sets TORCHINDUCTOR_COMPILE_THREADS (how many
#: processes compile, read when inductor's config is imported: the zygote's default stands), the CUDA check's
#: PYTORCH_NVML_BASED_CUDA_CHECK (read by each check), TRITON_* and TILELANG_* (GPU compilers); torch's inductor
#: writes its cache folder's default into TORCHINDUCTOR_CACHE_DIR the first time it asks for it and reads it each
#: time; vLLM reads VLLM_* when asked; gloo its interface when a group is made; pytest's change with every test.
#: OpenCV's import (through vLLM's) puts its own library folder in front of LD_LIBRARY_PATH "for sub-processes":
#: the dynamic linker reads the variable when a process starts, but a rank loads no OpenCV library.
_READ_WHEN_USED = (
    *_PER_RUN,
    "LD_LIBRARY_PATH",
    "PYTHONBREAKPOINT",
    "GLOO_SOCKET_IFNAME",
    "TORCHINDUCTOR_CACHE_DIR",
    "TORCHINDUCTOR_COMPILE_THREADS",
    "PYTORCH_NVML_BASED_CUDA_CHECK",
)
_READ_WHEN_USED_PREFIXES = ("PYTEST_", "RAY_", "VLLM_", "TRITON_", "TILELANG_")

_START_TIMEOUT_S = 180.0


def _comparable(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in _READ_WHEN_USED and not k.startswith(_READ_WHEN_USED_PREFIXES)}


def enabled() -> bool:
    return os.environ.get("MRL_RANK_ZYGOTE", "1") != "0"


# ------------------------------------------------------------------------------------------------- test side
class RankProcess:
    """A forked rank seen from the test process, with the part of `subprocess.Popen` that `run_on_ranks` uses."""

    def __init__(self, pid: int, exit_file: Path) -> None:
        self.pid, self.exit_file = pid, exit_file
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and self.exit_file.exists():
            self.returncode = int(self.exit_file.read_text())
        elif self.returncode is None and not Path(f"/proc/{self.pid}").exists():
            time.sleep(0.2)  # reaped, its status being written; or its zygote died and nothing will write it
            if self.exit_file.exists():
                return self.poll()
            self.returncode = -signal.SIGKILL
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def wait(self) -> int:
        while self.poll() is None:
            time.sleep(0.02)
        assert self.returncode is not None
        return self.returncode


class _Zygote:
    def __init__(self, env: dict[str, str]) -> None:
        self.env, self.owner = _comparable(env), os.getpid()
        self.stderr = tempfile.NamedTemporaryFile(prefix="mrl_zygote_", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mrl.testing.zygote"],
            env=self.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
        )
        self.ready: bool | None = None  # None until its first answer
        self.refusal = ""  # its reason, where it declined to serve

    def _wait_ready(self) -> bool:
        if self.ready is None:
            assert self.proc.stdout is not None
            readable, _, _ = select.select([self.proc.stdout], [], [], _START_TIMEOUT_S)
            answer = self.proc.stdout.readline() if readable else b""
            self.ready = answer == b"ready\n"
            if answer.startswith(b"declined: "):  # it cannot serve this machine: ranks start as processes
                self.refusal = answer.decode().strip()
                self.proc.wait()
            elif not self.ready:
                self.proc.kill()
                tail = Path(self.stderr.name).read_text(errors="replace")[-2000:]
                print(
                    f"mrl.testing.zygote: a rank zygote did not start; ranks start as processes. Its output:\n{tail}",
                    file=sys.stderr,
                )
        return self.ready

    def fork(self, request: dict[str, Any]) -> int | None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if not self._wait_ready() or self.proc.poll() is not None:
            return None
        try:
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except OSError:
            return None
        return int(line) if line.strip().isdigit() else None

    def close(self) -> None:
        if os.getpid() != self.owner:
            return  # a process forked from the test process: the zygote is not its own
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()  # the zygote ends at the end of its input
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
        self.stderr.close()
        os.unlink(self.stderr.name)


_zygotes: dict[int, _Zygote] = {}


def start_rank(work: Path, rank: int, env: dict[str, str], log: Path) -> RankProcess | None:
    """Fork rank `rank` of the run in `work` from its zygote; None where the zygotes are off, the environment is not
    the zygote's or the zygote cannot fork (the caller starts the rank itself). The first run starts the zygotes of
    all its ranks, side by side."""
    if not enabled():
        return None
    for index in range(int(env["WORLD_SIZE"])):
        if index not in _zygotes:
            _zygotes[index] = _Zygote(env)
    zygote = _zygotes[rank]
    if zygote.env != _comparable(env):
        _log_start(rank, f"the environment differs from the zygote's in {_differing(env, zygote.env)}")
        return None
    exit_file = work / f"rank{rank}.exit"
    pid = zygote.fork(dict(work=str(work), rank=rank, env=env, cwd=os.getcwd(), log=str(log), exit_file=str(exit_file)))
    if pid is None:
        _log_start(rank, f"its zygote could not fork it{': ' + zygote.refusal if zygote.refusal else ''}")
        return None
    return RankProcess(pid, exit_file)


def _log_start(rank: int, why: str) -> None:
    """With MRL_RANK_ZYGOTE_LOG=FILE, append why a rank is started rather than forked."""
    path = os.environ.get("MRL_RANK_ZYGOTE_LOG")
    if path:
        with open(path, "a") as f:
            f.write(f"{os.environ.get('PYTEST_CURRENT_TEST')} rank {rank}: started, {why}\n")


def _differing(env: dict[str, str], zygote_env: dict[str, str]) -> list[str]:
    run_env = _comparable(env)
    return sorted(k for k in run_env.keys() | zygote_env.keys() if run_env.get(k) != zygote_env.get(k))


@atexit.register
def _close_all() -> None:
    for zygote in _zygotes.values():
        zygote.close()
    _zygotes.clear()


# ------------------------------------------------------------------------------------------------- zygote side
def _run_child(request: dict[str, Any]) -> None:
    """In the forked child: become the rank process of the request; never returns."""
    code = 1
    try:
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        from mrl.testing import rank_process

        sys.argv = [rank_process.__file__, request["work"], str(request["rank"])]
        rank_process.main(request["work"], str(request["rank"]))  # ends the process
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 a rank's failure is its traceback in the log and exit status 1
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _reap(children: dict[int, str]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        exit_file = children.pop(pid, None)
        if exit_file is not None:
            partial = exit_file + ".partial"
            Path(partial).write_text(str(os.waitstatus_to_exitcode(status)))
            os.replace(partial, exit_file)


def serve() -> None:
    out = sys.stdout.buffer
    import torch

    if torch.cuda.is_available():  # after it, a forked child cannot initialise CUDA (torch's fork poisoning)
        out.write(b"declined: a CUDA device is visible, and a forked process cannot use CUDA\n")
        out.flush()
        return  # before the imports it would have spent seconds on
    for module in PRELOAD:
        importlib.import_module(module)
    gc.collect()
    gc.freeze()  # the imports' objects stay out of the children's collections (which would copy their pages)
    out.write(b"ready\n")
    out.flush()
    children: dict[int, str] = {}
    pending = b""
    while True:
        readable, _, _ = select.select([0], [], [], 0.05)
        _reap(children)
        if not readable:
            continue
        chunk = os.read(0, 1 << 16)
        if not chunk:
            return  # the test process is done (or gone): ranks still running finish on their own
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                _run_child(request)
            children[pid] = request["exit_file"]
            out.write(f"{pid}\n".encode())
            out.flush()


if __name__ == "__main__":
    serve()
