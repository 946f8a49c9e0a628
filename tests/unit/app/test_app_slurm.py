"""`mrl submit`'s preflight and sbatch line, and the launcher's bounded wait naming the nodes that never joined."""

from __future__ import annotations

import argparse

import pytest

from mrl.app import slurm
from mrl.app.slurm import PreflightError, check_allocation, command_config, sbatch_command, wait_for_nodes
from mrl.testing.runs import RECIPE


def test_the_allocation_defaults_to_the_config_and_a_mismatch_is_refused():
    cfg = command_config(["mrl", "grpo", "--config", RECIPE, "cluster.num_nodes=2", "cluster.devices_per_node=8",
                          "grpo.num_prompts_per_step=256", "policy.train_global_batch_size=2048"])
    assert check_allocation(cfg, None, None) == slurm.Allocation(2, 8)
    assert check_allocation(cfg, 2, 8) == slurm.Allocation(2, 8)
    with pytest.raises(PreflightError, match="--nodes 4 but cluster.num_nodes=2.*--gpus-per-node 4 but"):
        check_allocation(cfg, 4, 4)


def test_only_config_commands_can_be_checked():
    assert command_config(["mrl", "run", RECIPE]).run.name == "arith-tiny-cpu"
    with pytest.raises(PreflightError, match="cannot check `mrl convert"):
        command_config(["mrl", "convert", "hf-to-megatron"])


def test_sbatch_line():
    args = argparse.Namespace(job_name="mrl", gpus=True, time="04:00:00", partition=None, account="a1", requeue=True,
                              log_root="/logs", sbatch_arg=["--exclusive"])
    line = sbatch_command(slurm.Allocation(2, 8), ["mrl", "grpo", "--config", "x.yaml"], args)
    assert line == ["sbatch", "--parsable", "--nodes=2", "--job-name=mrl", "--gpus-per-node=8", "--time=04:00:00",
                    "--account=a1", "--requeue", "--output=/logs/slurm-%j.out", "--exclusive", str(slurm.LAUNCHER),
                    "mrl", "grpo", "--config", "x.yaml"]


def test_wait_names_the_nodes_missing_at_the_deadline(monkeypatch):
    seen = iter([{"node1"}, {"node1.cluster", "node3"}] + [{"node1", "node3"}] * 100)
    monkeypatch.setattr(slurm, "_live_hosts", lambda address: next(seen))
    with pytest.raises(TimeoutError, match=r"1 of 3 node\(s\) have not joined the Ray cluster: node2; see L/ray"):
        wait_for_nodes("h:6379", ["node1", "node2", "node3"], timeout_s=0.05, log_dir="L", poll_s=0.01)
    seen = iter([set(), {"node1", "node2"}])
    monkeypatch.setattr(slurm, "_live_hosts", lambda address: next(seen))
    wait_for_nodes("h:6379", ["node1", "node2"], timeout_s=5, poll_s=0.01)  # returns once both are there


def _submit_args(command: list[str], tmp_path, dry_run: bool = False) -> argparse.Namespace:
    return argparse.Namespace(submitted=["--", *command], nodes=None, gpus_per_node=None, dry_run=dry_run,
                              job_name="mrl", gpus=False, time=None, partition=None, account=None, requeue=False,
                              log_root=str(tmp_path / "logs"), sbatch_arg=[], container_image=None,
                              container_mounts=None)


def _sbatch_on_path(tmp_path, monkeypatch) -> None:
    """An sbatch on PATH, as on a login node (the tests replace the call to it)."""
    import os

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text("#!/bin/sh\nexit 1\n")
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")


def test_submit_fetches_the_hub_ids_first_and_queues_nothing_when_one_is_missing(tmp_path, monkeypatch, capsys):
    from huggingface_hub import constants

    from mrl.config.errors import ConfigError
    from mrl.testing.hub_cache import place

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    _sbatch_on_path(tmp_path, monkeypatch)
    queued = []
    monkeypatch.setattr(slurm.subprocess, "run", lambda line, **kw: queued.append(line) or argparse.Namespace(
        returncode=0, stdout="42\n", stderr=""))
    command = ["mrl", "grpo", "--config", RECIPE, "policy.model_name=org/model", "~policy.build",
               f"run.output_dir={tmp_path / 'run'}"]
    with pytest.raises(ConfigError, match="org/model .*not in the hub cache"):
        slurm.submit(_submit_args(command, tmp_path))
    assert queued == []
    assert slurm.submit(_submit_args(command, tmp_path, dry_run=True)) == 0 and queued == []
    assert "org/model not in the hub cache: submitting fetches it" in capsys.readouterr().err
    commit = place(tmp_path / "hub", "org/model", {"config.json": b"{}", "model.safetensors": b"w"})
    assert slurm.submit(_submit_args(command, tmp_path)) == 0 and len(queued) == 1
    assert f"org/model -> commit {commit}" in capsys.readouterr().err



