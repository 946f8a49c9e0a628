"""The typed configuration tree of mrl: one pydantic model per section, every default defined here only.

Every model forbids unknown keys. Cross-field rules (parallel sizes against the model, batch divisibility, packing
options) are checked in `MrlConfig` after the sections validate, so a wrong combination is reported before any worker
starts, naming the key to change.
"""

from __future__ import annotations

import os
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from mrl.config.checks import cross_field_problems
from mrl.config.errors import ConfigError
from mrl.config.validation_errors import takes_number_not_bool


def yaml_off(value: Any) -> Any:
    """YAML 1.1 reads an unquoted `off` as false: a switch whose choices include "off" takes false as "off"."""
    return "off" if value is False else value


class Section(BaseModel):
    """Base of every config section: unknown keys are errors; values are checked on assignment too."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, value: Any, info: Any) -> Any:
        """true/false is not a number: lax pydantic would read `grpo.max_num_steps=true` as 1."""
        field = cls.model_fields.get(info.field_name) if info.field_name else None
        if isinstance(value, bool) and field is not None and takes_number_not_bool(field.annotation):
            raise ValueError("true/false is not a number")
        return value


# ----------------------------------------------------------------------------------------------------- run, cluster
class WatchdogConfig(Section):
    """How long the controller waits on a call to a worker group (train, logprobs, generation, each refit bucket,
    save, load, the reward model) before it ends the run as hung, naming the group, ranks and method with each late
    rank's Python stack (exit 4; a re-run resumes). The deadline grows with the call's work:
    floor_s + tokens / tokens_per_s + megabytes / mb_per_s; the rates are floors far below any machine's speed, so
    only a call that has stopped reaches its deadline."""

    enabled: bool = Field(
        default=True, description="Deadlines on every call the controller waits on; false: wait forever."
    )
    floor_s: float = Field(default=600.0, gt=0, description="Seconds every call may take whatever its work.")
    tokens_per_s: float = Field(
        default=20.0,
        gt=0,
        description="Slowest accepted speed of a call's tokens (generation: "
        "prompt plus generated tokens; train: 3 x its tokens, forward and backward).",
    )
    mb_per_s: float = Field(
        default=10.0, gt=0, description="Slowest accepted speed of a call's bytes (refit bucket, save, load), in MB/s."
    )
    overrides: dict[str, float] = Field(
        default_factory=dict,
        description="A worker method's fixed deadline in "
        "seconds, e.g. {train: 3600, generate_shard: 1800, save: 7200}.",
    )


class RunConfig(Section):
    name: str = Field(default="mrl", description="Run name, used in log and checkpoint folder names.")
    seed: int = Field(default=42, description="Seed for every random source (data order, init, sampling).")
    output_dir: str = Field(
        default="results/${run.name}", description="Folder for logs, plots and checkpoints of the run."
    )
    final_format: Literal["hf", "megatron"] = Field(
        default="hf",
        description="What a training command leaves as its result: final_hf/ (an HF folder: safetensors + "
        "config + tokenizer, for vLLM or transformers) or final_megatron/ (the policy's weights as a Megatron "
        "checkpoint folder, written by every rank, no HF export; any mrl command starts from it, so staged recipes "
        "hand stages on without converting).",
    )
    watchdog: WatchdogConfig = Field(default_factory=WatchdogConfig)

    @field_validator("name", "output_dir")
    @classmethod
    def _not_empty(cls, value: str, info: Any) -> str:
        """An empty run.name would leave every such run the folder results/ to share (run.output_dir's default is
        results/${run.name}); an empty run.output_dir, the current folder."""
        if value.strip():
            return value
        if info.field_name == "name":
            raise ConfigError(
                "is empty: runs without a name would share one results folder",
                key="run.name",
                given=value,
                allowed="a name (results go to results/<run.name> unless run.output_dir says otherwise)",
                fix="give the run a name, e.g. run.name=my-grpo",
            )
        raise ConfigError(
            "is empty: the results need a folder",
            key="run.output_dir",
            given=value,
            allowed="a folder that can be written (the default: results/${run.name})",
            fix="name a folder, e.g. run.output_dir=results/my-grpo, or leave it unset for results/<run.name>",
        )


class ClusterConfig(Section):
    num_nodes: int = Field(default=1, ge=1, description="Nodes in the Ray cluster.")
    devices_per_node: int = Field(
        default=1, ge=1, description="GPUs per node on GPU clusters; worker processes per node on CPU."
    )
    ray_address: Optional[str] = Field(
        default=None,
        description="Address of a running Ray cluster; None: $RAY_ADDRESS if "
        "set (the Slurm launcher sets it), else a local one.",
    )
    cpus_per_worker: float = Field(default=1.0, gt=0, description="Ray CPUs reserved per worker.")
    omp_num_threads: Union[int, Literal["auto"]] = Field(
        default="auto",
        description="Threads (OMP_NUM_THREADS, torch's intra-op threads) of each worker process. auto: "
        "$OMP_NUM_THREADS of the shell that starts mrl when it is set (the Makefile and the test suite set 1); else "
        "each node's cores shared by the worker processes that compute on it at the same time: a group's own ranks "
        "when the phases take turns (synchronous GRPO, SFT, DPO: a phase alone uses every core), all the node's "
        "workers when they overlap (grpo.max_off_policy_steps=1). vLLM's CPU engine binds its own threads "
        "(VLLM_CPU_OMP_THREADS_BIND).",
    )
    memory_check: Literal["refuse", "warn", "off"] = Field(
        default="refuse",
        description="On a GPU, before Ray starts: `mrl plan`'s memory per GPU against this GPU's; refuse: a "
        "layout that does not fit stops with exit 2 and the plan; warn: it prints the plan and starts; off: no check.",
    )

    @field_validator("memory_check", mode="before")
    @classmethod
    def _check_off(cls, value: Any) -> Any:
        return yaml_off(value)

    @field_validator("omp_num_threads", mode="before")
    @classmethod
    def _threads(cls, value: Any) -> Any:
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            return value
        raise ConfigError(
            "not a thread count",
            key="cluster.omp_num_threads",
            given=value,
            allowed="a whole number >= 1, or 'auto'",
            fix="leave it at auto (each phase uses its share of the node's cores) or give the threads "
            "of one worker process",
        )


# ------------------------------------------------------------------------------------------------------------ policy
class ParallelConfig(Section):
    tensor_parallel_size: int = Field(default=1, ge=1, description="Tensor (Megatron intra-layer) parallel size.")
    pipeline_parallel_size: int = Field(default=1, ge=1, description="Pipeline parallel size (layers split in stages).")
    context_parallel_size: int = Field(
        default=1, ge=1, description="Context parallel size (sequence split across ranks)."
    )
    expert_parallel_size: int = Field(default=1, ge=1, description="Expert parallel size for MoE models.")
    sequence_parallel: bool = Field(
        default=False, description="Megatron sequence parallelism; requires tensor_parallel_size > 1."
    )
    first_stage_layers: Optional[int] = Field(
        default=None,
        ge=1,
        description="Decoder layers of the first pipeline stage "
        "when they do not split evenly (DeepSeek-V3's 61); None = an even split.",
    )
    last_stage_layers: Optional[int] = Field(
        default=None,
        ge=1,
        description="Decoder layers of the last pipeline stage; None = an even split of what the first stage leaves.",
    )


class ModelBuildConfig(Section):
    """A model built from scratch (random init) instead of loaded: used by the embedded CPU recipe and tests."""

    family: Literal["llama", "qwen2", "qwen3", "qwen3_moe"] = Field(default="qwen2", description="Architecture family.")
    num_layers: int = Field(default=4, ge=1, description="Transformer layers.")
    hidden_size: int = Field(default=128, ge=8, description="Hidden size.")
    num_attention_heads: int = Field(default=4, ge=1, description="Query heads.")
    num_key_value_heads: Optional[int] = Field(default=None, ge=1, description="Key/value heads (GQA); None = MHA.")
    intermediate_size: int = Field(default=512, ge=8, description="MLP hidden size (of the dense layers).")
    tie_word_embeddings: bool = Field(default=False, description="Share input embedding and output projection.")
    head_dim: Optional[int] = Field(
        default=None,
        ge=1,
        description="Size of each attention head; None = hidden_size / num_attention_heads "
        "(Qwen3's published models set it apart: Qwen3-0.6B has 16 heads of 128 over a hidden size of 1024).",
    )
    vocab_size: Optional[int] = Field(
        default=None,
        ge=1,
        description="Rows of the embedding and output layer; None = the built tokenizer's size. "
        "A larger one leaves rows no token uses, as published checkpoints do (a real model's shape, for speed and "
        "memory checks: Qwen3's 151,936); at least the tokenizer's size.",
    )
    num_experts: int = Field(default=8, ge=1, description="qwen3_moe: routed experts per MoE layer.")
    num_experts_per_tok: int = Field(default=2, ge=1, description="qwen3_moe: experts each token is routed to.")
    moe_intermediate_size: int = Field(default=128, ge=8, description="qwen3_moe: MLP hidden size of each expert.")
    tokenizer: Literal["auto", "characters", "bpe"] = Field(
        default="auto",
        description="The tokenizer built with it: characters (one token per character of digits, + - = and space: the "
        "arithmetic task's), bpe (byte-level BPE of 500 tokens, any text); auto: characters when data.arith is set, "
        "else bpe.",
    )
    rope_scaling: Optional[Literal["linear", "yarn"]] = Field(
        default=None,
        description="Scale RoPE past the native length (max(64, policy.max_total_sequence_length) at build "
        "time), as the HF config's rope_parameters; None = plain RoPE.",
    )
    rope_scaling_factor: float = Field(
        default=1.0,
        ge=1.0,
        description="Context extension factor of rope_scaling: the model "
        "serves native length x factor tokens (later stages may grow into it).",
    )


LoraTarget = Literal["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "experts"]
LORA_TARGETS: tuple[LoraTarget, ...] = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "experts")


class LoraConfig(Section):
    """Low-rank adapters on the policy's linear layers (mrl/model/lora.py): the base frozen (no gradients, no
    optimizer states), the adapters trained, the engine refitted with the merged weights."""

    rank: int = Field(default=16, ge=1, description="Adapter rank r.")
    alpha: float = Field(default=32.0, gt=0, description="Scale numerator: the adapter's term is (alpha / r) * B A x.")
    dropout: float = Field(
        default=0.0, ge=0.0, lt=1.0, description="Dropout on the adapters' input while training (PEFT's lora_dropout)."
    )
    targets: list[LoraTarget] = Field(
        default_factory=lambda: list(LORA_TARGETS),
        min_length=1,
        description="Megatron's layers to adapt: linear_qkv (HF q/k/v_proj), linear_proj (o_proj), linear_fc1 "
        "(gate/up_proj), linear_fc2 (down_proj) of dense MLPs and shared experts, experts (every routed expert's "
        "fc1 and fc2).",
    )


class MoEConfig(Section):
    """Router settings of mixture-of-experts policies (dense models ignore them), with RL defaults: the engine and the
    trainer must route alike, so nothing moves the routing but the policy gradient through the experts."""

    freeze_router: bool = Field(
        default=True, description="Keep the router weights (and expert bias) fixed during training."
    )
    router_dtype: Literal["fp32", "fp64"] = Field(default="fp32", description="Dtype of the router's logits and top-k.")
    aux_loss_coeff: float = Field(default=0.0, ge=0, description="Load-balancing loss weight; 0 = none (RL default).")
    expert_bias_update_rate: float = Field(
        default=0.0, ge=0, description="DeepSeek-V3 expert-bias balancing rate; 0 = fixed."
    )
    router_replay: Literal["off", "measure", "replay"] = Field(
        default="off",
        description="replay: the engine returns each token's experts and the trainer routes every token to "
        "them (router replay, R3; mrl/model/router_replay.py); measure: the engine returns them, the trainer routes "
        "freshly; both log, every train step and per MoE layer, the fraction of tokens the trainer would route "
        "elsewhere (train/moe_routing_differs/layer_i). The routing comes from vLLM on CUDA (its routed-experts "
        "output) or from the Megatron engine.",
    )

    @field_validator("router_replay", mode="before")
    @classmethod
    def _replay_off(cls, value: Any) -> Any:
        return yaml_off(value)


class OptimizerConfig(Section):
    name: Literal["adam", "adamw"] = Field(
        default="adamw", description="Megatron optimizer (adamw = decoupled weight decay)."
    )
    lr: float = Field(default=1e-6, gt=0, description="Peak learning rate.")
    min_lr: float = Field(default=0.0, ge=0, description="Final learning rate of the decay.")
    weight_decay: float = Field(default=0.01, ge=0, description="Weight decay.")
    adam_beta1: float = Field(default=0.9, ge=0, lt=1, description="Adam beta1.")
    adam_beta2: float = Field(default=0.999, ge=0, lt=1, description="Adam beta2.")
    adam_eps: float = Field(default=1e-8, gt=0, description="Adam epsilon.")
    clip_grad: float = Field(default=1.0, ge=0, description="Global gradient-norm clip; 0 disables.")
    use_distributed_optimizer: bool = Field(
        default=False, description="Shard optimizer state over data-parallel ranks."
    )


class SpeedConfig(Section):
    """Megatron's speed options, each `auto` (on where the hardware and installed kernels support it: CUDA, and for
    the fusion Apex's kernel), `true` (on, or an error that says what is missing) or `false`
    (`mrl/policy/speed.py`: what auto becomes, and the wiring each option needs)."""

    gradient_accumulation_fusion: Union[bool, Literal["auto"]] = Field(
        default="auto",
        description="Weight-gradient GEMMs accumulate straight into the fp32 gradient buffer (no bf16 "
        "gradient tensor, no separate add): needs CUDA and Apex's fused_weight_gradient_mlp_cuda, which the "
        "output layer calls even under Transformer Engine.",
    )
    overlap_grad_reduce: Union[bool, Literal["auto"]] = Field(
        default="auto",
        description="Reduce each gradient bucket over data-parallel ranks as soon as the last micro-batch's "
        "backward fills it, while the backward goes on; auto = with CUDA and more than one data-parallel rank.",
    )
    overlap_param_gather: Union[bool, Literal["auto"]] = Field(
        default="auto",
        description="With the distributed optimizer: gather the updated weight shards during the next "
        "forward instead of after the optimizer step (a refit or a save completes the gather first); auto = with "
        "CUDA, optimizer.use_distributed_optimizer and more than one data-parallel rank.",
    )
    grouped_expert_gemm: Union[bool, Literal["auto"]] = Field(
        default="auto",
        description="Mixture-of-experts models: a rank's routed experts run as one grouped GEMM per linear "
        "(torch._grouped_mm) instead of a loop of two GEMMs per expert, with the same parameters "
        "(mrl/model/grouped_experts.py), with or without Transformer Engine; auto = with CUDA. "
        "Dense models ignore it.",
    )
    compiled_fusions: Union[bool, Literal["auto"]] = Field(
        default="auto",
        description="Without Transformer Engine: SwiGLU and RoPE as kernels torch.compile generates "
        "(megatron-core's SwiGLU fusion and mrl/model/compiled_kernels.py's RoPE, one kernel each way instead of "
        "several elementwise passes; the first step compiles them); auto = with CUDA. Transformer Engine's own "
        "fused kernels are used where it is installed; true on CPU compiles with inductor's C++ backend.",
    )

    @field_validator(
        "gradient_accumulation_fusion",
        "overlap_grad_reduce",
        "overlap_param_gather",
        "grouped_expert_gemm",
        "compiled_fusions",
        mode="before",
    )
    @classmethod
    def _switch(cls, value: Any, info: Any) -> Any:
        if value == "auto" or isinstance(value, bool):
            return value
        raise ConfigError(
            "not a switch",
            key=f"policy.speed.{info.field_name}",
            given=value,
            allowed="auto, true or false",
            fix="leave it at auto (on where the hardware supports it) or set true or false",
        )


class SchedulerConfig(Section):
    style: Literal["constant", "cosine", "linear"] = Field(default="constant", description="LR decay after warm-up.")
    warmup_steps: int = Field(default=0, ge=0, description="Linear warm-up steps from 0 to optimizer.lr.")
    decay_steps: Optional[int] = Field(default=None, ge=1, description="Steps of decay; None = the run's max steps.")


def _budget(section: str, tokens: int, logprob_tokens: Optional[int], logprob: bool) -> tuple[str, int]:
    if logprob and logprob_tokens is not None:
        return f"policy.{section}.logprob_tokens_per_microbatch", logprob_tokens
    return f"policy.{section}.tokens_per_microbatch", tokens


_LOGPROB_BUDGET = (
    "Token budget of one micro-batch of a logprob pass (the old policy's and the reference's): forward only, "
    "nothing is kept for a backward, so it may exceed the training budget; null = tokens_per_microbatch."
)


class PackingConfig(Section):
    enabled: bool = Field(
        default=False, description="Pack sequences into micro-batches of a token budget (THD layout)."
    )
    tokens_per_microbatch: int = Field(default=4096, ge=1, description="Token budget of one packed micro-batch.")
    logprob_tokens_per_microbatch: Optional[int] = Field(default=None, ge=1, description=_LOGPROB_BUDGET)

    def budget(self, *, logprob: bool = False) -> tuple[str, int]:
        """(its key, the tokens) of a training micro-batch's budget, or of a logprob pass's."""
        return _budget("sequence_packing", self.tokens_per_microbatch, self.logprob_tokens_per_microbatch, logprob)


class DynamicBatchingConfig(Section):
    enabled: bool = Field(default=False, description="Size micro-batches by a token budget (padded, no packing).")
    tokens_per_microbatch: int = Field(default=4096, ge=1, description="Token budget of one micro-batch.")
    logprob_tokens_per_microbatch: Optional[int] = Field(default=None, ge=1, description=_LOGPROB_BUDGET)

    def budget(self, *, logprob: bool = False) -> tuple[str, int]:
        """(its key, the tokens) of a training micro-batch's budget, or of a logprob pass's."""
        return _budget("dynamic_batching", self.tokens_per_microbatch, self.logprob_tokens_per_microbatch, logprob)


class OffloadConfig(Section):
    """What each policy rank moves to host memory before a colocated engine wakes (`Policy.release_memory`) and takes
    back when it next computes (train, logprobs, refit, save); the CUDA cache is emptied either way; on CPU nothing
    moves. Why the defaults fit DeepScaleR 8K on one 80 GB GPU: README, "Memory on a shared GPU"."""

    optimizer_states: bool = Field(
        default=True,
        description="Adam's two moments and the fp32 main weights of bf16 training "
        "(12 B per parameter, per data-parallel shard with the distributed optimizer); "
        "copied to pinned host memory and back, bit for bit.",
    )
    gradients: bool = Field(
        default=True,
        description="Free the fp32 gradient buffers (4 B per parameter); not copied: every "
        "step zeroes them before its first backward.",
    )
    weights: bool = Field(
        default=False,
        description="Also the model weights (2 B per parameter in bf16); a refit's export "
        "and a logprob pass bring them back, so release again after the refit.",
    )


class PolicyConfig(Section):
    model_name: Optional[str] = Field(
        default=None,
        description="HF model folder (config.json + safetensors + tokenizer), "
        "a hub id (org/name[@revision], fetched into the HF cache before the run, "
        "read from it with HF_HUB_OFFLINE=1), or a Megatron checkpoint folder (`mrl "
        "convert hf-to-megatron` output, a training step_N/ or final_megatron/): "
        "loaded in any parallel layout.",
    )
    tokenizer: Optional[str] = Field(default=None, description="Tokenizer folder or hub id; None = model_name's.")
    build: Optional[ModelBuildConfig] = Field(
        default=None, description="Build a random model instead of loading model_name."
    )
    precision: Literal["float32", "bfloat16"] = Field(
        default="bfloat16", description="Parameter/compute dtype (fp32 on CPU)."
    )
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    train_global_batch_size: int = Field(default=256, ge=1, description="Sequences per optimizer step (all DP ranks).")
    train_micro_batch_size: int = Field(
        default=4, ge=1, description="Sequences per forward/backward micro-batch per rank."
    )
    logprob_micro_batch_size: int = Field(
        default=8, ge=1, description="Sequences per micro-batch when computing logprobs."
    )
    logprob_chunk_tokens: int = Field(
        default=1024,
        ge=1,
        description="Tokens whose fp32 logits the log-softmax holds at once "
        "(forward and backward); the full [tokens, vocabulary] fp32 copy never exists.",
    )
    max_total_sequence_length: int = Field(default=4096, ge=2, description="Prompt + response tokens, at most.")
    activation_checkpointing: bool = Field(default=False, description="Recompute activations in the backward pass.")
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    speed: SpeedConfig = Field(
        default_factory=SpeedConfig,
        description="Megatron's speed options (on by default where the hardware supports them).",
    )
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    sequence_packing: PackingConfig = Field(default_factory=PackingConfig)
    dynamic_batching: DynamicBatchingConfig = Field(default_factory=DynamicBatchingConfig)
    offload_reference: bool = Field(
        default=False, description="Keep the frozen reference model in CPU memory between uses (GPU)."
    )
    offload_when_generating: OffloadConfig = Field(
        default_factory=OffloadConfig, description="What moves to host memory while a colocated engine generates."
    )
    moe: MoEConfig = Field(default_factory=MoEConfig)
    lora: Optional[LoraConfig] = Field(
        default=None, description="Train low-rank adapters instead of every parameter; None = full fine-tuning."
    )
    max_nonfinite_steps: int = Field(
        default=3,
        ge=1,
        description="A step whose loss or gradients are not finite is skipped "
        "(no update; GRPO does not refit the engine); this many such steps in a row "
        "stop the run (exit 3) before anything more is saved.",
    )


# -------------------------------------------------------------------------------------------------------- generation
#: Decides `generation.vllm.enforce_eager` where the key is null (the test suite sets 1: its engines live seconds).
ENFORCE_EAGER_ENV = "MRL_VLLM_ENFORCE_EAGER"


class VllmConfig(Section):
    tensor_parallel_size: int = Field(default=1, ge=1, description="vLLM tensor parallel size of each engine.")
    pipeline_parallel_size: int = Field(
        default=1,
        ge=1,
        description="vLLM pipeline stages of each engine (its layers split in that many parts, each on "
        "tensor_parallel_size GPUs of one node): an engine of more GPUs than a node has, e.g. "
        "TP 8 x PP 4 over 4 nodes; needs a colocated engine on GPUs.",
    )
    gpu_memory_utilization: float = Field(default=0.6, gt=0, le=1, description="Fraction of GPU memory vLLM may take.")
    kv_cache_gib: float = Field(default=1.0, gt=0, description="KV cache size on CPU (VLLM_CPU_KVCACHE_SPACE).")
    enforce_eager: Optional[bool] = Field(
        default=None,
        description="Skip vLLM's compilation of the model (torch.compile) and, on GPUs, its CUDA graph capture: "
        "a faster start, a slower decode; an engine in the engine actor's own process (no multiprocessing, one "
        "worker) then runs vLLM's compiled helpers eagerly too. None: $MRL_VLLM_ENFORCE_EAGER where it is set (1 or 0; "
        "the test suite sets 1, its engines live seconds), else false, vLLM's own default: each start compiles "
        "(faster with vLLM's compile cache warm), which a few hundred steps of a small model do not win back, so the "
        "tiny CPU recipes set true (the costs: docs/measurements.md).",
    )
    max_model_len: Optional[int] = Field(
        default=None, ge=2, description="Engine context length; None = policy max length."
    )

    def eager(self) -> bool:
        """`enforce_eager` resolved: the key where given, else $MRL_VLLM_ENFORCE_EAGER, else vLLM's default (false)."""
        if self.enforce_eager is not None:
            return self.enforce_eager
        given = os.environ.get(ENFORCE_EAGER_ENV)
        if given is None:
            return False
        if given not in ("0", "1"):
            raise ConfigError(
                f"${ENFORCE_EAGER_ENV} decides it (the key is null) and is neither 1 nor 0",
                key="generation.vllm.enforce_eager",
                given=given,
                allowed="1 (eager) or 0 (compiled)",
                fix=f"unset ${ENFORCE_EAGER_ENV}, set it to 1 or 0, or set the key itself",
            )
        return given == "1"

    @model_validator(mode="after")
    def _check_eager_env(self) -> "VllmConfig":
        self.eager()  # a malformed $MRL_VLLM_ENFORCE_EAGER stops the run when its config loads
        return self


