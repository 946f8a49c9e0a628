"""Megatron optimizer and learning-rate schedule from mrl's config sections.

Adam keeps fp32 master weights whatever the parameter dtype (Megatron's mixed-precision optimizer wraps bf16
parameters); `adamw` is decoupled weight decay, `adam` is L2-in-the-gradient Adam.
"""

from __future__ import annotations

import torch

from mrl.config.schema import OptimizerConfig, SchedulerConfig


def build_optimizer(
    model: list, cfg: OptimizerConfig, *, params_dtype: torch.dtype, overlap_param_gather: bool = False
):
    """A MegatronOptimizer over the model chunks (DDP-wrapped); `overlap_param_gather` as the chunks' DDP config
    (`mrl/policy/speed.py`)."""
    from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
    from megatron.core.optimizer import get_megatron_optimizer

    bf16 = params_dtype == torch.bfloat16
    megatron_cfg = MegatronOptimizerConfig(
        optimizer="adam",
        lr=cfg.lr,
        min_lr=cfg.min_lr,
        weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1,
        adam_beta2=cfg.adam_beta2,
        adam_eps=cfg.adam_eps,
        clip_grad=cfg.clip_grad,
        decoupled_weight_decay=cfg.name == "adamw",
        bf16=bf16,
        fp16=False,
        params_dtype=params_dtype,
        use_distributed_optimizer=cfg.use_distributed_optimizer,
        overlap_param_gather=overlap_param_gather,
    )
    return get_megatron_optimizer(megatron_cfg, model)


def build_scheduler(optimizer, opt_cfg: OptimizerConfig, cfg: SchedulerConfig, *, total_steps: int):
    """Warm-up from 0 to lr over `warmup_steps`, then constant / cosine / linear decay to min_lr."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    decay_steps = cfg.decay_steps or max(total_steps, cfg.warmup_steps + 1)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if cfg.warmup_steps else opt_cfg.lr,
        max_lr=opt_cfg.lr,
        min_lr=opt_cfg.min_lr,
        lr_warmup_steps=cfg.warmup_steps,
        lr_decay_steps=decay_steps,
        lr_decay_style=cfg.style,
        start_wd=opt_cfg.weight_decay,
        end_wd=opt_cfg.weight_decay,
        wd_incr_steps=decay_steps,
        wd_incr_style="constant",
    )
