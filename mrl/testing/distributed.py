"""Run a Python function on N local ranks, torchrun-style, and collect each rank's return value (for tests).

    results = run_on_ranks(my_check, world_size=2, args=(tmp_path,))   # [rank0_result, rank1_result]

Each rank is a fresh process, forked from a warm zygote that imported torch and megatron-core once
(`mrl.testing.zygote`) or, where none can serve the run, a `python -m mrl.testing.rank_process` process, with the
torchrun environment contract (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT on a free
port) and OMP_NUM_THREADS=1 (the test machines have 2 cores: more threads per rank make a tiny step ~40x slower) and the
workers' malloc settings (`mrl.distributed.env.ALLOCATOR_ENVIRONMENT`).
The rank (`mrl.testing.rank_process`) imports the function from its source file (so test modules that are not
packages work), calls `fn(*args, **kwargs)`, pickles the return value and exits (after a barrier, when a process group
is still up). Process groups are the function's business: it calls
`torch.distributed.init_process_group` (env:// reads the variables above), e.g. via
`mrl.parallel.groups.init_process_groups`.

If a rank fails or the run exceeds `timeout_s`, every rank is killed and `DistributedRunError` carries the
failing rank's stderr tail, so a test failure shows the real traceback rather than a hang.
"""

from __future__ import annotations

import inspect
import os
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from mrl.distributed.env import ALLOCATOR_ENVIRONMENT
from mrl.parallel.ports import free_port
from mrl.testing import zygote

_STDERR_TAIL_CHARS = 6000


class DistributedRunError(RuntimeError):
    """A rank exited non-zero (or the run timed out); the message holds that rank's stderr tail."""


def _rank_env(rank: int, world_size: int, port: int, extra: dict[str, str] | None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS=env.get("PYTHONWARNINGS", "ignore"),
        **ALLOCATOR_ENVIRONMENT,
    )
    env.update(extra or {})
    return env


def _tail(path: Path) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return text[-_STDERR_TAIL_CHARS:]


def _wait_all(procs: Sequence[subprocess.Popen | zygote.RankProcess], logs: list[Path], timeout_s: float) -> None:
    """Wait for every rank; on the first failure or the timeout kill the rest and raise."""
    deadline = time.monotonic() + timeout_s
    while True:
        codes = [p.poll() for p in procs]
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if failed or time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            for p in procs:
                p.wait()
            if failed:
                rank = failed[0]
                raise DistributedRunError(
                    f"rank {rank} exited with code {codes[rank]}; its stderr:\n{_tail(logs[rank])}"
                )
            tails = "\n".join(f"--- rank {r} stderr:\n{_tail(log)}" for r, log in enumerate(logs))
            raise DistributedRunError(f"ranks still running after {timeout_s:.0f} s (killed)\n{tails}")
        if all(c == 0 for c in codes):
            return
        time.sleep(0.05)


def _start_rank(work: Path, rank: int, env: dict[str, str], log: Path) -> subprocess.Popen | zygote.RankProcess:
    """Fork the rank from its warm zygote (`mrl.testing.zygote`), or start it where that cannot serve the run."""
    forked = zygote.start_rank(work, rank, env, log)
    if forked is not None:
        return forked
    with open(log, "wb") as stderr:
        return subprocess.Popen(
            [sys.executable, "-m", "mrl.testing.rank_process", str(work), str(rank)],
            env=env,
            stdout=stderr,
            stderr=subprocess.STDOUT,
        )


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int = 2,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    timeout_s: float = 180.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `world_size` ranks; return the per-rank results, rank order.

    `fn` must be a module-level function (it is imported by each rank from its source file); args, kwargs and
    the results must be picklable.
    """
    source = Path(inspect.getfile(fn)).resolve()
    with tempfile.TemporaryDirectory(prefix="mrl_ranks_") as workdir:
        work = Path(workdir)
        (work / "call.pkl").write_bytes(pickle.dumps((str(source), fn.__qualname__, tuple(args), kwargs or {})))
        port = free_port()
        procs: list[subprocess.Popen | zygote.RankProcess] = []
        logs = [work / f"rank{rank}.stderr" for rank in range(world_size)]
        for rank, log in enumerate(logs):
            procs.append(_start_rank(work, rank, _rank_env(rank, world_size, port, env), log))
        _wait_all(procs, logs, timeout_s)
        return [pickle.loads((work / f"rank{rank}.result.pkl").read_bytes()) for rank in range(world_size)]


def still_running(pids: Sequence[int], timeout_s: float = 10.0) -> list[int]:
    """The processes of `pids` still running after waiting up to `timeout_s` for them to exit (a zombie has exited:
    its parent has yet to reap it)."""
    deadline = time.monotonic() + timeout_s
    running = list(pids)
    while running and time.monotonic() < deadline:
        time.sleep(0.1)
        running = [pid for pid in running if _running(pid)]
    return running


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"