class MegatronGenerationConfig(Section):
    engine: Literal["static", "dynamic"] = Field(
        default="static",
        description="The Megatron backend's loop (generation.backend=megatron): static, Megatron's static batches of "
        "similar prompt lengths; dynamic, its dynamic engine (in-flight batching over a paged KV cache; no "
        "multi-latent attention yet).",
    )
    kv_block_tokens: int = Field(
        default=256,
        ge=1,
        description="Tokens per block of the dynamic engine's paged KV cache (flash-attn's paged kernels want a "
        "multiple of 256 on GPUs).",
    )


class GenerationConfig(Section):
    backend: Literal["vllm", "megatron"] = Field(default="vllm", description="Rollout engine.")
    colocated: bool = Field(
        default=True, description="Engine shares the policy's devices (memory handed over around refit)."
    )
    num_devices: Optional[int] = Field(default=None, ge=1, description="Devices of the engine when not colocated.")
    temperature: float = Field(default=1.0, ge=0, description="Sampling temperature (0 = greedy).")
    top_p: float = Field(default=1.0, gt=0, le=1, description="Nucleus sampling mass.")
    top_k: Optional[int] = Field(default=None, ge=1, description="Top-k sampling; None = off.")
    max_new_tokens: int = Field(default=512, ge=1, description="Response tokens at most.")
    stop_token_ids: list[int] = Field(
        default_factory=list, description="Extra token ids that end a response (EOS always does)."
    )
    stop_strings: list[str] = Field(default_factory=list, description="Strings that end a response.")
    overlong_prompt: Literal["truncate", "reject"] = Field(
        default="reject", description="What to do with a prompt that does not fit."
    )
    refit_bucket_mb: int = Field(
        default=256,
        ge=1,
        description="Most MiB of HF tensors per refit bucket, a bound on every policy rank: a layer larger than "
        "this is cut into several buckets (the engine loads them in one reload session), only "
        "a single tensor larger than this goes alone; extra memory per policy rank is about "
        "one bucket plus one parameter in flight, plus the transport's slots.",
    )
    seeded_sampling: Optional[bool] = Field(
        default=None,
        description="Seed every request (prompt i, sample k: seed + i * n + k): reproducible samples, an exact "
        "resume. On GPUs seeded requests leave vLLM's fused FlashInfer top-k/top-p sampler (its V1 model "
        "runner even samples them one by one: vllm/v1/sample/ops/topk_topp_sampler.py). None: seeded "
        "where the engine runs on CPU, unseeded on GPUs (not bitwise reproducible there anyway).",
    )
    sleep_level: Literal[1, 2] = Field(
        default=2,
        description="vLLM sleep level of a colocated engine while the policy trains on its rollouts (GPUs; on CPU "
        "the contract alone). 2: the weights are discarded, not copied to host memory and back: the "
        "refit after the step overwrites them all (vLLM's LLM.sleep: level 2 is for updating the "
        "weights), so a step saves two host copies of the model. A step that trains on nothing (no "
        "refit) has the engine refitted before it generates again. 1: weights kept in host memory "
        "(NeMo-RL's choice). Every other sleep (after a validation, at start-up) is level 1, and so is "
        "every sleep of an engine without a policy to refit it (mrl eval, the model server).",
    )
    max_restarts: int = Field(
        default=2,
        ge=0,
        description="vLLM engines that die (a process killed, a crash) are replaced this many times in a run: "
        "new engines on the same devices get the policy's current weights and the interrupted "
        "generation or refit is done again (seeded: the same samples). 0: a death ends the run "
        "(re-running resumes). Not with grpo.max_off_policy_steps=1.",
    )
    vllm: VllmConfig = Field(default_factory=VllmConfig)
    megatron: MegatronGenerationConfig = Field(default_factory=MegatronGenerationConfig)


