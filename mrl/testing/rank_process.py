"""The rank side of `mrl.testing.distributed.run_on_ranks`: a rank process (started as
`python -m mrl.testing.rank_process WORKDIR RANK`, or forked from a zygote, `mrl.testing.zygote`) reads the call from
`WORKDIR/call.pkl`, imports the function from its source file (so test modules that are not packages work), calls it,
pickles the return value to `WORKDIR/rank<RANK>.result.pkl` and ends (`_leave`)."""

from __future__ import annotations

import importlib.util
import os
import pickle
import sys
from pathlib import Path
from typing import Any, Callable


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


def main(workdir: str, rank: str) -> None:
    """Run the call in `workdir` as rank `rank`, write its result and end the process (`_leave`)."""
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
    main(sys.argv[1], sys.argv[2])
