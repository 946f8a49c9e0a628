"""A zygote that declines (its answer where a CUDA device is visible: a forked process could not use CUDA) leaves
the run's ranks to be started, and says why (mrl/testing/zygote.py). The zygote here is a stand-in program that
gives the real zygote's answer, since this machine has no CUDA device to make the real one decline."""

import sys

from mrl.testing import zygote


def test_a_declining_zygote_leaves_the_ranks_to_be_started_and_says_why(tmp_path, monkeypatch):
    answer = "declined: a CUDA device is visible, and a forked process cannot use CUDA"
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\necho '{answer}'\n")
    fake.chmod(0o755)
    log = tmp_path / "starts.log"
    monkeypatch.setattr(zygote, "_zygotes", {})
    monkeypatch.setattr(sys, "executable", str(fake))
    monkeypatch.setenv("MRL_RANK_ZYGOTE_LOG", str(log))
    env = {"PATH": "/bin", "WORLD_SIZE": "2", "RANK": "0"}
    for rank in (0, 1):
        assert zygote.start_rank(tmp_path, rank, {**env, "RANK": str(rank)}, tmp_path / f"rank{rank}.log") is None
    assert [z.refusal for z in zygote._zygotes.values()] == [answer, answer]
    assert all(z.proc.poll() == 0 for z in zygote._zygotes.values())  # ended on their own, not killed
    lines = log.read_text().splitlines()
    assert len(lines) == 2 and all(line.endswith(f"started, its zygote could not fork it: {answer}") for line in lines)
    for z in zygote._zygotes.values():
        z.close()  # their stderr files