# ------------------------------------------------------------------------------------------------------- loss, algos
#: GSPO's published clip range (Zheng et al. 2025: left 3e-4, right 4e-4 on the sequence ratio).
GSPO_CLIP = (3e-4, 4e-4)


class LossConfig(Section):
    """The fields of `mrl.objectives.loss.GRPOLoss`, which the GRPO loop builds from this section."""

    clip_low: float = Field(default=0.2, ge=0, lt=1, description="PPO ratio clip below 1 (ratio >= 1 - clip_low).")
    clip_high: float = Field(
        default=0.2, ge=0, description="PPO ratio clip above 1 (ratio <= 1 + clip_high; DAPO clip-higher)."
    )
    dual_clip: Optional[float] = Field(
        default=None, gt=1, description="Dual-clip constant c > 1 for negative advantages; None = off."
    )
    kl_beta: float = Field(
        default=0.0, ge=0, description="Weight of the KL penalty to the reference policy (0 skips the reference)."
    )
    kl_kind: Literal["k1", "k2", "k3"] = Field(default="k3", description="KL estimator.")
    level: Literal["token", "sequence"] = Field(
        default="token", description="Average over all tokens, or per sequence then over sequences."
    )
    importance_sampling: Literal["none", "tis", "icepop"] = Field(
        default="none", description="Engine/trainer mismatch correction."
    )
    is_cap: float = Field(default=2.0, gt=0, description="TIS: importance weights truncated at this value.")
    icepop_low: float = Field(default=0.5, gt=0, description="ICE-POP: tokens with ratio below this are masked.")
    icepop_high: float = Field(default=2.0, gt=0, description="ICE-POP: tokens with ratio above this are masked.")
    ratio_level: Literal["token", "sequence"] = Field(
        default="token",
        description="The importance ratio per token (PPO, GRPO) or per sequence: GSPO, the geometric mean of "
        "a sequence's token ratios, clipped per sequence; needs level: sequence, and GSPO's published clip range is "
        "clip_low 3e-4, clip_high 4e-4.",
    )

    @model_validator(mode="after")
    def _gspo_level(self) -> "LossConfig":
        if self.ratio_level == "sequence" and self.level != "sequence":
            raise ConfigError(
                "GSPO (loss.ratio_level=sequence) averages each sequence's tokens, then the sequences",
                key="loss.level",
                given=self.level,
                allowed="sequence with loss.ratio_level=sequence",
                fix=f"set loss.level=sequence (and GSPO's clip range: loss.clip_low={GSPO_CLIP[0]} "
                f"loss.clip_high={GSPO_CLIP[1]}), or loss.ratio_level=token",
            )
        return self


