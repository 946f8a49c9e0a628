"""Metrics logging shared by every algorithm (console, JSONL, TensorBoard, W&B)."""

from mrl.logging.metrics import ConsoleSink, JsonlSink, MetricsLogger, TensorBoardSink, WandbSink

__all__ = ["ConsoleSink", "JsonlSink", "MetricsLogger", "TensorBoardSink", "WandbSink"]
