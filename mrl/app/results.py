"""Where a run leaves its results, and the lines every command that trains or evaluates ends with, naming them.

    <run.output_dir>/
        final_hf/ | final_megatron/   the trained model (run.final_format), `.complete` written last
        final_hf/lora_adapter/        with policy.lora: the adapters alone, a PEFT folder over the starting model
        summary.json                  the run's figures; a run a guard stopped writes it too, `stopped` saying why
        reward_curve.png              GRPO: the mean training reward per step
        samples.jsonl                 mrl eval: every sample
        logs/metrics.jsonl            every logged metric (logger.log_dir)
        logs/tensorboard/             TensorBoard events: `tensorboard --logdir <that folder>`
        checkpoints/step_N/           checkpointing.dir
A staged run (`mrl run`) has one such folder per stage under its own output folder, and its own summary.json (every
stage's, by name) and reward_curve.png (every GRPO stage's curve) beside them.
"""

from __future__ import annotations

import json
import os
import shlex
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from mrl.algorithms.guards import TrainingStopped
from mrl.config.schema import MrlConfig

FINAL_DIRS = {"hf": "final_hf", "megatron": "final_megatron"}  # by run.final_format
DONE_MARKER = ".complete"
LORA_ADAPTER_DIR = "lora_adapter"
SUMMARY_FILE = "summary.json"
REWARD_CURVE = "reward_curve.png"
SAMPLES_FILE = "samples.jsonl"  # mrl eval's (mrl.algorithms.evaluate.SAMPLES_FILE)


def final_dir(cfg: MrlConfig) -> Path:
    """Where a training command leaves its model (see the module docstring)."""
    return Path(cfg.run.output_dir) / FINAL_DIRS[cfg.run.final_format]


def tensorboard_dir(cfg: MrlConfig) -> Path:
    """The TensorBoard events of a run (mrl.logging.metrics.MetricsLogger.from_config writes them there)."""
    return Path(cfg.logger.log_dir) / "tensorboard"