def _launcher_mounts(mounts: str, submit_dir) -> str:
    """The container mounts the launcher gives every step (slurm/ray-sbatch.sh `with_submit_dir`, run alone: the
    whole launcher in dry-run mode is tests/slurm's)."""
    import subprocess

    script = slurm.LAUNCHER.read_text()
    function = script[script.index("with_submit_dir() {"):]
    function = function[:function.index("\n}\n") + 3]
    done = subprocess.run(["bash", "-c", f'set -euo pipefail\n{function}with_submit_dir "$1" "$2"', "-", mounts,
                           str(submit_dir)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_custom_container_mounts_keep_the_submit_folder_every_step_runs_in(tmp_path):
    submit = tmp_path / "project"
    assert '--container-mounts="$mounts" --container-workdir="$submit_dir"' in slurm.LAUNCHER.read_text()
    assert _launcher_mounts("", submit) == f"{submit}:{submit}"  # none given: the submit folder
    # the user's mounts, and the submit folder added: it is the working directory of every step
    assert _launcher_mounts("/lustre:/lustre", submit) == f"/lustre:/lustre,{submit}:{submit}"
    assert _launcher_mounts(f"{submit}:/work", submit) == f"{submit}:/work,{submit}:{submit}"  # elsewhere inside
    assert _launcher_mounts(f"{submit}:{submit}:ro", submit) == f"{submit}:{submit}:ro,{submit}:{submit}"
    assert _launcher_mounts(f"{tmp_path}/proj:{tmp_path}/proj", submit) == \
        f"{tmp_path}/proj:{tmp_path}/proj,{submit}:{submit}"  # a name that only starts the same
    # already there at its own path, writable: the folder itself or one above it, with or without a destination
    for covering in (f"{submit}:{submit}", f"/data:/data,{tmp_path}/", f"{tmp_path}:{tmp_path}:rw", "/"):
        assert _launcher_mounts(covering, submit) == covering


def _submit(argv: list[str], capsys) -> tuple[int, str]:
    """`mrl submit ARGV` through the command line: (exit status, stderr); sbatch is never run."""
    from mrl.cli import main

    status = main(["submit", "--no-gpus", *argv])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return status, err


def _data_command(tmp_path, *overrides: str, command: tuple[str, ...] = ("grpo", "--config", RECIPE)) -> list[str]:
    return ["--", "mrl", *command, "~data.arith", "env.kind=math", f"run.output_dir={tmp_path / 'run'}", *overrides]


def test_submit_reads_the_data_here_as_the_run_does_before_anything_is_queued(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "rows.jsonl").write_text('{"problem": "1+1", "answer": "2"}\n')
    status, err = _submit(["--dry-run", *_data_command(tmp_path, "data.train=none.jsonl")], capsys)
    assert status == 2
    assert (f"data.train: the data file none.jsonl does not exist (looked for {tmp_path / 'none.jsonl'}): the job "
            "would fail on it after its wait in the queue") in err
    assert "fix: set data.train to a file that exists (a relative path starts from the submit folder" in err
    status, err = _submit(["--dry-run", *_data_command(tmp_path, "data.train=rows.jsonl", "data.val=empty.jsonl")],
                          capsys)
    assert status == 2 and "data.val: empty.jsonl holds no rows: it is empty" in err
    staged = _data_command(tmp_path, "data.train=empty.jsonl", command=("run", RECIPE))
    status, err = _submit(["--dry-run", *staged], capsys)
    assert status == 2 and "data.train: stage 'sft-warmup': empty.jsonl holds no rows: it is empty" in err
    status, err = _submit(["--dry-run", *_data_command(tmp_path, "data.train=rows.jsonl")], capsys)
    assert status == 0 and "not checked" not in err


def test_submit_leaves_the_clusters_paths_to_the_job(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rows.jsonl").write_text('{"problem": "1+1", "answer": "2"}\n')
    elsewhere = "/mrl-no-such-top-folder/data/train.jsonl"
    status, err = _submit(["--dry-run", *_data_command(tmp_path, f"data.train={elsewhere}")], capsys)
    assert status == 0
    assert (f"data.train: {elsewhere} not checked (there is no /mrl-no-such-top-folder on this machine): the job "
            "reads it on the cluster") in err
    in_image = str(tmp_path / "in-image.jsonl")  # a top folder this machine has, but a container image may hold it
    status, err = _submit(["--dry-run", *_data_command(tmp_path, "data.train=rows.jsonl", f"data.val={in_image}")],
                          capsys)
    assert status == 2 and f"data.val: the data file {in_image} does not exist" in err
    status, err = _submit(["--dry-run", "--container-image", "img.sqsh",
                           *_data_command(tmp_path, "data.train=rows.jsonl", f"data.val={in_image}")], capsys)
    assert status == 0 and f"data.val: {in_image} not checked (it may be in the container img.sqsh)" in err


@pytest.mark.parametrize("value", ["90", "90:30", "04:00:00", "2-00", "2-12:30", "2-12:30:00", "0", "UNLIMITED"])
def test_slurm_time_formats_pass(value):
    slurm.check_time(value)


@pytest.mark.parametrize("value", ["abc", "4h", "1:2:3:4", "", "2-", "-1:00", "1.5"])
def test_a_time_limit_slurm_cannot_read_is_refused_before_the_preflight(value, tmp_path, capsys):
    status, err = _submit([f"--time={value}", "--", "mrl", "grpo", "--config", "no-such.yaml"], capsys)
    assert status == 2
    assert f"--time: not a Slurm time limit\n    given: {value!r}\n    allowed: MINUTES, MINUTES:SECONDS, " in err
    assert "fix: e.g. --time=04:00:00 (four hours)" in err


def test_submit_without_slurm_says_so_and_how_to_see_the_script(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch on it
    queued = []
    monkeypatch.setattr(slurm.subprocess, "run", lambda line, **kw: queued.append(line))
    status, err = _submit(["--", "mrl", "grpo", "--config", RECIPE], capsys)
    assert status == 2 and queued == []
    assert "mrl submit: sbatch was not found on PATH (this machine has no Slurm client): run `mrl submit` on a " \
           "Slurm login node, or add --dry-run" in err
    assert _submit(["--dry-run", "--", "mrl", "grpo", "--config", RECIPE], capsys)[0] == 0