class GRPOConfig(Section):
    num_prompts_per_step: int = Field(default=32, ge=1, description="Prompts sampled per step.")
    num_generations_per_prompt: int = Field(default=8, ge=1, description="Responses per prompt (the group).")
    max_num_steps: int = Field(default=100, ge=1, description="Training steps of the run.")
    max_num_epochs: int = Field(default=1, ge=1, description="Passes over the prompt set at most.")
    leave_one_out: bool = Field(default=True, description="Baseline = mean of the other samples in the group.")
    normalize_std: bool = Field(
        default=True, description="Divide advantages by the group std (off + no leave-one-out = Dr.GRPO)."
    )
    dynamic_sampling: bool = Field(default=False, description="Drop groups whose rewards are all equal (DAPO).")
    overlong_buffer: int = Field(
        default=0, ge=0, description="DAPO overlong shaping: penalty ramp over the last N tokens; 0 = off."
    )
    overlong_penalty: float = Field(default=1.0, ge=0, description="DAPO overlong shaping: penalty at max length.")
    val_every: int = Field(default=0, ge=0, description="Evaluate every N steps (0 = only at the end).")
    max_env_error_fraction: Optional[float] = Field(
        default=None,
        ge=0,
        le=1,
        description="Stop the run (exit 4, naming the environment and its error) after a step on which an "
        "environment's reward failed on more than this fraction of its samples (a server down or answering garbage, "
        "a verifier timing out); null = never: those samples score 0, are counted, and the run goes on.",
    )
    max_idle_steps: int = Field(
        default=3,
        ge=0,
        description="Stop the run (exit 2, with the cause and the fix) after this "
        "many steps in a row that trained on nothing: every prompt too long, every group's "
        "rewards equal, no sample kept; 0 = warn only. Every such step warns.",
    )
    advantage_estimator: Literal["grpo", "gae"] = Field(
        default="grpo",
        description="grpo: the group-normalised reward on every token; gae: PPO, generalized advantage estimation "
        "with a learned value model (the `ppo` section).",
    )
    max_off_policy_steps: int = Field(
        default=0,
        ge=0,
        le=1,
        description="0: synchronous (on-policy). 1: asynchronous, "
        "generation of step n+1 overlaps training of step n (samples one step stale; "
        "needs loss.importance_sampling and a non-colocated engine).",
    )


