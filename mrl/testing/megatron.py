"""A trainable Megatron model from an HF folder, as the policy-step tests and benchmarks set it up by hand (without
a PolicyWorker): the model, Megatron DDP, Adam and its scheduler."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch


def trainable_from_hf(
    model_dir: str | Path, *, lr: float = 1e-3, adam_eps: float = 1e-8, total_steps: int = 1, **parallel: Any
) -> tuple[Any, Any, Any, dict]:
    """(DDP-wrapped model, optimizer, scheduler, HF config dict) of the HF model in `model_dir`, fp32, weights loaded.

    `parallel` goes to `transformer_config_from_hf` (tensor_parallel=, context_parallel=, ...); the process groups
    must exist already (`mrl.parallel.groups.init_process_groups`)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from safetensors.torch import load_file

    from mrl.config.schema import OptimizerConfig, SchedulerConfig
    from mrl.model.build import build_model, load_hf_weights, transformer_config_from_hf
    from mrl.policy.optim import build_optimizer, build_scheduler

    hf_config = json.loads((Path(model_dir) / "config.json").read_text())
    config = transformer_config_from_hf(hf_config, **parallel)
    model = build_model(hf_config, config)
    load_hf_weights(model, load_file(str(Path(model_dir) / "model.safetensors")), hf_config)
    model = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), module=model)
    config.finalize_model_grads_func = finalize_model_grads
    opt_cfg = OptimizerConfig(lr=lr, weight_decay=0.0, adam_eps=adam_eps)
    optimizer = build_optimizer([model], opt_cfg, params_dtype=torch.float32)
    scheduler = build_scheduler(optimizer, opt_cfg, SchedulerConfig(), total_steps=total_steps)
    return model, optimizer, scheduler, hf_config
