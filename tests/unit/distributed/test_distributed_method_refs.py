"""Remote calls by reference (`WorkerGroup._method_name`): a worker group is handed the worker class's function
(`run_all(PolicyWorker.export_bucket, ...)`) and calls it by name on every rank; a string, a function of another
class or a name the class lacks is refused before anything is sent, and a subclass's override is what runs."""

from types import SimpleNamespace

import pytest

from mrl.distributed.worker_group import WorkerGroup


class Base:
    def step(self) -> int:
        return 1


class Worker(Base):
    def step(self) -> int:  # an override: the group calls `step` by name, so this one runs
        return 2

    def save(self) -> None: ...


class Other:
    def save(self) -> None: ...


def _name(worker_cls, method):
    return WorkerGroup._method_name(SimpleNamespace(name="policy", worker_cls=worker_cls), method)


def test_a_method_of_the_worker_class_or_its_bases_is_called_by_its_name():
    assert _name(Worker, Worker.save) == "save"
    assert _name(Worker, Base.step) == "step"


def test_a_string_or_another_class_method_is_refused_naming_the_fix():
    with pytest.raises(TypeError, match=r"'save' is not a method of Worker; pass the worker class's function"):
        _name(Worker, "save")
    with pytest.raises(TypeError, match="is not a method of Worker"):
        _name(Worker, Other.save)
    with pytest.raises(TypeError, match="is not a method of Base"):
        _name(Base, Worker.save)  # a subclass's method on a group of the base class


def test_the_policy_and_engine_groups_name_no_worker_method_by_a_string():
    """The remote calls of mrl itself pass references: no `run_all("...")`-style call is left in the package."""
    import re
    from pathlib import Path

    pattern = re.compile(
        r"\.(run_all|run_all_async|run_on_leaders|run_on_leaders_async|shard_and_run|shard_and_run_async|"
        r"layout_from_workers)\(\s*[\"']|shutdown\(clean=[\"']"
    )
    package = Path(__file__).resolve().parents[3] / "mrl"
    found = [f"{path}: {m.group(0)}" for path in package.rglob("*.py") for m in pattern.finditer(path.read_text())]
    assert found == []
