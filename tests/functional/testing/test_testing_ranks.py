"""`mrl.testing.distributed.run_on_ranks`, the runner of every multi-process test: results come back in rank order,
a rank leaves nothing running behind it, a failing or late rank is named with its output, and a rank forked from a
warm zygote (`mrl.testing.zygote`) is as fresh as a started one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from mrl.testing import zygote
from mrl.testing.distributed import DistributedRunError, run_on_ranks, still_running


# ---- rank side ----
_queues = []


def start_a_manager() -> tuple[int, int]:
    """Start a multiprocessing manager server as Megatron's asynchronous checkpointing does: a spawned process
    whose queue a module global keeps alive."""
    import multiprocessing

    manager = multiprocessing.get_context("spawn").Manager()
    _queues.append(manager.Queue())
    return int(os.environ["RANK"]), manager._process.pid


def describe_and_leave_a_mark() -> dict:
    """What a rank sees of its process, then changes the process (what a next run must not see)."""
    import torch

    seen = dict(rank=int(os.environ["RANK"]), pid=os.getpid(), parent=os.getppid(), hash=hash("mrl rank"),
                mark=os.environ.get("MRL_TEST_MARK"), torch_mark=getattr(torch, "_mrl_test_mark", None),
                threads=torch.get_num_threads(), megatron_loaded="megatron.core" in sys.modules,
                extra=os.environ.get("MRL_TEST_EXTRA"))
    os.environ["MRL_TEST_MARK"] = "left"
    torch._mrl_test_mark = "left"
    torch.manual_seed(1234)
    return seen


def fail_on_rank_1() -> None:
    if os.environ["RANK"] == "1":
        print("rank 1 says why", flush=True)
        raise ValueError("the failure of rank 1")
    time.sleep(60)


def sleep_past_the_deadline(folder: str) -> None:
    with open(os.path.join(folder, f"rank{os.environ['RANK']}.pid"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(60)


# ---- tests ----
def _environment_set_by(code: str) -> dict[str, str]:
    """The variables that running `code` adds or changes in a fresh Python process started from the zygotes' view of
    this environment (without what earlier tests' imports may already have put there)."""
    script = f"import json, os\nbefore = dict(os.environ)\n{code}\n" + (
        "print(json.dumps({k: v for k, v in os.environ.items() if before.get(k) != v}))"
    )
    env = zygote._comparable(dict(os.environ))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture
def own_zygotes(monkeypatch):
    """Zygotes of this test's own, started from the environment as it is now; stopped after it."""
    monkeypatch.setattr(zygote, "_zygotes", {})
    yield
    zygote._close_all()


def test_forked_ranks_are_fresh_processes_and_a_changed_environment_starts_them(own_zygotes, monkeypatch):
    """The zygotes' ranks: children of a process other than the test's, each rank index its own hash seed, one
    thread (OMP_NUM_THREADS=1 as started ranks), megatron-core already imported; nothing a run changed in its process
    reaches the next run. What importing vLLM, inductor's cache folder and `ray.init` put into the test process's
    environment does not stop the forks; another variable does: the run starts its ranks (the test process is their
    parent), which see it."""
    first = run_on_ranks(describe_and_leave_a_mark, world_size=2)
    second = run_on_ranks(describe_and_leave_a_mark, world_size=2)
    for run in (first, second):
        assert [seen["rank"] for seen in run] == [0, 1]
        assert all(seen["parent"] != os.getpid() and seen["megatron_loaded"] for seen in run)
        assert all(seen["mark"] is None and seen["torch_mark"] is None and seen["threads"] == 1 for seen in run)
        assert run[0]["hash"] != run[1]["hash"]
    assert {seen["pid"] for seen in first}.isdisjoint(seen["pid"] for seen in second)
    assert [seen["parent"] for seen in first] == [seen["parent"] for seen in second]  # the same zygote per rank

    set_along_the_way = _environment_set_by(
        "import vllm\nfrom torch._inductor.runtime.cache_dir_utils import cache_dir\ncache_dir()"
    )
    assert "TORCHINDUCTOR_CACHE_DIR" in set_along_the_way
    set_along_the_way.update(PYTHONBREAKPOINT="ray.util.rpdb.set_trace", RAY_worker_niceness="0")  # `ray.init`'s
    for key, value in set_along_the_way.items():
        monkeypatch.setenv(key, value + "-changed" if key in os.environ and os.environ[key] == value else value)
    later = run_on_ranks(describe_and_leave_a_mark, world_size=2)
    assert [seen["parent"] for seen in later] == [seen["parent"] for seen in first]

    monkeypatch.setenv("MRL_TEST_EXTRA", "set by the test")
    started = run_on_ranks(describe_and_leave_a_mark, world_size=2)
    assert all(seen["parent"] == os.getpid() and seen["extra"] == "set by the test" for seen in started)


def test_a_failing_rank_is_named_with_its_output_and_the_others_are_stopped():
    with pytest.raises(DistributedRunError, match="rank 1 exited with code 1") as error:
        run_on_ranks(fail_on_rank_1, world_size=2, timeout_s=60)
    assert "rank 1 says why" in str(error.value) and "ValueError: the failure of rank 1" in str(error.value)


def test_ranks_past_the_deadline_are_killed_and_their_output_shown(tmp_path):
    start = time.monotonic()
    with pytest.raises(DistributedRunError, match="ranks still running after 10 s") as error:
        run_on_ranks(sleep_past_the_deadline, world_size=2, args=(str(tmp_path),), timeout_s=10)
    assert time.monotonic() - start < 40 and "rank 1 stderr" in str(error.value)
    pids = [int((tmp_path / f"rank{rank}.pid").read_text()) for rank in range(2)]
    assert still_running(pids, timeout_s=5) == []
def test_a_rank_stops_its_child_processes_before_it_exits():
    results = run_on_ranks(start_a_manager, world_size=2)
    assert [rank for rank, _ in results] == [0, 1]
    servers = [pid for _, pid in results]
    assert still_running(servers) == []
