"""The `mrl grpo | sft | eval | run` commands: start the workers, run a loop, export the result, shut down.

Every training command ends by exporting the final policy as an HF folder, `<run.output_dir>/final_hf` (marked
complete by `final_hf/.complete`), which is what the next stage of a staged recipe starts from and what vLLM or
transformers load. `mrl run` runs the stages of a recipe in order, each in `<run.output_dir>/<stage name>`; a
stage already completed by an earlier invocation is skipped, an interrupted one resumes from its newest checkpoint.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from mrl.algorithms.checkpointing import resume_padded_vocab
from mrl.config.schema import MrlConfig

FINAL_HF_DIR = "final_hf"
DONE_MARKER = ".complete"
SUMMARY_FILE = "summary.json"


def _say(message: str) -> None:
    print(f"[mrl] {message}", file=sys.stderr, flush=True)


def _logger(cfg: MrlConfig, total_steps: int, description: str, key_metrics) -> Any:
    from mrl.logging.metrics import MetricsLogger

    return MetricsLogger.from_config(cfg.logger, total_steps=total_steps, description=description,
                                     key_metrics=key_metrics, run_config=cfg.model_dump(mode="json"))


def export_final(runtime: Any, out_dir: Path) -> Path:
    """The policy's current weights as an HF folder (safetensors + config + tokenizer), marked complete last."""
    from converters.hf_io import copy_model_metadata, save_hf_state

    out = out_dir / FINAL_HF_DIR
    save_hf_state(runtime.policy.export_state().items(), out, log=lambda message: None)
    copy_model_metadata(runtime.model_dir, out)
    (out / DONE_MARKER).write_text("")
    return out


def _curve(history: dict, name: str) -> list[float]:
    return [value for _, value in history.get(name, [])]


def _write_summary(out_dir: Path, summary: dict[str, Any]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")


def run_grpo(cfg: MrlConfig) -> dict[str, Any]:
    from mrl.algorithms.grpo import KEY_METRICS, grpo_train
    from mrl.algorithms.runtime import start_runtime
    from mrl.data.tasks import load_task_data
    from mrl.environments.registry import build_environment

    start = time.perf_counter()
    data = load_task_data(cfg, val_source=cfg.eval.data)
    runtime = start_runtime(cfg, total_steps=cfg.grpo.max_num_steps, reference=cfg.loss.kl_beta > 0,
                            padded_vocab=resume_padded_vocab(cfg))
    env = build_environment(cfg.env)
    try:
        with _logger(cfg, cfg.grpo.max_num_steps, f"{cfg.run.name} grpo", KEY_METRICS) as logger:
            final = grpo_train(cfg, runtime, env, data, logger)
            history = logger.history
        export_final(runtime, Path(cfg.run.output_dir))
    finally:
        env.shutdown()
        runtime.shutdown()
    rewards = _curve(history, "train/reward")
    accuracy = _curve(history, "val/accuracy")
    summary = {"algorithm": "grpo", "seconds": time.perf_counter() - start, "reward_curve": rewards,
               "reward_first10": sum(rewards[:10]) / max(1, len(rewards[:10])),
               "reward_last10": sum(rewards[-10:]) / max(1, len(rewards[-10:])),
               "val_accuracy_before": accuracy[0] if accuracy else None,
               "val_accuracy_after": final.get("val/accuracy"),
               "token_mult_prob_error_max": max(_curve(history, "train/token_mult_prob_error"), default=None),
               "final": final}
    _write_summary(Path(cfg.run.output_dir), summary)
    return summary


def run_sft(cfg: MrlConfig) -> dict[str, Any]:
    from mrl.algorithms.runtime import start_runtime
    from mrl.algorithms.sft import KEY_METRICS, sft_train
    from mrl.data.tasks import load_task_data

    start = time.perf_counter()
    data = load_task_data(cfg)
    runtime = start_runtime(cfg, total_steps=cfg.sft.max_num_steps, engine=False,
                            padded_vocab=resume_padded_vocab(cfg))
    try:
        with _logger(cfg, cfg.sft.max_num_steps, f"{cfg.run.name} sft", KEY_METRICS) as logger:
            final = sft_train(cfg, runtime, data, logger)
        export_final(runtime, Path(cfg.run.output_dir))
    finally:
        runtime.shutdown()
    summary = {"algorithm": "sft", "seconds": time.perf_counter() - start, "final": final}
    _write_summary(Path(cfg.run.output_dir), summary)
    return summary


def run_eval(cfg: MrlConfig) -> dict[str, Any]:
    from mrl.algorithms.grpo import run_validation
    from mrl.algorithms.runtime import start_runtime
    from mrl.data.tasks import load_task_data
    from mrl.environments.registry import build_environment

    start = time.perf_counter()
    data = load_task_data(cfg, val_source=cfg.eval.data)
    if not data.val:
        raise ValueError("nothing to evaluate: set eval.data (or data.val) to a problem/answer file")
    runtime = start_runtime(cfg, total_steps=1, policy=False)
    env = build_environment(cfg.env)
    try:
        metrics = run_validation(cfg, runtime, env, data)
    finally:
        env.shutdown()
        runtime.shutdown()
    for name, value in metrics.items():
        print(f"{name}: {value:.4f}")
    summary = {"algorithm": "eval", "seconds": time.perf_counter() - start, "final": metrics}
    _write_summary(Path(cfg.run.output_dir), summary)
    return summary


RUNNERS = {"grpo": run_grpo, "sft": run_sft, "eval": run_eval}