def save_summary(out_dir: Path, summary: dict[str, Any]) -> Path:
    """summary.json in `out_dir`, and the reward curve beside it when the summary has one (GRPO)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / SUMMARY_FILE
    path.write_text(json.dumps(summary, indent=2) + "\n")
    if summary.get("reward_curve"):
        plot_rewards({out_dir.name: summary["reward_curve"]}, out_dir / REWARD_CURVE)
    return path


def last_metrics(history: dict[str, list[tuple[int, float]]]) -> dict[str, float]:
    """The last logged value of every metric: what a loop that was stopped had reached."""
    return {name: values[-1][1] for name, values in history.items() if values}


@contextmanager
def summary_on_stop(out_dir: Path, summarise: Callable[[], dict[str, Any]]) -> Iterator[None]:
    """A run a guard stops (`TrainingStopped`: too many non-finite or idle steps in a row) still writes its
    summary.json: `summarise()`'s figures so far, and `stopped` with the setting that stopped it and why. The error
    goes on, naming the file."""
    try:
        yield
    except TrainingStopped as stop:
        summary = summarise()
        summary["stopped"] = {"by": stop.setting, "reason": str(stop), "at": time.strftime("%Y-%m-%d %H:%M:%S")}
        path = save_summary(out_dir, summary)
        raise type(stop)(f"{stop}\n  The run's summary so far, with why it stopped: {path}") from stop


def plot_rewards(curves: dict[str, list[float]], path: Path) -> Path | None:
    """The training reward per step of each named curve (a GRPO run, or each GRPO stage of a staged run), with its
    running mean over 10 steps, as a PNG; None (nothing drawn) without a curve."""
    curves = {name: curve for name, curve in curves.items() if curve}
    if not curves:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    window = 10
    for name, curve in curves.items():
        steps = range(1, len(curve) + 1)
        ax.plot(steps, curve, alpha=0.35, label=f"{name} (per step)")
        smooth = [
            sum(curve[max(0, i - window + 1) : i + 1]) / len(curve[max(0, i - window + 1) : i + 1])
            for i in range(len(curve))
        ]
        ax.plot(steps, smooth, label=f"{name} (mean of last {window})")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("mean training reward")
    if all(0 <= v <= 1 for curve in curves.values() for v in curve):
        ax.set_ylim(0, 1)  # 0/1 verifier rewards; a reward model's scores keep their own range
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------------------------- the last lines
def _folder(path: Path) -> str:
    return f"{path}{os.sep}"


def _tensorboard_line(folders: Sequence[Path]) -> tuple[str, str] | None:
    """The command that shows the TensorBoard events of `folders` (one run's, or every stage's: their common
    folder), or None when none was written (logger.tensorboard=false)."""
    written = [folder for folder in folders if folder.is_dir()]
    if not written:
        return None
    root = Path(os.path.commonpath([str(folder) for folder in written])) if len(written) > 1 else written[0]
    return "TensorBoard", f"tensorboard --logdir {shlex.quote(str(root))}   (then open http://localhost:6006)"


def _run_rows(cfg: MrlConfig) -> list[tuple[str, str]]:
    """What one run's folder holds, each row only when it is there."""
    out = Path(cfg.run.output_dir)
    model = final_dir(cfg)
    rows = []
    if (model / DONE_MARKER).is_file():
        kind = (
            "HF: what vLLM and transformers load"
            if cfg.run.final_format == "hf"
            else "Megatron: mrl convert megatron-to-hf makes an HF folder of it"
        )
        rows.append(("model", f"{_folder(model)}   ({kind}; policy.model_name of a next run)"))
    for name, what in ((SUMMARY_FILE, "summary"), (REWARD_CURVE, "reward curve"), (SAMPLES_FILE, "samples")):
        if (out / name).is_file():
            rows.append((what, str(out / name)))
    metrics = Path(cfg.logger.log_dir) / "metrics.jsonl"
    if metrics.is_file():
        rows.append(("metrics", f"{metrics}   (one JSON line per step)"))
    board = _tensorboard_line([tensorboard_dir(cfg)])
    if board:
        rows.append(board)
    checkpoints = Path(cfg.checkpointing.dir)
    steps = sorted(checkpoints.glob("step_*"), key=lambda p: int(p.name[5:]) if p.name[5:].isdigit() else -1)
    if cfg.checkpointing.enabled and steps:
        rows.append(("checkpoints", f"{_folder(checkpoints)}   (newest {steps[-1].name})"))
    return rows


def _render(title: str, rows: list[tuple[str, str]]) -> str:
    width = max((len(label) for label, _ in rows), default=0) + 1
    return "\n".join([title, *(f"  {(label + ':').ljust(width)} {value}" for label, value in rows)])


def run_report(cfg: MrlConfig, *, stopped: bool = False) -> str:
    """The lines a single run (`mrl grpo | sft | dpo | rm | eval`) ends with: where each of its results is."""
    out = Path(cfg.run.output_dir)
    title = (
        f"results so far in {_folder(out)} (the run was stopped: summary.json's `stopped` says why)"
        if stopped
        else f"results in {_folder(out)}"
    )
    return _render(title, _run_rows(cfg))


def staged_report(root: MrlConfig, stages: Sequence[tuple[str, MrlConfig]]) -> str:
    """The lines `mrl run` ends with: the staged run's own files, each stage's folder and model, and one
    TensorBoard command for every stage."""
    out = Path(root.run.output_dir)
    rows = [
        (what, str(out / name))
        for name, what in ((SUMMARY_FILE, "summary"), (REWARD_CURVE, "reward curve"))
        if (out / name).is_file()
    ]
    for name, cfg in stages:
        model, folder = final_dir(cfg), Path(cfg.run.output_dir)
        summary = folder / SUMMARY_FILE
        if (model / DONE_MARKER).is_file():
            shown = f"model {_folder(model)}"
        elif summary.is_file() and "stopped" in json.loads(summary.read_text()):
            shown = "stopped: its summary.json says why"
        elif summary.is_file():
            shown = "an evaluation: no model"
        else:
            shown = "not run"
        rows.append((f"stage {name}", f"{_folder(folder)}   ({shown})"))
    board = _tensorboard_line([tensorboard_dir(cfg) for _, cfg in stages])
    if board:
        rows.append(board)
    return _render(f"results in {_folder(out)}", rows)
