"""The metrics logger and its sinks write what they are given, where users look for it."""

import io
import json

import pytest

from mrl.config.schema import LoggerConfig
from mrl.logging import ConsoleSink, MetricsLogger


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


def test_jsonl_and_tensorboard_receive_every_metric(tmp_path):
    cfg = LoggerConfig(log_dir=str(tmp_path), console=False)
    with MetricsLogger.from_config(cfg, total_steps=2, description="t") as logger:
        logger.log({"train/loss": 1.5, "timing/train": 0.25}, step=1)
        logger.log({"train/loss": 0.5, "val/accuracy": 0.75}, step=2)
    lines = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(l["step"], l["train/loss"]) for l in lines] == [(1, 1.5), (2, 0.5)]
    assert lines[1]["val/accuracy"] == 0.75 and "timing/train" not in lines[1]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 1.5), (2, 0.5)]
    assert [(e.step, e.value) for e in events.Scalars("val/accuracy")] == [(2, 0.75)]
    assert logger.history["train/loss"] == [(1, 1.5), (2, 0.5)]


def test_metric_names_need_a_known_prefix_and_numbers():
    logger = MetricsLogger([])
    with pytest.raises(ValueError, match="must start with"):
        logger.log({"loss": 1.0}, step=1)
    with pytest.raises(ValueError, match="must be a number"):
        logger.log({"train/loss": "high"}, step=1)


def test_console_without_tty_prints_plain_lines_every_n_steps():
    out = io.StringIO()
    sink = ConsoleSink(total_steps=4, description="grpo", key_metrics=["train/reward", "val/reward"], log_every=2,
                       stream=out)
    for step in range(1, 5):
        # val/ first in the step's metrics: the line keeps key_metrics' order
        sink.log({**({"val/reward": 0.5} if step == 4 else {}), "train/reward": step / 10, "train/other": 9.0}, step)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and "\r" not in out.getvalue()
    assert lines[0].startswith("[grpo] step 2/4") and "reward=0.2" in lines[0] and "other" not in lines[0]
    assert lines[1].endswith("reward=0.4 val/reward=0.5")  # train/ metrics by short name, others in full
    assert "eta" in lines[0] and lines[1].startswith("[grpo] step 4/4")


def test_console_on_tty_draws_a_progress_bar_with_key_metrics():
    out = FakeTTY()
    sink = ConsoleSink(total_steps=10, description="sft", key_metrics=["train/loss"], stream=out)
    sink.log({"train/loss": 0.125}, step=3)
    sink.close()
    text = out.getvalue()
    assert "sft" in text and "3/10" in text and "loss=0.125" in text and "\r" in text


def test_timer_records_a_timing_metric():
    logger, metrics = MetricsLogger([]), {}
    with logger.timer("refit", metrics):
        sum(range(1000))
    assert set(metrics) == {"timing/refit"} and metrics["timing/refit"] >= 0


def test_wandb_enabled_but_missing_is_a_clear_error(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_wandb(name, *a, **k):
        if name == "wandb":
            raise ImportError(name)
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    cfg = LoggerConfig(log_dir=str(tmp_path), console=False, jsonl=False, tensorboard=False, wandb={"enabled": True})
    with pytest.raises(RuntimeError, match="wandb is not installed"):
        MetricsLogger.from_config(cfg, total_steps=1, description="x")
