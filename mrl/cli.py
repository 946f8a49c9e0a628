"""`mrl` command line: `mrl <command> --config FILE [overrides...]`.

Every command validates its configuration before anything starts: a bad key, type or combination exits with status 2
and a message naming the dotted key. Exit statuses are listed in mrl/app/errors.py. The commands themselves live in
mrl/app (imported when used, so that `mrl config show` and `--help` do not load torch, Ray or vLLM).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, Sequence

from mrl.algorithms.guards import NONFINITE_EXIT_CODE, NonFiniteTraining
from mrl.algorithms.health import IDLE_EXIT_CODE, EnvironmentFailing, IdleTraining
from mrl.app.config_args import config_argument_mistake
from mrl.app.errors import (
    INTERRUPTED,
    INTERRUPTED_EXIT_CODE,
    RUN_FAILED_EXIT_CODE,
    CheckpointIncompatibleError,
    Preempted,
    RunFailed,
)
from mrl.config import CONFIG_ERROR_EXIT_CODE, ConfigError, MrlConfig, load_config, to_yaml
from mrl.data.tokenizers import EOS_TOKEN

CONFIG_COMMANDS: dict[str, str] = {
    "grpo": "GRPO training: generate -> reward -> advantages -> train -> refit, on Ray.",
    "sft": "Supervised fine-tuning (NLL on response tokens).",
    "dpo": "Direct preference optimisation (DPO, IPO, + SFT term) on prompt/chosen/rejected pairs, packed.",
    "rm": "Reward-model training: a score head, Bradley-Terry loss on pairs; exports *ForSequenceClassification.",
    "eval": "pass@1 / pass@k of a model on a problem/answer file with the rollout engine.",
}

OVERRIDE_HELP = (
    "overrides in Hydra's grammar: key=value (set), +key=value (add), ++key=value (set or add), "
    "~key (remove); e.g. policy.optimizer.lr=1e-5 grpo.num_generations_per_prompt=8"
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mrl", description="RL post-training for LLMs on Megatron-Core, vLLM and Ray."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help_text in CONFIG_COMMANDS.items():
        cmd = sub.add_parser(name, help=help_text, description=help_text)
        _add_config_args(cmd)
    run = sub.add_parser(
        "run",
        help="Run a staged recipe (e.g. sft -> grpo 8K -> grpo 16K), handing checkpoints on.",
        description="Run every stage of a recipe in order; each stage starts from the previous "
        "stage's final checkpoint.",
    )
    run.add_argument(
        "recipe", help="recipe YAML file with a `stages:` list, or a shipped recipe's name (e.g. arith-tiny-cpu)"
    )
    _add_overrides(run)
    score = sub.add_parser(
        "score",
        help="Per-token logprobs and perplexity of texts under the Megatron model.",
        description="Per-token logprobs and perplexity of texts (or token ids) under the Megatron "
        "policy, in any parallel layout (e.g. policy.parallel.tensor_parallel_size=2 "
        "cluster.devices_per_node=2).",
    )
    score.add_argument(
        "--model",
        required=True,
        metavar="MODEL",
        help="HF model folder, a hub id (org/name[@revision]), or a Megatron checkpoint folder (`mrl "
        "convert hf-to-megatron` output, a training step_N or final_megatron)",
    )
    score.add_argument("--input", required=True, metavar="FILE", help="jsonl: text | prompt+completion | input_ids")
    score.add_argument("--out", required=True, metavar="FILE", help="jsonl written with per-token logprobs")
    score.add_argument("--config", metavar="FILE", help="optional YAML config (parallel layout, precision, ...)")
    _add_overrides(score)
    _add_convert_parser(sub)
    _add_download_parser(sub)
    _add_submit_parser(sub)
    _add_plan_parser(sub)
    _add_check_parser(sub)
    _add_env_parser(sub)
    config = sub.add_parser("config", help="Inspect configurations.")
    config_sub = config.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    show = config_sub.add_parser("show", help="Print the resolved tree (defaults, inheritance and overrides applied).")
    show.add_argument("--config", metavar="FILE", help="YAML config or recipe (none: the defaults alone)")
    _add_overrides(show)
    return parser


def _add_overrides(cmd: argparse.ArgumentParser) -> None:
    """The optional overrides; the default makes argparse show them as optional (a `*` positional without one is
    listed among "the following arguments are required" when an argument before it is missing)."""
    cmd.add_argument("overrides", nargs="*", default=[], metavar="OVERRIDE", help=OVERRIDE_HELP)


def _add_config_args(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument(
        "--config",
        required=True,
        metavar="FILE",
        help="YAML config or recipe file, or a shipped recipe's name (e.g. arith-tiny-cpu.yaml)",
    )
    _add_overrides(cmd)


def _add_convert_parser(sub) -> None:
    convert = sub.add_parser("convert", help="Convert checkpoints between Hugging Face and Megatron formats.")
    conv_sub = convert.add_subparsers(dest="direction", required=True, metavar="DIRECTION")
    to_meg = conv_sub.add_parser("hf-to-megatron", help="HF folder -> Megatron distributed checkpoint.")
    to_meg.add_argument(
        "--hf",
        required=True,
        metavar="DIR",
        help="HF model folder (config.json + safetensors) or hub id (org/name[@revision])",
    )
    to_meg.add_argument("--out", required=True, metavar="DIR", help="output folder")
    to_meg.add_argument("--tp", type=int, default=1, help="tensor parallel size of the written checkpoint")
    to_meg.add_argument("--pp", type=int, default=1, help="pipeline parallel size of the written checkpoint")
    to_meg.add_argument("--ep", type=int, default=1, help="expert parallel size (mixture-of-experts models)")
    to_hf = conv_sub.add_parser("megatron-to-hf", help="Megatron checkpoint (or a training step) -> HF folder.")
    src = to_hf.add_mutually_exclusive_group(required=True)
    src.add_argument("--megatron", metavar="DIR", help="Megatron checkpoint folder written by hf-to-megatron")
    src.add_argument("--checkpoint", metavar="DIR", help="a training checkpoint <checkpoint_dir>/step_N")
    to_hf.add_argument("--out", required=True, metavar="DIR", help="output folder")


def _add_download_parser(sub) -> None:
    text = (
        "Fill the hub cache (HF_HOME / HF_HUB_CACHE) with what runs read of a model or dataset: on a login node "
        "with network, before runs on compute nodes without (HF_HUB_OFFLINE=1)."
    )
    download = sub.add_parser("download", help=text, description=text)
    download.add_argument("id", metavar="MODEL_OR_DATASET", help="hub id, org/name[@revision]")
    download.add_argument("--revision", help="branch, tag or commit (default: main, or the id's @revision)")
    download.add_argument("--dataset", action="store_true", help="a dataset repo (default: a model repo)")


def _run_download(args: argparse.Namespace) -> int:
    from mrl.data import hub

    ref = hub.parse_hub_id(args.id)
    if ref is None:
        raise ConfigError(
            "not a hub id (org/name[@revision]), or a local path that exists", key=hub.DOWNLOAD_ARGUMENT, given=args.id
        )
    if args.revision:
        ref = hub.HubRef(ref.repo_id, args.revision)
    if hub.offline():
        raise ConfigError(
            "HF_HUB_OFFLINE=1 forbids fetching",
            key="HF_HUB_OFFLINE",
            given="1",
            fix="unset it for `mrl download` (on a machine with network)",
        )
    kind = "dataset" if args.dataset else "model"
    result = hub.resolve(ref, repo_type=kind, key=hub.DOWNLOAD_ARGUMENT)
    files = [p for p in Path(result.path).rglob("*") if p.is_file()]
    size = sum(p.stat().st_size for p in files)
    print(
        f"{ref} ({kind}): commit {result.commit}, {len(files)} files, {size / 2**20:.1f} MiB in {result.path}\n"
        f"runs with the same HF_HOME read it offline (HF_HUB_OFFLINE=1) as {ref}"
    )
    return 0


def _add_env_parser(sub) -> None:
    env = sub.add_parser("env", help="Environments as HTTP resource servers (tools + verifier) for agent loops.")
    env_sub = env.add_subparsers(dest="env_command", required=True, metavar="ACTION")
    serve = env_sub.add_parser(
        "serve",
        help="Serve an example environment until Ctrl-C.",
        description="Serve an example resource server (mrl/environments/servers/examples.py) in this process: "
        "POST /seed_session, one POST /<tool> per tool, POST /verify, POST /aggregate_metrics, GET /tools, "
        "GET /health. Prints its URL and tools; Ctrl-C stops it.",
    )
    serve.add_argument("name", metavar="NAME", help="the example: guess_number or calculator")
    serve.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default 127.0.0.1: this machine only; sessions are unauthenticated, so "
        "0.0.0.0 exposes them to the network)",
    )
    serve.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    rows = env_sub.add_parser(
        "rows", help="Write dataset rows of an example game (guess_number) or the code_sum task as jsonl."
    )
    rows.add_argument("name", metavar="NAME", help="guess_number, or code_sum (a program that sums two numbers)")
    rows.add_argument("--count", type=int, default=2000, help="rows (default 2000)")
    rows.add_argument("--seed", type=int, default=0, help="seed of the secrets")
    rows.add_argument("--max-turns", type=int, default=7, help="guesses allowed per game")
    rows.add_argument("--low", type=int, default=0, help="smallest secret (default 0)")
    rows.add_argument("--high", type=int, default=99, help="largest secret (default 99)")
    rows.add_argument(
        "--warmup",
        action="store_true",
        help="SFT rows instead: a naive player's games (random guesses: the format, not the strategy); code_sum: "
        "programs right half the time, near misses otherwise",
    )
    rows.add_argument(
        "--turn-end",
        default=EOS_TOKEN,
        help="text of the token that ends a model turn, for --warmup (default: the tiny tokenizer's EOS)",
    )
    rows.add_argument("--out", required=True, metavar="FILE", help="jsonl file written")


def _add_submit_parser(sub) -> None:
    submit = sub.add_parser(
        "submit",
        help="Check a command's config against a Slurm allocation, then sbatch it (slurm/ray-sbatch.sh).",
        description="Preflight (the config is validated, the allocation checked against cluster.* and, with GPUs, "
        "the layout's memory against the GPU: mrl plan), then "
        "`sbatch slurm/ray-sbatch.sh <command>`: a Ray head on the first node, a worker on each other, "
        "the command on the head. Example: mrl submit --time=04:00:00 --requeue -- mrl grpo --config X",
    )
    submit.add_argument("--nodes", type=int, help="nodes (default: cluster.num_nodes of the config)")
    submit.add_argument("--gpus-per-node", type=int, help="GPUs per node (default: cluster.devices_per_node)")
    submit.add_argument(
        "--no-gpus",
        dest="gpus",
        action="store_false",
        help="request no GPUs (CPU clusters: devices are worker processes)",
    )
    submit.add_argument(
        "--gpu",
        default="h100-80gb",
        help="the GPU the memory plan checks the layout against (default h100-80gb; see mrl plan)",
    )
    submit.add_argument(
        "--assume",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="replace one of the memory plan's assumptions (see mrl plan)",
    )
    submit.add_argument("--time", help="time limit (sbatch --time)")
    submit.add_argument("--partition", help="sbatch --partition")
    submit.add_argument("--account", help="sbatch --account")
    submit.add_argument("--job-name", default="mrl", help="sbatch --job-name (default: mrl)")
    submit.add_argument(
        "--requeue",
        action="store_true",
        help="after a pre-emption (SIGTERM) the run saves, and the job is re-queued to resume",
    )
    submit.add_argument("--container-image", help="pyxis/enroot image for every step (default: bare, the venv)")
    submit.add_argument(
        "--container-mounts",
        help="pyxis container mounts, SRC[:DST[:FLAGS]],... (the submit folder "
        "is mounted at its own path in any case: every step runs in it)",
    )
    submit.add_argument("--log-root", default="slurm-logs", help="logs go to LOG_ROOT/<job id>/ (default: slurm-logs)")
    submit.add_argument("--sbatch-arg", action="append", default=[], metavar="ARG", help="extra sbatch argument")
    submit.add_argument("--dry-run", action="store_true", help="print the sbatch command instead of running it")
    submit.add_argument(
        "submitted", nargs=argparse.REMAINDER, metavar="COMMAND", help="-- mrl <command> --config FILE [overrides]"
    )


def _add_plan_parser(sub) -> None:
    text = (
        "A recipe's memory per GPU (policy ranks by pipeline stage, the engine's weights and KV cache), with the "
        "assumptions printed, and whether it fits; a staged recipe's, stage by stage; exit 2 when one does not."
    )
    plan = sub.add_parser("plan", help=text, description=text)
    plan.add_argument(
        "--config", required=True, metavar="FILE", help="YAML config or recipe, or a shipped recipe's name"
    )
    plan.add_argument("--gpu", default="h100-80gb", help="the GPU (default h100-80gb; h200-141gb, a100-80gb, ...)")
    plan.add_argument(
        "--assume",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="replace one of the plan's assumptions with your own measurement (repeatable)",
    )
    plan.add_argument(
        "--model-config",
        metavar="FILE",
        help="the model's config.json (default: policy.model_name's, "
        "from its folder, the hub cache or mrl's shipped copies)",
    )
    _add_overrides(plan)


def _add_check_parser(sub) -> None:
    text = (
        "A finished run's figures (its summary.json) against the expect: block of its recipe; exit 5 naming each "
        "figure that missed its bound."
    )
    check = sub.add_parser("check", help=text, description=text)
    check.add_argument("run_dir", metavar="RUN_DIR", help="the run's run.output_dir (a staged run's root)")
    check.add_argument("recipe", metavar="RECIPE", help="the recipe it ran (a file, or a shipped recipe's name)")
    _add_overrides(check)


def _run_check(args: argparse.Namespace) -> int:
    from mrl.app.check import MISSED_EXIT_CODE, check_run, report

    cfg = load_config(args.recipe, args.overrides)
    results = check_run(Path(args.run_dir), cfg)
    print(report(results, cfg))
    return 0 if all(result.ok for result in results) else MISSED_EXIT_CODE


def _run_plan(args: argparse.Namespace) -> int:
    from mrl.app.plan_stages import fits, plan_command, render_plans

    plans = plan_command(
        args.config, args.overrides, gpu=args.gpu, assume=args.assume, model_config_path=args.model_config
    )  # a staged recipe: every stage
    print(render_plans(plans))
    return 0 if fits(plans) else CONFIG_ERROR_EXIT_CODE


def _run_submit(args: argparse.Namespace) -> int:
    from mrl.app.slurm import PreflightError, submit

    try:
        return submit(args)
    except PreflightError as exc:
        print(f"mrl submit: {exc}", file=sys.stderr)
        return CONFIG_ERROR_EXIT_CODE


def _handler(command: str) -> Callable[[MrlConfig], object]:
    """The implementation of a config-driven command (imported lazily: heavy dependencies load only when used); it
    ends by printing where the run's results are."""
    import functools

    from mrl.app.commands import run_command

    return functools.partial(run_command, command)