class CriticOptimizerConfig(OptimizerConfig):
    """The critic's optimizer: the policy's settings, a larger default learning rate (a fresh score head)."""

    lr: float = Field(default=1e-5, gt=0, description="Peak learning rate.")


class CriticConfig(Section):
    """PPO's value model (`grpo.advantage_estimator: gae`): a Megatron model with a score head read at every token,
    built with the policy's settings except these."""

    model_name: Optional[str] = Field(
        default=None,
        description="A reward model (HF `*ForSequenceClassification` folder, or a Megatron checkpoint of one) to start "
        "from; None: the policy's starting model with a fresh score head (written once to "
        "<run.output_dir>/critic_init).",
    )
    optimizer: CriticOptimizerConfig = Field(
        default_factory=lambda: CriticOptimizerConfig(),
        description="The critic's own optimizer (its own Adam states and LR schedule, the policy's scheduler style).",
    )
    parallel: Optional[ParallelConfig] = Field(
        default=None, description="The critic's own layout on the same devices; None = the policy's."
    )


class PPOConfig(Section):
    """PPO with a learned value model (`grpo.advantage_estimator: gae`; mrl/objectives/ppo.py)."""

    gamma: float = Field(default=1.0, ge=0, le=1, description="GAE discount per response token.")
    lam: float = Field(default=0.95, ge=0, le=1, description="GAE lambda of the policy's advantages.")
    value_lam: Optional[float] = Field(
        default=None,
        ge=0,
        le=1,
        description="GAE lambda of the critic's returns (VAPO's decoupled lambda, typically 1.0); None = lam.",
    )
    kl_coef: float = Field(
        default=0.0,
        ge=0,
        description="KL penalty in the per-token reward, -kl_coef * (log pi_old - log pi_ref); > 0 starts the "
        "reference model.",
    )
    whiten_advantages: bool = Field(default=True, description="Scale the advantages to zero mean, unit variance.")
    value_clip: float = Field(
        default=0.2, gt=0, description="The value loss's clip: V may move this far from the rollout's old value."
    )
    critic_warmup_steps: int = Field(
        default=0, ge=0, description="Steps that train the critic only (the policy and the engine stay as they are)."
    )
    critic: CriticConfig = Field(default_factory=CriticConfig)


