"""Run a Python function on N local ranks, torchrun-style, and collect each rank's return value (for tests).

    results = run_on_ranks(my_check, world_size=2, args=(tmp_path,))   # [rank0_result, rank1_result]

Each rank is a fresh `python -m mrl.testing.distributed` process with the torchrun environment contract
(RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT on a free port) and
OMP_NUM_THREADS=1 (the test machines have 2 cores: more threads per rank make a tiny step ~40x slower) and the
workers' malloc settings (`mrl.distributed.env.ALLOCATOR_ENVIRONMENT`).
The worker imports the function from its source file (so test modules that are not packages work), calls
`fn(*args, **kwargs)`, pickles the return value and exits (after a barrier, when a process group is still up:
`_leave`). Process groups are the function's business: it calls
`torch.distributed.init_process_group` (env:// reads the variables above), e.g. via
`mrl.parallel.groups.init_process_groups`.

If a rank fails or the run exceeds `timeout_s`, every rank is killed and `DistributedRunError` carries the
failing rank's stderr tail, so a test failure shows the real traceback rather than a hang.
"""

from __future__ import annotations

import importlib.util
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
from mrl.parallel.groups import free_port

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


def _wait_all(procs: list[subprocess.Popen], logs: list[Path], timeout_s: float) -> None:
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
        procs, logs = [], []
        for rank in range(world_size):
            log = work / f"rank{rank}.stderr"
            logs.append(log)
            with open(log, "wb") as stderr:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "mrl.testing.distributed", str(work), str(rank)],
                        env=_rank_env(rank, world_size, port, env),
                        stdout=stderr,
                        stderr=subprocess.STDOUT,
                    )
                )
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


def _load_function(source: str, qualname: str) -> Callable[..., Any]:
    spec = importlib.util.spec_from_file_location(f"_mrl_rank_target_{Path(source).stem}", source)
    assert spec is not None and spec.loader is not None, f"cannot import {source}"
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    target: Any = module
    for part in qualname.split("."):
        target = getattr(target, part)
    return target


def _worker_main(workdir: str, rank: str) -> None:
    work = Path(workdir)
    source, qualname, args, kwargs = pickle.loads((work / "call.pkl").read_bytes())
    result = _load_function(source, qualname)(*args, **kwargs)
    (work / f"rank{rank}.result.pkl").write_bytes(pickle.dumps(result))
    _leave()


def _leave() -> None:
    """End a rank whose result is written: the ranks leave their process group together, and the process exits
    without the interpreter's teardown. Left to the teardown, a gloo group's threads could meet a peer that had
    already exited and abort the rank ("terminate called without an active exception", seen under load).
    Skipping the teardown skips multiprocessing's too, which would stop the rank's child processes (the manager
    servers Megatron's checkpointing starts): they are stopped here, or each would outlive the test (~300 MB)."""
    import multiprocessing

    from mrl.parallel import collectives
    from mrl.parallel.groups import destroy_process_groups

    if collectives.is_initialized():
        collectives.barrier()
        destroy_process_groups()
    for child in multiprocessing.active_children():
        child.terminate()
        child.join(timeout=5)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    _worker_main(sys.argv[1], sys.argv[2])