def _run_config_command(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    _handler(args.command)(cfg)
    return 0


def _run_staged(args: argparse.Namespace) -> int:
    from mrl.app.stages import run_staged

    run_staged(args.recipe, args.overrides)
    return 0


def _run_score(args: argparse.Namespace) -> int:
    """`mrl score`: the model and the CPU-friendly precision are overrides, so the config is validated as usual."""
    import tempfile

    import torch

    from mrl.app.commands import run_score
    from mrl.app.hub_ids import resolve_model_argument
    from mrl.app.model_source import classify_model_path

    model = resolve_model_argument(args.model, "--model")
    classify_model_path(model, key="--model")  # a wrong folder is named as the user gave it
    overrides = [f"++policy.model_name={model}", f"++run.output_dir={tempfile.mkdtemp(prefix='mrl-score-')}"]
    if not torch.cuda.is_available() and not any(o.lstrip("+").startswith("policy.precision=") for o in args.overrides):
        overrides.append("++policy.precision=float32")  # bf16 on CPU: slow, and off by ~0.1 nats
    run_score(load_config(args.config, [*overrides, *args.overrides]), args.input, args.out)
    return 0


def _write_rows(args: argparse.Namespace) -> int:
    """`mrl env rows NAME`: dataset rows of an example game, for `data.train` of a multi-turn GRPO run."""
    import json

    from mrl.app.env_args import check_rows_arguments
    from mrl.data.code import sum_program_rows
    from mrl.environments.servers import GuessNumber

    check_rows_arguments(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.name == "code_sum":
        written = sum_program_rows(args.count, seed=args.seed, warmup=args.warmup)
        out.write_text("".join(json.dumps(row) + "\n" for row in written))
        print(f"wrote {len(written)} rows to {out}")
        return 0
    example = {"guess_number": GuessNumber}.get(args.name)  # the examples with a row generator
    if example is None:
        print(f"mrl env rows: {args.name!r} has no row generator (guess_number and code_sum have)", file=sys.stderr)
        return CONFIG_ERROR_EXIT_CODE
    bounds = dict(max_turns=args.max_turns, low=args.low, high=args.high)
    rows = (
        example.warmup_rows(args.count, seed=args.seed, turn_end=args.turn_end, **bounds)
        if args.warmup
        else example.rows(args.count, seed=args.seed, **bounds)
    )
    out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"wrote {len(rows)} rows to {out}")
    return 0


def _run_env(args: argparse.Namespace) -> int:
    """`mrl env serve NAME`: an example resource server on a background thread; the main thread waits for Ctrl-C."""
    import time

    from mrl.app.env_args import check_port
    from mrl.environments.servers import EXAMPLES, serve, tool_specs

    if args.env_command == "rows":
        return _write_rows(args)

    if args.name not in EXAMPLES:
        print(f"mrl env serve: unknown environment {args.name!r}: choose one of {', '.join(EXAMPLES)}", file=sys.stderr)
        return CONFIG_ERROR_EXIT_CODE
    check_port(args.port)
    server = EXAMPLES[args.name]()
    try:
        running = serve(server, host=args.host, port=args.port)
    except OSError as exc:  # port in use, an address not on this machine, or no start in time
        print(f"mrl env serve: {exc}", file=sys.stderr)
        return 1
    print(
        f'{server.name} at {running.url}: POST /seed_session {{"row": ...}}, then the tools and POST /verify '
        "with the X-Session-Id header (or the mrl_session cookie)"
    )
    for spec in tool_specs(server):
        summary = spec.description.split("\n")[0]
        print(f"  POST {running.url}/{spec.name} {{{', '.join(spec.parameters)}}}  {summary}")
    print("Ctrl-C stops it.", flush=True)
    try:
        while running.alive:
            time.sleep(0.5)
    except KeyboardInterrupt:
        return 0
    finally:
        running.stop()
    print("mrl env serve: the server stopped by itself", file=sys.stderr)
    return 1


def _run_convert(args: argparse.Namespace) -> int:
    """HF <-> Megatron conversion (mrl.app.convert); a bad input folder is a user error, not a traceback (a flag
    the model cannot take, or a folder argument that names no folder: a ConfigError, exit 2). The folder arguments
    are checked before the conversion's modules (torch, megatron-core) are imported."""
    from mrl.app import convert_args

    if args.direction == "hf-to-megatron":
        convert_args.check_hf_argument(args.hf)
        convert_args.check_out_argument(args.out, args.hf, empty=False)
    else:
        key, source = ("--megatron", args.megatron) if args.megatron else ("--checkpoint", args.checkpoint)
        convert_args.check_source_folder(source, key)
        convert_args.check_out_argument(args.out, source, empty=True)

    from converters import ConversionError
    from mrl.app import convert
    from mrl.checkpoint.manager import CheckpointError

    try:
        if args.direction == "hf-to-megatron":
            from mrl.app.hub_ids import resolve_model_argument

            hf = resolve_model_argument(args.hf, "--hf")
            out = convert.hf_to_megatron(hf, args.out, tp=args.tp, pp=args.pp, ep=args.ep)
        elif args.megatron:
            out = convert.megatron_to_hf(args.megatron, args.out)
        else:
            from mrl.checkpoint.manager import MARKER_FILE

            if not (Path(args.checkpoint) / MARKER_FILE).is_file():
                raise ConversionError(
                    f"{args.checkpoint} is not a complete training checkpoint (no {MARKER_FILE} "
                    "marker): pass a <checkpointing.dir>/step_N folder"
                )
            out = convert.megatron_to_hf(args.checkpoint, args.out)  # step_N/model (weights) + step_N/hf (config)
    except (ConversionError, CheckpointError, FileNotFoundError) as exc:
        print(f"mrl convert: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


def _dashed_override(argv: list[str]) -> ConfigError | None:
    """An override written as an option (`--policy.optimizer.lr=1e-5`, `--grpo.max_num_steps 3`): argparse would
    say only "unrecognized arguments"; the fix is the same words without the dashes."""
    for i, arg in enumerate(argv):
        if arg == "--":
            return None  # what follows is another command's (mrl submit)
        name, has_value, _ = arg.partition("=")
        if not arg.startswith("--") or "." not in name:
            continue
        fixed = arg[2:]
        if not has_value and i + 1 < len(argv) and not argv[i + 1].startswith("-") and "=" not in argv[i + 1]:
            fixed = f"{arg[2:]}={argv[i + 1]}"
        return ConfigError(
            "an override is key=value, without dashes",
            key=arg,
            fix=f"write {fixed}" + ("" if "=" in fixed else "=<value>"),
        )
    return None


def main(argv: Sequence[str] | None = None) -> int:
    from mrl.logging.known_noise import silence_known_noise

    silence_known_noise()  # the dependencies' known-harmless warnings (the in-process engines run here)
    words = list(sys.argv[1:] if argv is None else argv)
    mistake = _dashed_override(words) or config_argument_mistake(words, {*CONFIG_COMMANDS, "plan", "score", "config"})
    if mistake is not None:
        print(f"mrl: configuration error\n  {mistake.render()}", file=sys.stderr)
        return CONFIG_ERROR_EXIT_CODE
    args = build_parser().parse_args(argv)
    try:
        if args.command == "config":
            print(to_yaml(load_config(args.config, args.overrides)), end="")
            return 0
        if args.command == "run":
            return _run_staged(args)
        if args.command == "convert":
            return _run_convert(args)
        if args.command == "score":
            return _run_score(args)
        if args.command == "download":
            return _run_download(args)
        if args.command == "submit":
            return _run_submit(args)
        if args.command == "plan":
            return _run_plan(args)
        if args.command == "check":
            return _run_check(args)
        if args.command == "env":
            return _run_env(args)
        return _run_config_command(args)
    except ConfigError as exc:
        print(f"mrl: configuration error\n  {exc.render()}", file=sys.stderr)
        return CONFIG_ERROR_EXIT_CODE
    except (FileNotFoundError, CheckpointIncompatibleError) as exc:
        print(f"mrl: error: {exc}", file=sys.stderr)
        return 1
    except Preempted as exc:
        print(f"mrl: pre-empted: {exc}", file=sys.stderr)
        return 0
    except RunFailed as exc:
        print(f"mrl: run failed: {exc}", file=sys.stderr)
        return RUN_FAILED_EXIT_CODE
    except NonFiniteTraining as exc:
        print(f"mrl: training stopped: {exc}", file=sys.stderr)
        return NONFINITE_EXIT_CODE
    except IdleTraining as exc:
        print(f"mrl: training stopped: {exc}", file=sys.stderr)
        return IDLE_EXIT_CODE
    except EnvironmentFailing as exc:
        print(f"mrl: training stopped: {exc}", file=sys.stderr)
        return RUN_FAILED_EXIT_CODE
    except KeyboardInterrupt:
        print(f"\nmrl: {INTERRUPTED}", file=sys.stderr)
        return INTERRUPTED_EXIT_CODE


if __name__ == "__main__":
    sys.exit(main())