class DistillationConfig(Section):
    """On-policy distillation: the student (the policy) samples, a frozen teacher scores its tokens; the per-token
    advantage is kl_weight * (log p_teacher - log p_student) (+ reward_weight * the task's group advantage)."""

    teacher: str = Field(
        ...,
        description="The teacher: an HF model folder, hub id or Megatron checkpoint folder with the student's "
        "tokenizer (checked at the start).",
    )
    kl_weight: float = Field(default=1.0, gt=0, description="Weight of the teacher's per-token signal.")
    reward_weight: float = Field(
        default=0.0,
        ge=0,
        description="Weight of the task reward's GRPO advantage added to every token (0: pure distillation).",
    )
    parallel: Optional[ParallelConfig] = Field(
        default=None, description="The teacher's own layout; None = the policy's."
    )
    num_devices: Optional[int] = Field(
        default=None,
        ge=1,
        description="Devices of the teacher's own (the cluster's last ones; the policy gets fewer); None = on the "
        "policy's devices.",
    )


class SFTConfig(Section):
    max_num_steps: int = Field(default=100, ge=1, description="Optimizer steps.")
    max_num_epochs: int = Field(default=1, ge=1, description="Passes over the data at most.")
    val_every: int = Field(default=0, ge=0, description="Evaluate every N steps (0 = only at the end).")


class DPOConfig(Section):
    """Direct preference optimisation (`mrl dpo`; objective in mrl/objectives/preference.py). Batch sizes in
    `policy.*` count sequences: a pair is two (its chosen and its rejected response, kept in one micro-batch)."""

    loss: Literal["sigmoid", "ipo"] = Field(
        default="sigmoid", description="DPO's -log sigmoid(beta h), or IPO's (h - 1/2beta)^2."
    )
    beta: float = Field(default=0.1, gt=0, description="Strength of the implicit KL anchor to the reference.")
    length_normalize: Optional[bool] = Field(
        default=None, description="Mean instead of sum of response logprobs; None = true for ipo, false for sigmoid."
    )
    sft_weight: float = Field(
        default=0.0, ge=0, description="Weight of an NLL term on the chosen responses (RPO); 0 = off."
    )
    max_num_steps: int = Field(default=100, ge=1, description="Optimizer steps.")
    max_num_epochs: int = Field(default=1, ge=1, description="Passes over the pairs at most.")
    val_every: int = Field(default=0, ge=0, description="Evaluate on data.val every N steps (0 = only at the end).")


class RMConfig(Section):
    """Reward-model training (`mrl rm`): a score head on the last token, Bradley-Terry loss on pairs. Batch sizes in
    `policy.*` count sequences (two per pair)."""

    max_num_steps: int = Field(default=100, ge=1, description="Optimizer steps.")
    max_num_epochs: int = Field(default=1, ge=1, description="Passes over the pairs at most.")
    val_every: int = Field(default=0, ge=0, description="Evaluate on data.val every N steps (0 = only at the end).")


class EvalConfig(Section):
    data: Optional[str] = Field(
        default=None,
        description="Problems and answers: a jsonl/json/parquet file, a dataset folder "
        "or a hub dataset id (its test split).",
    )
    num_samples: int = Field(default=1, ge=1, description="Samples per problem (k).")
    pass_k: list[int] = Field(
        default_factory=lambda: [1], description="k values reported as pass@k (each <= num_samples)."
    )
    temperature: float = Field(default=0.0, ge=0, description="Sampling temperature of evaluation.")
    max_problems: Optional[int] = Field(default=None, ge=1, description="Evaluate at most this many problems.")


# ------------------------------------------------------------------------------------------------ data, environment
class ArithTaskConfig(Section):
    """The synthetic two-digit addition task of the embedded CPU recipe."""

    digits: int = Field(default=2, ge=1, le=4, description="Digits per operand.")
    num_heldout: int = Field(default=200, ge=1, description="Pairs held out for evaluation, never trained on.")
    near_miss_fraction: float = Field(
        default=0.5, ge=0, le=1, description="SFT labels replaced by a near miss (a+b +-1/2)."
    )
    label_offset: int = Field(
        default=0,
        ge=-2,
        le=2,
        description="A systematic error in the SFT labels (a+b+offset) and the "
        "rejected answer of preference pairs (0: near misses are rejected).",
    )
    context_examples: int = Field(
        default=0,
        ge=0,
        description="Solved training pairs placed before every prompt "
        '("12+30=42 05+17=22 37+05="): 9 tokens each at 2 digits, a long-prompt variant of '
        "the task for long-context recipes.",
    )


class ReasoningGymSourceConfig(Section):
    """Rows generated by reasoning-gym's procedural tasks (`pip install mrl[reasoning-gym]`, in the CPU lock): each
    row scored by its task's own scorer (`envs.NAME.kind: reasoning_gym`)."""

    tasks: dict[str, float] = Field(
        ...,
        description="Task name -> weight (reasoning-gym's names: basic_arithmetic, chain_sum, gcd, ...); a row's "
        "task is drawn by weight.",
    )
    size: int = Field(default=1000, ge=1, description="Training rows generated.")
    val_size: int = Field(
        default=100,
        ge=0,
        description="Validation rows generated (another seed; any also among the training rows dropped).",
    )
    seed: int = Field(default=0, description="The rows' seed: the same seed, tasks and configs give the same rows.")
    config: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="Task name -> its reasoning-gym config fields (e.g. basic_arithmetic: {max_digits: 1}).",
    )
    prompt_key: str = Field(
        default="question",
        description="What the prompt is: the row's question, or a field of its metadata (e.g. expression: "
        "basic_arithmetic's bare `4 + 3`, for a tokenizer without letters).",
    )


class DataSourceConfig(Section):
    """One dataset of a run with several environments (`data.sources`): its rows, the environment in `envs` that
    scores them, and its share of the training prompts."""

    env: Optional[str] = Field(
        default=None,
        description="The environment (a name in `envs`) that scores this source's samples; None: each row names its "
        "own in the column data.env_key.",
    )
    weight: float = Field(
        default=1.0, ge=0, description="Share of the training prompts: weight / the sum of the sources' weights."
    )
    train: Optional[str] = Field(default=None, description="Training prompts (the forms of data.train).")
    val: Optional[str] = Field(default=None, description="Validation prompts (the forms of data.val).")
    arith: Optional[ArithTaskConfig] = Field(
        default=None, description="The synthetic arithmetic task instead of files (its held-out pairs validate)."
    )
    reasoning_gym: Optional[ReasoningGymSourceConfig] = Field(
        default=None, description="Rows generated by reasoning-gym's tasks instead of files."
    )
    problem_key: Optional[str] = Field(default=None, description="Column of the problem text (default data's).")
    answer_key: Optional[str] = Field(default=None, description="Column of the gold answer (default data's).")
    instruction: Optional[str] = Field(
        default=None,
        description="Appended to each of this source's problems (default data.instruction; generated rows: none).",
    )


