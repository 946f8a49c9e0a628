"""The steps that build one policy rank, in the order `PolicyWorker.__init__` runs them:

    parallel_dims -> start_process_groups -> read_model_config -> speed_settings -> transformer_overrides
    -> transformer_config -> initial_weights -> build_policy_module -> wrap_for_training -> build_reference
    -> routing_replay

Each step takes what it needs as arguments and returns what it makes; the worker keeps the results. The pure ones
(`parallel_dims`, `params_dtype`, `transformer_overrides`, `ddp_settings`, `optimizer_options`, `megatron_weights`,
`routing_settings`) read the config alone and are tested without processes (tests/unit/policy/
test_policy_construction.py); the others start process groups, read files, build models or move them between
devices, and run for real in tests/functional/policy.

Ordering hazards: the process groups start before anything is built (Megatron seeds its RNGs there, and the device
rule picks this rank's CUDA device); the weights load before `freeze_routers` and DDP (which collects the trainable
parameters); the HF state is read once for the policy and its reference, and freed when both hold it.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from mrl.config.schema import OptimizerConfig, ParallelConfig, PolicyConfig
from mrl.model.router_replay import RoutingReplay
from mrl.parallel.layout import ParallelDims
from mrl.policy.speed import SpeedSettings, fused_wgrad_available, resolve_speed, wire_overlaps

if TYPE_CHECKING:
    from converters import ModelDims
    from mrl.policy.worker import PolicySpec

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


# ------------------------------------------------------------------------------------------ pure: config -> settings
def parallel_dims(par: ParallelConfig, *, world_size: int) -> ParallelDims:
    """The policy's layout from `policy.parallel` on `world_size` ranks (data parallel = the rest); raises
    `ParallelLayoutError` for a combination Megatron cannot lay out."""
    return ParallelDims(
        tp=par.tensor_parallel_size,
        pp=par.pipeline_parallel_size,
        cp=par.context_parallel_size,
        ep=par.expert_parallel_size,
        sequence_parallel=par.sequence_parallel,
        world_size=world_size,
    )


def params_dtype(precision: str) -> torch.dtype:
    """The parameter (and compute) dtype of `policy.precision`."""
    return _DTYPES[precision]


def transformer_overrides(
    cfg: PolicyConfig, model_dims: ModelDims, speed: SpeedSettings, *, trainable: bool
) -> dict[str, Any]:
    """The keyword arguments of `transformer_config_from_hf` (after the HF config) for this policy: the parallel
    sizes, the dtype, full recomputation of every layer with `activation_checkpointing`, gradient-accumulation
    fusion only for a model that trains, the compiled fusions as `speed` resolved them, the router settings of a
    mixture-of-experts model ({} for a dense one) and an uneven pipeline split. The groups of keys are disjoint."""
    par = cfg.parallel
    recompute: dict[str, Any] = (
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        if cfg.activation_checkpointing
        else {}
    )
    uneven: dict[str, Any] = {}
    if par.first_stage_layers is not None:
        uneven["num_layers_in_first_pipeline_stage"] = par.first_stage_layers
    if par.last_stage_layers is not None:
        uneven["num_layers_in_last_pipeline_stage"] = par.last_stage_layers
    from mrl.model.build import router_settings

    moe = router_settings(
        model_dims,
        expert_parallel=par.expert_parallel_size,
        router_dtype=cfg.moe.router_dtype,
        aux_loss_coeff=cfg.moe.aux_loss_coeff,
        expert_bias_update_rate=cfg.moe.expert_bias_update_rate,
    )
    local: dict[str, Any] = dict(use_te=False) if _local_linears(cfg, trainable) else {}
    return dict(
        **local,
        tensor_parallel=par.tensor_parallel_size,
        pipeline_parallel=par.pipeline_parallel_size,
        context_parallel=par.context_parallel_size,
        sequence_parallel=par.sequence_parallel,
        params_dtype=params_dtype(cfg.precision),
        **recompute,
        gradient_accumulation_fusion=speed.gradient_accumulation_fusion and trainable,
        compiled_fusions=speed.compiled_fusions,
        **moe,
        **uneven,
    )


def _local_linears(cfg: PolicyConfig, trainable: bool) -> bool:
    """Whether the model is built from Megatron's local linears even where Transformer Engine is installed: LoRA
    adapts those alone (TE's fused norm + linear takes the input before its norm, which an adapter must not)."""
    return cfg.lora is not None and trainable


def ddp_settings(optimizer: OptimizerConfig, speed: SpeedSettings) -> dict[str, bool]:
    """Megatron's `DistributedDataParallelConfig` of a policy that trains: gradients reduced in fp32, the
    distributed optimizer as `policy.optimizer` says, the overlaps as `speed` resolved them."""
    return dict(
        grad_reduce_in_fp32=True,
        use_distributed_optimizer=optimizer.use_distributed_optimizer,
        overlap_grad_reduce=speed.overlap_grad_reduce,
        overlap_param_gather=speed.overlap_param_gather,
    )


def optimizer_options(cfg: PolicyConfig, speed: SpeedSettings) -> dict[str, Any]:
    """What `build_optimizer` needs beyond `policy.optimizer`: the parameters' dtype (bf16 parameters get fp32 main
    weights) and whether the DDP chunks gather overlapped."""
    return dict(params_dtype=params_dtype(cfg.precision), overlap_param_gather=speed.overlap_param_gather)


def megatron_weights(megatron_dir: Optional[str]) -> Optional[Path]:
    """The folder whose slices a rank loads as its starting weights: a Megatron checkpoint's model/ (`PolicySpec.
    megatron_dir`), or None for the HF folder's safetensors."""
    if megatron_dir is None:
        return None
    from mrl.checkpoint.megatron import MODEL_SUBDIR

    return Path(megatron_dir) / MODEL_SUBDIR


def routing_settings(cfg: PolicyConfig, *, moe: bool) -> Optional[dict[str, Any]]:
    """`RoutingReplay`'s settings (but the model and this rank's TP rank) for a mixture-of-experts policy, None for a
    dense one. Every MoE policy measures the engine/trainer routing disagreement; it replays the engine's routing
    only with `policy.moe.router_replay: replay`."""
    if not moe:
        return None
    return dict(
        replay=cfg.moe.router_replay == "replay",
        recompute=cfg.activation_checkpointing,
        tp_size=cfg.parallel.tensor_parallel_size,
        sequence_parallel=cfg.parallel.sequence_parallel,
    )


# ------------------------------------------------------------------------------------ steps with side effects
def start_process_groups(dims: ParallelDims, *, seed: int) -> ModuleType:
    """Start torch.distributed (from the torchrun environment) and every Megatron group of `dims`, apply the CPU
    patches when CUDA is absent, pick this rank's device and seed the RNGs (mrl/parallel/groups.py). Returns
    Megatron's `parallel_state`, which holds the groups."""
    from megatron.core import parallel_state

    from mrl.parallel.groups import init_process_groups

    init_process_groups(dims, seed=seed)
    return parallel_state


def read_model_config(hf_dir: str) -> tuple[dict[str, Any], ModelDims]:
    """The HF folder's config.json and the model's dimensions read from it."""
    from converters import model_dims
    from converters.hf_io import load_hf_config

    hf_config = load_hf_config(hf_dir)
    return hf_config, model_dims(hf_config)


def speed_settings(cfg: PolicyConfig, *, data_parallel: int) -> SpeedSettings:
    """`policy.speed` on this rank's hardware (CUDA, Apex's kernel, torch.compile) with `data_parallel` ranks (with
    context parallelism); `SpeedOptionError` for an option forced on that cannot run."""
    cuda = torch.cuda.is_available()
    return resolve_speed(
        cfg.speed,
        cuda=cuda,
        fused_wgrad=fused_wgrad_available(),
        data_parallel=data_parallel,
        distributed_optimizer=cfg.optimizer.use_distributed_optimizer,
        compiles=cfg.speed.compiled_fusions == "auto" and _inductor_works(),
    )


def _inductor_works() -> bool:
    """Whether torch.compile generates kernels on this rank's GPU, asked only where `auto` needs the answer: not
    where Transformer Engine brings its own fused kernels."""
    from mrl.model.build import torch_compile_works_here
    from mrl.parallel.attention import transformer_engine_available

    return not transformer_engine_available() and torch_compile_works_here()


def transformer_config(hf_config: dict[str, Any], overrides: dict[str, Any]) -> Any:
    """Megatron's TransformerConfig of the HF model with `overrides` (`transformer_overrides`)."""
    from mrl.model.build import transformer_config_from_hf

    return transformer_config_from_hf(hf_config, **overrides)


def initial_weights(spec: PolicySpec, hf_config: dict[str, Any]) -> Callable[[Any], None]:
    """What loads the starting weights into a freshly built model (the policy, then its reference): the Megatron
    checkpoint's slices of this rank (resharded on load), or the HF state, read here once for both models."""
    checkpoint = megatron_weights(spec.megatron_dir)
    if checkpoint is not None:
        from mrl.checkpoint.megatron import load_megatron_checkpoint

        return lambda module: load_megatron_checkpoint(module, checkpoint)
    from converters.hf_io import load_hf_state
    from mrl.model.build import load_hf_weights

    hf_state = load_hf_state(spec.hf_dir)
    return lambda module: load_hf_weights(module, hf_state, hf_config)


def _build_module(hf_config: dict[str, Any], tconfig: Any, spec: PolicySpec, speed: SpeedSettings) -> Any:
    """This rank's shard of the GPT model (its pipeline stage, TP and EP slices), freshly initialised."""
    from mrl.model.build import build_model

    local = dict(use_te=False) if _local_linears(spec.policy, spec.trainable) else {}
    lora = spec.policy.lora
    # adapted routed experts must run their linears (the grouped GEMMs read the weights alone)
    adapted_experts = spec.trainable and lora is not None and "experts" in lora.targets
    return build_model(
        hf_config,
        tconfig,
        padded_vocab=spec.padded_vocab,
        grouped_experts=speed.grouped_expert_gemm and not adapted_experts,
        **local,
    )


def build_policy_module(
    hf_config: dict[str, Any], tconfig: Any, spec: PolicySpec, speed: SpeedSettings, load: Callable[[Any], None]
) -> tuple[Any, int]:
    """The policy's module with its starting weights (`load`) and, with `policy.moe.freeze_router`, its routers
    frozen; and the index of its first decoder layer in the whole model."""
    from mrl.model.build import freeze_routers, stage_layer_offset

    module = _build_module(hf_config, tconfig, spec, speed)
    load(module)
    if spec.policy.moe.freeze_router:
        freeze_routers(module)  # before DDP and the optimizer collect the trainable parameters
    return module, stage_layer_offset(module)


def add_adapters(module: Any, spec: PolicySpec, *, score_head: bool) -> None:
    """With `policy.lora` on a trainable model: LoRA adapters on its target layers, the rest frozen (mrl/model/lora.py),
    a reward model's or critic's score head left trainable (it starts fresh). Before DDP and the optimizer collect the
    trainable parameters; the starting weights are loaded already."""
    lora = spec.policy.lora
    if lora is None or not spec.trainable:
        return
    from mrl.model.lora import LoraSettings, apply_lora

    apply_lora(module, LoraSettings.of(lora, seed=spec.seed))
    if score_head and getattr(module, "output_layer", None) is not None:
        module.output_layer.requires_grad_(True)


def wrap_for_training(
    module: Any, tconfig: Any, spec: PolicySpec, speed: SpeedSettings
) -> tuple[list, Optional[Any], Optional[Any]]:
    """(model chunks, optimizer, LR scheduler). A trainable policy: the module in Megatron's DDP, the schedule's
    gradient hooks set on `tconfig`, Megatron's optimizer and the LR schedule over `spec.total_steps`. A frozen one
    (`spec.trainable` False): the bare module without gradients, no optimizer, no schedule."""
    if not spec.trainable:
        module.requires_grad_(False)
        return [module], None, None
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    from mrl.policy.optim import build_optimizer, build_scheduler

    cfg = spec.policy
    ddp_config = DistributedDataParallelConfig(**ddp_settings(cfg.optimizer, speed))
    model = [DistributedDataParallel(tconfig, ddp_config, module=module)]
    tconfig.finalize_model_grads_func = finalize_model_grads  # waits for overlapped reduces too
    wire_overlaps(speed, tconfig, model)
    optimizer = build_optimizer(model, cfg.optimizer, **optimizer_options(cfg, speed))
    scheduler = build_scheduler(optimizer, cfg.optimizer, cfg.scheduler, total_steps=spec.total_steps)
    return model, optimizer, scheduler


def build_reference(
    hf_config: dict[str, Any], tconfig: Any, spec: PolicySpec, speed: SpeedSettings, load: Callable[[Any], None]
) -> Optional[Any]:
    """With `spec.with_reference`: a frozen copy of the starting weights for KL logprobs, in eval mode, in host
    memory between uses with `policy.offload_reference` on CUDA; else None."""
    if not spec.with_reference:
        return None
    reference = _build_module(hf_config, tconfig, spec, speed)
    load(reference)
    reference.requires_grad_(False)
    reference.eval()
    if spec.policy.offload_reference and torch.cuda.is_available():
        reference.cpu()
    return reference


def routing_replay(model: list, cfg: PolicyConfig, model_dims: ModelDims, ps: ModuleType) -> Optional[RoutingReplay]:
    """The routing recorder of a mixture-of-experts policy (`routing_settings`), on the policy's routers only: the
    reference model routes freshly. None for a dense model."""
    settings = routing_settings(cfg, moe=model_dims.moe is not None)
    if settings is None:
        return None
    return RoutingReplay(model, tp_rank=ps.get_tensor_model_parallel_rank(), **settings)
