"""mrl/parallel/collectives.py is the one way mrl talks to torch.distributed, and it puts tensors where the group's
backend takes them.

1. Reading the code: every use of torch.distributed in mrl/ and converters/ (imports, `torch.distributed.x`,
   `import_module("torch.distributed")`, torch._C._distributed_c10d) outside collectives.py and groups.py (which makes
   and destroys the groups) fails the test with its file:line. mrl/testing is not exempt: its one use, the ranks'
   leave (testing/rank_process.py `_leave`), goes through collectives and groups too.
2. Against a group that refuses host tensors the way NCCL does (tests/unit/parallel/nccl_standin.py: a backend
   registered for an accelerator device type alone, so torch's own dispatch raises "No backend type associated with
   device type cpu"; the docstring there names the torch source it mirrors): a direct torch.distributed call with a
   host tensor is refused, and the same calls through collectives succeed and hand host results back, over a
   world of one (tcp:// on a free port) and between two members (threads) so values travel.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCANNED = ("mrl", "converters")
ALLOWED = {"mrl/parallel/collectives.py", "mrl/parallel/groups.py"}
STANDIN = Path(__file__).with_name("nccl_standin.py")
REFUSAL = "No backend type associated with device type cpu"


# ------------------------------------------------------------------------------------------- reading the code
def _torch_names(tree: ast.AST) -> set[str]:
    """The names a module binds to the torch package (`import torch`, `import torch as t`)."""
    return {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
            for alias in node.names if alias.name == "torch"}


def _is_distributed(module: str) -> bool:
    return (module == "torch.distributed" or module.startswith("torch.distributed.")
            or module.startswith("torch._C._distributed"))


def torch_distributed_uses(source: str) -> list[tuple[int, str]]:
    """(line, what) of every use of torch.distributed in `source`."""
    tree = ast.parse(source)
    torch_names = _torch_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}") for a in node.names if _is_distributed(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [a.name for a in node.names]
            if _is_distributed(node.module) or (node.module in ("torch", "torch._C")
                                                and {"distributed", "_distributed_c10d"} & set(names)):
                found.append((node.lineno, f"from {node.module} import {', '.join(names)}"))
        elif isinstance(node, ast.Attribute) and node.attr in ("distributed", "_distributed_c10d"):
            if node.attr == "_distributed_c10d" or (isinstance(node.value, ast.Name) and node.value.id in torch_names):
                found.append((node.lineno, f"{ast.unparse(node)}"))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            name = ast.unparse(node.func).split(".")[-1]
            if name in ("import_module", "__import__") and _is_distributed(str(node.args[0].value)):
                found.append((node.lineno, ast.unparse(node)))
    return sorted(set(found))


def _sources() -> list[Path]:
    return sorted(p for folder in SCANNED for p in (ROOT / folder).rglob("*.py"))


def test_no_torch_distributed_outside_the_collectives_module():
    found = [f"{path.relative_to(ROOT)}:{line}: {what}" for path in _sources()
             if path.relative_to(ROOT).as_posix() not in ALLOWED
             for line, what in torch_distributed_uses(path.read_text())]
    assert not found, ("torch.distributed used outside mrl/parallel/collectives.py (collectives, rank and size "
                       "queries) and mrl/parallel/groups.py (making groups); go through them:\n" + "\n".join(found))


def test_the_scan_sees_every_form_and_nothing_else():
    sample = textwrap.dedent('''\
        """torch.distributed in a docstring is prose."""
        import importlib
        import torch
        import torch as t
        import torch.distributed as dist
        from torch.distributed import barrier
        from torch import distributed
        from torch.distributed.checkpoint import save
        from torch._C._distributed_c10d import ProcessGroup
        torch.distributed.get_rank()
        t.distributed.barrier()
        importlib.import_module("torch.distributed")
        from mrl.distributed import WorkerGroup
        from mrl.parallel import collectives
        collectives.barrier()
        megatron.distributed.DistributedDataParallel
    ''')
    assert [line for line, _ in torch_distributed_uses(sample)] == [5, 6, 7, 8, 9, 10, 11, 12]


def test_the_allowed_modules_are_where_the_calls_went():
    uses = {path: torch_distributed_uses((ROOT / path).read_text()) for path in ALLOWED}
    assert all(uses.values()), uses  # else the scan reads nothing, or the allowed list names stale files


# --------------------------------------------------------------------------------- against the NCCL stand-in
@pytest.fixture(scope="module")
def observed() -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run([sys.executable, str(STANDIN)], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env=env)
    assert run.returncode == 0, run.stderr[-6000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_the_standin_refuses_host_tensors_like_nccl(observed):
    one = observed["world_of_one"]
    assert one["device_types"] == one["subgroup_device_types"] == ["standin"]  # NCCL's groups: ["cuda"] alone
    assert one["refused"] == dict.fromkeys(("all_reduce", "broadcast", "all_gather", "subgroup all_reduce"), REFUSAL)
    assert all(m["refused"] == REFUSAL for m in observed["two_members"].values())


def test_collectives_take_host_tensors_to_the_groups_device_and_back(observed):
    one = observed["world_of_one"]
    assert (one["group_device"], one["gloo_group_device"]) == ("standin:0", "cpu")
    assert (one["rank"], one["world_size"]) == (0, 1)
    assert one["results"] == dict.fromkeys(
        ("all_reduce max", "subgroup", "gloo", "broadcast", "all_gather_into_tensor", "all_gather",
         "broadcast_tensor"), [[1.0, 2.0, 3.0], "cpu"])  # a world of one: the values unchanged, on the host
    assert one["sender keeps its tensor"]


def test_values_travel_between_two_members(observed):
    payload = [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    for member, seen in observed["two_members"].items():
        assert seen["all_reduce sum"] == [3.0, 30.0] and seen["all_reduce max"] == [2.0, 20.0]
        assert seen["all_gather"] == [[1.0, 10.0], [2.0, 20.0]]
        # d/dx_m of both members' losses, 1 |S|^2 + 2 |S|^2 with S = x_0 + x_1 = [3, 30]: 6 S on each member
        assert seen["summed_with_grad"] == [[3.0, 30.0], [18.0, 180.0]]
        assert seen["broadcast_tensor to host"] == [payload, "torch.bfloat16", "cpu"]
        # a receiver without `device` gets the tensor on the group's device; the sender keeps its own
        assert seen["broadcast_tensor default"] == ["standin:0" if member == "1" else "cpu", payload]
