"""One metrics logger for every algorithm, fanning out to sinks: console, JSONL, TensorBoard, W&B.

Metric names carry a prefix that says what they are: `train/...` (per training step), `val/...` (evaluation),
`timing/...` (seconds per phase). The logger rejects other names so dashboards stay organised.

Console: on a TTY a progress bar with step, ETA and a few key metrics; otherwise (Slurm logs, CI) no redraws, one
plain line every `log_every` steps.
"""

from __future__ import annotations

import json
import math
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Mapping, Protocol, Sequence

PREFIXES = ("train/", "val/", "timing/", "memory/")


class Sink(Protocol):
    def log(self, metrics: Mapping[str, float], step: int) -> None: ...
    def close(self) -> None: ...


class JsonlSink:
    """Appends one JSON object per call: {"step": N, "time": unix, metric: value, ...}; flushed every line."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = path.open("a", encoding="utf-8")

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        record = {"step": step, "time": round(time.time(), 3), **metrics}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardSink:
    """TensorBoard scalar events under `log_dir`."""

    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for name, value in metrics.items():
            self._writer.add_scalar(name, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """Weights & Biases, only when enabled in the config; wandb is an optional dependency."""

    def __init__(self, project: str, name: str, entity: str | None, config: Mapping[str, Any] | None):
        try:
            import wandb
        except ImportError:
            raise RuntimeError(
                "logger.wandb.enabled=true but wandb is not installed: pip install 'mrl[wandb]'"
            ) from None
        self._run = wandb.init(project=project, name=name, entity=entity, config=dict(config or {}))

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self._run.log(dict(metrics), step=step)

    def close(self) -> None:
        self._run.finish()


class ConsoleSink:
    """Progress bar on a TTY (tqdm), a plain line every `log_every` steps otherwise."""

    def __init__(
        self, total_steps: int | None, description: str, key_metrics: Sequence[str], log_every: int = 1, stream=None
    ):
        self.stream = stream or sys.stderr
        self.key_metrics = list(key_metrics)
        self.log_every, self.total = log_every, total_steps
        self.description = description
        self._start = time.monotonic()
        self._bar = None
        if self.stream.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, desc=description, file=self.stream, dynamic_ncols=True)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        # train/ metrics by their short name, the others in full (train/loss and val/loss side by side), in the
        # order of key_metrics
        shown = {k.removeprefix("train/"): metrics[k] for k in self.key_metrics if k in metrics}
        if self._bar is not None:
            self._bar.update(max(step - self._bar.n, 0))
            self._bar.set_postfix({k: _fmt(v) for k, v in shown.items()}, refresh=True)
            return
        if step % self.log_every and step != self.total:
            return
        elapsed = time.monotonic() - self._start
        eta = ""
        if self.total and step > 0:
            eta = f" eta {_duration(elapsed / step * (self.total - step))}"
        of_total = f"/{self.total}" if self.total else ""
        values = " ".join(f"{k}={_fmt(v)}" for k, v in shown.items())
        print(
            f"[{self.description}] step {step}{of_total} {_duration(elapsed)}{eta} {values}".rstrip(),
            file=self.stream,
            flush=True,
        )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


class MetricsLogger:
    """Validates metric names and values, then forwards them to every sink.

    `history` keeps every logged value in memory so a run can summarise itself (curves, before/after tables).
    """

    def __init__(self, sinks: Sequence[Sink]):
        self.sinks = list(sinks)
        self.history: dict[str, list[tuple[int, float]]] = {}

    @classmethod
    def from_config(
        cls,
        cfg,
        *,
        total_steps: int | None,
        description: str,
        key_metrics: Sequence[str] = (),
        run_config: Mapping[str, Any] | None = None,
    ) -> "MetricsLogger":
        """Sinks from a `LoggerConfig` (mrl.config.schema)."""
        log_dir = Path(cfg.log_dir)
        sinks: list[Sink] = []
        if cfg.console:
            sinks.append(ConsoleSink(total_steps, description, key_metrics, cfg.log_every))
        if cfg.jsonl:
            sinks.append(JsonlSink(log_dir / "metrics.jsonl"))
        if cfg.tensorboard:
            sinks.append(TensorBoardSink(log_dir / "tensorboard"))
        if cfg.wandb.enabled:
            sinks.append(WandbSink(cfg.wandb.project, description, cfg.wandb.entity, run_config))
        return cls(sinks)

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        if not metrics:
            return
        clean = {name: _check(name, value) for name, value in metrics.items()}
        for name, value in clean.items():
            self.history.setdefault(name, []).append((step, value))
        for sink in self.sinks:
            sink.log(clean, step)

    @contextmanager
    def timer(self, phase: str, into: dict[str, float]) -> Iterator[None]:
        """Measure a phase: `with logger.timer("generation", metrics):` adds metrics["timing/generation"]."""
        start = time.perf_counter()
        try:
            yield
        finally:
            into[f"timing/{phase}"] = time.perf_counter() - start

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _check(name: str, value: Any) -> float:
    if not name.startswith(PREFIXES):
        raise ValueError(f"metric '{name}' must start with one of {', '.join(PREFIXES)}")
    try:
        return float(value.item() if hasattr(value, "item") else value)
    except (TypeError, ValueError):
        raise ValueError(f"metric '{name}' must be a number, got {type(value).__name__}") from None


def _fmt(value: float) -> str:
    if math.isnan(value) or math.isinf(value):
        return str(value)
    return f"{value:.4g}"


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return (
        f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
        if seconds >= 3600
        else f"{seconds // 60}:{seconds % 60:02d}"
    )