class DataConfig(Section):
    train: Optional[str] = Field(
        default=None,
        description="Training prompts: a jsonl/json/parquet file, a dataset folder, or "
        "a hub dataset id (org/name[@revision]; its train split).",
    )
    val: Optional[str] = Field(
        default=None,
        description="Validation prompts, same forms (a hub dataset's test split, else "
        "its validation split, else its only one).",
    )
    problem_key: str = Field(default="problem", description="Column holding the problem text.")
    answer_key: str = Field(default="answer", description="Column holding the gold answer.")
    prompt_template: Literal["chat", "plain"] = Field(
        default="chat", description="Tokenizer chat template, or plain text."
    )
    instruction: str = Field(
        default="Let's think step by step and output the final answer within \\boxed{}.",
        description="Appended to each problem.",
    )
    max_prompt_length: Optional[int] = Field(default=None, ge=1, description="Prompt tokens at most; None = no limit.")
    arith: Optional[ArithTaskConfig] = Field(
        default=None, description="Use the synthetic arithmetic task instead of files."
    )
    env_key: str = Field(
        default="env", description="Column naming a row's environment (rows of a source without `env`)."
    )
    sources: list[DataSourceConfig] = Field(
        default_factory=list,
        description="Several datasets, each scored by its own environment of `envs` and drawn by weight (instead "
        "of data.train, data.val and data.arith, and of `env`).",
    )


class RewardModelEnvConfig(Section):
    """A trained reward model (`*ForSequenceClassification`, e.g. `mrl rm`'s final export) scoring rollouts,
    served by its own Megatron worker group."""

    model: str = Field(
        ...,
        description="Reward model: an HF folder (config.json + safetensors + tokenizer), a hub "
        "id (org/name[@revision]) or a Megatron checkpoint folder.",
    )
    weight: float = Field(default=1.0, description="Reward += weight * the model's score.")
    verifier_weight: float = Field(
        default=0.0,
        description="Reward += verifier_weight * the task verifier's 0/1 score "
        "(env.kind's math or arith check); 0 = the reward model alone.",
    )


class ServerEnvConfig(Section):
    """A resource server (mrl/environments/servers) played in multi-turn episodes by the agent loop
    (mrl/algorithms/agent.py): one of mrl's examples started by the run, or a server already running at `url`."""

    example: Optional[Literal["guess_number", "calculator"]] = Field(
        default=None, description="Start this example server on loopback for the run."
    )
    url: Optional[str] = Field(default=None, description="Base URL of a running resource server (when no example).")
    tool_format: Literal["json", "bare"] = Field(
        default="json",
        description="How a turn becomes a tool call: <tool_call>{json}</tool_call>, or the bare text as one argument.",
    )
    tool: Optional[str] = Field(default=None, description="bare: the tool every turn calls.")
    argument: Optional[str] = Field(default=None, description="bare: the argument the turn's text fills.")
    opening_observation: bool = Field(
        default=True, description="Show the server's opening observation (from /seed_session) after the prompt."
    )
    max_turns: int = Field(default=4, ge=1, description="Model turns per episode at most.")
    max_turn_tokens: int = Field(default=16, ge=1, description="Tokens of one model turn at most.")
    max_total_tokens: int = Field(default=256, ge=2, description="Tokens of a whole episode at most.")
    timeout_s: float = Field(default=10.0, gt=0, description="Timeout of each HTTP call to the server.")


class NemoGymEnvConfig(Section):
    """A NeMo Gym resource server (nemo-gym's `resources_servers/<server>`) that the run starts from NeMo Gym's own
    virtual environment (`make gym-venv`) and stops at its end, or one already running at `url`; its episodes are
    played by the agent loop in NeMo Gym's request and response formats (mrl/environments/nemo_gym)."""

    server: str = Field(
        ..., description="The server: a folder of NeMo Gym's resources_servers (e.g. workplace_assistant)."
    )
    name: Optional[str] = Field(default=None, description="Its instance name (NeMo Gym's config key); default: server.")
    config: dict[str, Any] = Field(
        default_factory=dict,
        description="Fields of the server's config over those of its shipped configs/<server>.yaml.",
    )
    url: Optional[str] = Field(default=None, description="Base URL of a NeMo Gym server already running (not started).")
    start_timeout_s: float = Field(default=120.0, gt=0, description="Seconds the server may take to answer GET /.")
    max_turns: int = Field(default=6, ge=1, description="Model turns per episode at most (NeMo Gym's max_steps).")
    max_turn_tokens: int = Field(default=256, ge=1, description="Tokens of one model turn at most.")
    max_total_tokens: int = Field(default=4096, ge=2, description="Tokens of a whole episode at most.")
    timeout_s: float = Field(default=30.0, gt=0, description="Timeout of each HTTP call to the server.")


class CodeEnvConfig(Section):
    """Programs from the responses run with each row's tests in a sandbox (mrl/environments/code): no network, a
    read-only minimal file system, a private scratch folder, and the limits below (at a limit the whole process tree
    is killed)."""

    sandbox: Literal["bwrap", "none"] = Field(
        default="bwrap",
        description="bwrap: bubblewrap with every namespace unshared (the run refuses to start without it); none: "
        "rlimits only, no isolation (warned at every start: only for code you trust).",
    )
    partial_credit: bool = Field(
        default=False, description="Reward the fraction of tests passed (false: 1 only when every test passes)."
    )
    workers: int = Field(default=4, ge=1, le=127, description="Samples run at once (each in a sandbox of its own).")
    wall_s: float = Field(default=10.0, gt=0, description="Wall-clock seconds per sample (its tests included).")
    cpu_s: int = Field(default=10, ge=1, description="CPU seconds per process.")
    memory_mb: int = Field(default=1024, ge=64, description="Address space per process, MiB.")
    processes: int = Field(default=32, ge=4, description="Processes (and threads) of a sample at once.")
    open_files: int = Field(default=64, ge=16, description="Open files per process.")
    output_kb: int = Field(default=1024, ge=1, description="Output (stdout, stderr, any file written) per stream, KiB.")
    scratch_mb: int = Field(default=64, ge=1, description="The program's writable folder (a tmpfs), MiB.")
    case_timeout_s: float = Field(default=5.0, gt=0, description="stdin/stdout cases: seconds per case.")


class EnvConfig(Section):
    kind: Literal["math", "arith", "reasoning_gym", "code", "server", "nemo_gym"] = Field(
        default="math",
        description="Reward environment (the verifier; reasoning_gym: each row's task's own scorer; code: the "
        "response's program run with the row's tests in a sandbox), or a resource server played in multi-turn "
        "episodes (server: mrl's protocol; nemo_gym: a NeMo Gym server).",
    )
    partial_credit: bool = Field(
        default=True,
        description="reasoning_gym: the scorer's partial credit as the reward (false: 1 for full credit, else 0; "
        "some tasks give a part of a point to an answer that merely contains the gold one).",
    )
    num_workers: int = Field(default=2, ge=1, description="Verifier actors.")
    timeout_s: float = Field(default=10.0, gt=0, description="Per-sample verifier timeout; a timeout scores 0.")
    reward_model: Optional[RewardModelEnvConfig] = Field(
        default=None,
        description="Score rollouts with a trained reward model (combined with the verifier by the weights).",
    )
    server: Optional[ServerEnvConfig] = Field(
        default=None, description="kind=server: the resource server and the agent loop's settings."
    )
    nemo_gym: Optional[NemoGymEnvConfig] = Field(
        default=None, description="kind=nemo_gym: the NeMo Gym server and the agent loop's settings."
    )
    code: Optional[CodeEnvConfig] = Field(
        default=None, description="kind=code: the sandbox and its limits (None: the defaults)."
    )


# ----------------------------------------------------------------------------------------------- checkpoint, logger
class CheckpointConfig(Section):
    enabled: bool = Field(default=True, description="Write checkpoints.")
    dir: str = Field(default="${run.output_dir}/checkpoints", description="Checkpoint folder (step_N/ inside).")
    save_every: int = Field(default=10, ge=1, description="Save every N steps (and at the end, and on SIGTERM).")
    keep_last: int = Field(default=2, ge=1, description="Keep the newest N checkpoints.")
    keep_best: int = Field(default=0, ge=0, description="Also keep the best N by `metric`.")
    metric: str = Field(default="val/accuracy", description="Metric ranking the best checkpoints.")
    higher_is_better: bool = Field(default=True, description="Direction of `metric`.")
    resume: bool = Field(default=True, description="Resume from the newest complete checkpoint when there is one.")


class WandbConfig(Section):
    enabled: bool = Field(default=False, description="Log to Weights & Biases (needs `pip install wandb`).")
    project: str = Field(default="mrl", description="W&B project.")
    entity: Optional[str] = Field(default=None, description="W&B entity (team).")


class LoggerConfig(Section):
    log_dir: str = Field(
        default="${run.output_dir}/logs", description="Folder of metrics.jsonl and TensorBoard events."
    )
    console: bool = Field(default=True, description="Progress bar (TTY) or one line per `log_every` steps (not a TTY).")
    log_every: int = Field(default=1, ge=1, description="Console line every N steps when not a TTY.")
    jsonl: bool = Field(default=True, description="Write metrics.jsonl.")
    tensorboard: bool = Field(default=True, description="Write TensorBoard event files.")
    wandb: WandbConfig = Field(default_factory=WandbConfig)


# ------------------------------------------------------------------------------------------------------------ stages
class StageConfig(Section):
    name: str = Field(..., description="Stage name (folder under run.output_dir).")
    algorithm: Literal["sft", "dpo", "rm", "grpo", "eval"] = Field(..., description="What the stage runs.")
    config: Optional[str] = Field(
        default=None,
        description="The stage's recipe file, relative to the staged recipe; None = the staged recipe itself.",
    )
    overrides: list[str] = Field(default_factory=list, description="Overrides applied to the recipe for this stage.")
    init_from_previous: bool = Field(default=True, description="Start from the previous stage's final checkpoint.")
    init_from: Optional[str] = Field(
        default=None,
        description="Start from this earlier stage's final checkpoint instead of "
        "the previous one's (e.g. GRPO from the SFT stage, not the reward model).",
    )
    reward_model_from: Optional[str] = Field(
        default=None,
        description="Serve this earlier stage's final checkpoint (an `rm` stage) as env.reward_model.model.",
    )
    teacher_from: Optional[str] = Field(
        default=None,
        description="Distil from this earlier stage's final checkpoint (distillation.teacher).",
    )


# ------------------------------------------------------------------------------------------------------------ expect
class FigureBound(Section):
    """The bound one figure of a finished run must hold (`mrl check`): a `min`, a `max` or both, inclusive."""

    min: Optional[float] = Field(default=None, description="The least value the figure may take (inclusive).")
    max: Optional[float] = Field(default=None, description="The largest value the figure may take (inclusive).")

    @model_validator(mode="after")
    def _some_bound(self) -> "FigureBound":
        if self.min is None and self.max is None:
            raise ValueError("a figure needs a min, a max or both (e.g. {min: 0.5})")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"min {self.min} is above max {self.max}")
        return self


class ExpectConfig(Section):
    """The figures a run of this recipe should end with, checked by `mrl check RUN_DIR RECIPE` (mrl/app/check.py)."""

    verified: bool = Field(
        default=False,
        description="True once a run of this recipe gave these figures; false: taken from the plan and the peers' "
        "published runs, not yet confirmed.",
    )
    source: str = Field(default="", description="Where the figures come from (a measurement, a paper, a run).")
    figures: dict[str, FigureBound] = Field(
        default_factory=dict,
        description="Figure -> bound. A figure is a dotted path into the run's summary.json (a staged run's opens "
        "with the stage: grpo.val_accuracy_after) or the difference of two (grpo.reward_last10 - "
        "grpo.reward_first10).",
    )


# -------------------------------------------------------------------------------------------------------------- root
class MrlConfig(Section):
    run: RunConfig = Field(default_factory=RunConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    ppo: PPOConfig = Field(default_factory=PPOConfig)
    distillation: Optional[DistillationConfig] = Field(
        default=None, description="On-policy distillation from a frozen teacher (GRPO's loop; None = off)."
    )
    dpo: DPOConfig = Field(default_factory=DPOConfig)
    rm: RMConfig = Field(default_factory=RMConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    envs: dict[str, EnvConfig] = Field(
        default_factory=dict,
        description="Named environments of a run with several, each a mapping with the keys of `env` "
        "(`data.sources` names one for each dataset); empty: the one `env`.",
    )
    checkpointing: CheckpointConfig = Field(default_factory=CheckpointConfig)
    logger: LoggerConfig = Field(default_factory=LoggerConfig)
    stages: list[StageConfig] = Field(
        default_factory=list, description="Staged recipe: run these in order (`mrl run`)."
    )
    expect: Optional[ExpectConfig] = Field(
        default=None, description="The figures a finished run should show (`mrl check RUN_DIR RECIPE`)."
    )

    @model_validator(mode="after")
    def _cross_checks(self) -> "MrlConfig":
        problems = cross_field_problems(self)
        if problems:
            raise ConfigError("", problems=problems)
        return self

    # Derived sizes (read-only, not settable from YAML).
    @property
    def policy_world_size(self) -> int:
        """The devices left to the policy: all but a non-colocated engine's and a teacher's own."""
        total = self.cluster.num_nodes * self.cluster.devices_per_node - self.teacher_devices
        if self.generation.colocated or self.generation.num_devices is None:
            return total
        return total - self.generation.num_devices

    @property
    def teacher_devices(self) -> int:
        """Devices of distillation's teacher of its own (the cluster's last ones); 0 when it shares the policy's."""
        return (self.distillation.num_devices or 0) if self.distillation is not None else 0

    @property
    def data_parallel_size(self) -> int:
        p = self.policy.parallel
        return self.policy_world_size // (p.tensor_parallel_size * p.pipeline_parallel_size * p.context_parallel_size)
