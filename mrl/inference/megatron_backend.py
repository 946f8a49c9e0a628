"""Megatron-Core generation backend: Megatron's inference on token ids, refit with HF tensors.

The engine runs the policy architecture itself (a HybridModel built from the HF folder, mrl/model/build.py), in this
process, at TP1. It is the rollout engine for setups without vLLM, and a second, independent implementation to
check vLLM against. It drives one of two Megatron loops (`MegatronEngineConfig.engine`): the static-batch loop
described below (the default), or Megatron's dynamic engine, in-flight batching over a paged KV cache, which
megatron-core 0.19 recommends (mrl/inference/megatron_dynamic.py; the same sampler, stop set, vocabulary mask and
refit). Both run on CPU with `mrl.cpu`'s patches.

Generation data flow (static loop):
    prompts (token ids) --fit_prompts--> kept prompts --x n--> rows, prompt-major (row i * n + k)
    --sorted by prompt length, cut into static batches of `max_batch_size` rows--> Megatron's static-batch loop
      (`TextGenerationController.generate_all_output_tokens_static_batch`: one prefill up to the batch's shortest
      prompt, then one KV-cached step per token for every row) --> tokens, logprobs per row, back in row order
    --> cut after the first stop token --> GeneratedSample.
We call that loop directly: `StaticInferenceEngine(legacy=True)` only adds a FIFO scheduler that keeps every
finished request, a progress bar, and a reseed of torch's global generator on every call (which would reset the
random stream of a trainer in the same process).

What mrl adds around Megatron's engine (each difference was found against an HF transformers forward):
- Vocabulary padding: Megatron pads the vocabulary (500 -> 512 for the tiny test model); the padded output rows are
  zero, so their logits are 0, not -inf, and Megatron's `log_softmax` over the padded vocabulary puts mass on them
  (logprobs off by ~1e-2 on the tiny model) and can sample them. `_UnpaddedLogitsWrapper` sets them to -inf.
- Stop tokens: Megatron ends a row on one termination id and drops the stop token from the response;
  `_StopSetController` ends rows on any of EOS + `stop_token_ids` and keeps the stop token (as vLLM does).
- Sampling: Megatron refuses top-k together with top-p; `_StopSetController` samples (its `sample_from_logits`)
  with temperature, then top-k, then top-p (vLLM's order), from its own generator, reseeded per call when
  `SamplingConfig.seed` is set. Logprobs are always those of the raw (temperature 1, unfiltered) distribution,
  like vLLM's `raw_logprobs`.
- Decode attention: on KV-cached decode steps Megatron passes `attn_mask_type=no_mask` to the core attention (one
  query, the newest token, sees every cached key); `TorchCoreAttention` honours the per-call mask type (with a
  causal mask the query sat at position 0 and saw only the first key: logprobs off by ~3 nats).
- CPU: the static controller creates `.cuda()` tensors (`megatron_patches.static_inference_cuda_tensors_on_cpu`).

Seeds: the static engine samples a whole batch from one generator, so `SamplingConfig.seed` seeds that generator
once per `generate` call: the same call reproduces its samples, but the streams are not vLLM's per-sample streams.

Refit: the engine is a sink of the one refit loop (mrl/inference/refit.py). It collects the buckets' HF-named
tensors (by reference in-process) and, once the last arrived (`finish_refit`), converts them with the shared
HF -> Megatron mapping (converters/) and copies them into the model's parameters in place. The conversion checks
the full tensor set before anything is copied, so a partial refit raises `RefitError` and leaves the old weights
whole. Peak extra memory: one converted copy of the model (a bucket alone cannot be validated).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.inference.inference_request import InferenceRequest
from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
from megatron.core.inference.sampling_params import SamplingParams
from megatron.core.inference.text_generation_controllers.text_generation_controller import (
    TextGenerationController,
)

from converters import ConversionError, expected_hf_shapes, model_dims
from converters.hf_io import load_hf_config, load_hf_state
from mrl.inference.buckets import NamedTensor
from mrl.inference.interface import FinishReason, GeneratedSample, GenerationOutput, SamplingConfig
from mrl.inference.lifecycle import EngineLifecycle
from mrl.inference.megatron_dynamic import DEFAULT_BLOCK_TOKENS, DynamicLoop
from mrl.inference.megatron_routing import RoutingRecorder, dynamic_token_rows
from mrl.inference.prompt_limits import assemble_output, fit_prompts, max_prompt_tokens
from mrl.inference.refit import LocalWeights, RefitError, RefitStats, refit
from mrl.inference.transports import InProcessTransport, Payload, unpack_payload
from mrl.model.build import build_model, context_length, load_hf_weights, transformer_config_from_hf
from mrl.parallel.groups import init_process_groups
from mrl.parallel.layout import ParallelDims

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
ENGINES = ("static", "dynamic")
#: Refit bucket size of `update_weights`: the whole state in one bucket (it is loaded as one anyway).
_WHOLE_MODEL = 1 << 62


@dataclass(frozen=True)
class MegatronEngineConfig:
    """Settings of one Megatron static-inference engine (TP1, in this process)."""

    model_path: str
    """HF model folder (config.json, safetensors, optional generation_config.json) the engine starts from."""
    load_weights: bool = True
    """False: start from `model_path`'s config alone (random weights); the real ones come by refit before the
    first generation (a run started from a Megatron checkpoint)."""
    max_model_len: Optional[int] = None
    """Engine context: prompt + response tokens; None = the model's (max_position_embeddings, times a rope factor)."""
    max_batch_size: int = 64
    """Rows (prompt x sample) per static batch; the KV cache holds max_batch_size x max_model_len tokens per layer."""
    dtype: str = "float32"
    """Parameter and compute dtype: float32 or bfloat16 (CPU: float32, there are no bf16 units)."""
    seed: int = 0
    """Seed of the sampling generator for calls whose SamplingConfig has no seed."""
    sleep_when_idle: bool = False
    """Colocated with the policy: the life cycle of mrl/inference/lifecycle.py (asleep it gives back the memory the
    allocator caches; its weights stay)."""
    return_routing: bool = False
    """Return each sample's routed experts per MoE layer (router replay, mrl/model/router_replay.py): the engine
    records its routers' top-k on every forward, as vLLM's routed-experts capture does."""
    engine: str = "static"
    """Megatron's loop: "static" (static batches of similar prompt lengths) or "dynamic" (its dynamic engine:
    in-flight batching over a paged KV cache, mrl/inference/megatron_dynamic.py)."""
    kv_block_tokens: int = DEFAULT_BLOCK_TOKENS
    """Tokens per block of the dynamic engine's paged KV cache."""
    compiled_fusions: Optional[bool] = None
    """SwiGLU and RoPE as torch.compile's kernels without Transformer Engine (`policy.speed.compiled_fusions`);
    None: on a GPU where torch.compile works (`transformer_config_from_hf`)."""

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"MegatronEngineConfig.dtype={self.dtype!r}: choose one of {sorted(_DTYPES)}")
        if self.engine not in ENGINES:
            raise ValueError(f"MegatronEngineConfig.engine={self.engine!r}: choose one of {list(ENGINES)}")
        if self.kv_block_tokens < 1:
            raise ValueError(f"MegatronEngineConfig.kv_block_tokens={self.kv_block_tokens}: must be >= 1")
        if self.max_batch_size < 1:
            raise ValueError(f"MegatronEngineConfig.max_batch_size={self.max_batch_size}: must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"MegatronEngineConfig.max_model_len={self.max_model_len}: must be >= 2")


# ------------------------------------------------------------------------------------------------ engine components
class _UnpaddedLogitsWrapper(GPTInferenceWrapper):
    """GPTInferenceWrapper whose logits are -inf on the vocabulary padding (ids >= the tokenizer's vocabulary), and
    which hands each forward's positions to the routing recorder when there is one (router replay)."""

    routing: Optional[RoutingRecorder] = None

    def __init__(self, model: Any, context: Any, vocab_size: int) -> None:
        super().__init__(model, context)
        self.vocab_size = vocab_size

    def run_one_forward_step(self, inference_input, recv_buffer_seq_len=None):
        logits = super().run_one_forward_step(inference_input, recv_buffer_seq_len)  # [b, s, V_padded]
        if logits is not None:
            logits[..., self.vocab_size :] = float("-inf")
        if self.routing is not None:
            context = self.inference_context
            if context.is_static_batching():
                self.routing.collect_batch(inference_input["position_ids"][0])
            else:
                self.routing.collect_tokens(*dynamic_token_rows(context))
        return logits


class _TokenIdTokenizer:
    """The tokenizer surface the controller touches when prompts arrive as token ids: no text at all."""

    eod = 0  # pads the static batch's token tensor; padded positions are always overwritten or never read
    bos = None

    def detokenize(self, ids: Any, **kwargs: Any) -> str:
        return ""


def sample_next_tokens(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, generator: Optional[torch.Generator]
) -> torch.Tensor:
    """One token per row of `logits` [b, V]: greedy at temperature 0, else softmax(logits / T) after top-k, then
    top-p (the smallest set of most likely tokens whose mass reaches top_p); top_k 0 / top_p 1 switch them off."""
    if temperature == 0 or top_k == 1:
        return logits.argmax(dim=-1)
    scaled = logits.float() / temperature  # a copy: the raw logits still give the logprobs
    if 0 < top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[:, -1:]  # [b, 1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)  # [b, V]
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # of the more likely tokens
        drop_sorted = mass_before >= top_p  # the most likely token always stays (its mass_before is 0)
        scaled = scaled.masked_fill(drop_sorted.scatter(1, order, drop_sorted), float("-inf"))
    probs = scaled.softmax(dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).view(-1)


class _StopSetController(TextGenerationController):
    """Megatron's static-batch controller with a stop *set*, the stop token kept, and mrl's sampler."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stop_ids = torch.empty(0, dtype=torch.long)  # [num_stop_ids], set per generate call

    def sample_from_logits(self, last_token_logits, sampling_params, vocab_size=None, **kwargs):
        # megatron-core 0.19.2's static loop samples through this method (top-n logprobs, which mrl never asks
        # for, are its only other work).
        p = sampling_params
        return sample_next_tokens(last_token_logits, p.temperature, p.top_k, p.top_p, self.sampling_rng)

    def update_generation_status(
        self,
        updated_prompts_tokens,
        generation_started,
        current_context_end_position,
        is_generation_done_tensor,
        generated_sequence_lengths,
        termination_id=None,
    ):
        # Megatron's version stops on one id and does not count the stop token; here every row still generating
        # counts this step's token, then rows whose token is in the stop set are done.
        latest = updated_prompts_tokens[:, current_context_end_position]  # [b]
        active = generation_started & ~is_generation_done_tensor
        generated_sequence_lengths += active
        if self.stop_ids.device != latest.device:  # once per call: a host copy per token waits for the device
            self.stop_ids = self.stop_ids.to(latest.device)
        done = is_generation_done_tensor | (active & torch.isin(latest, self.stop_ids))
        return done, generated_sequence_lengths.int()


def eos_token_ids(model_path: str, hf_config: Mapping[str, Any]) -> tuple[int, ...]:
    """EOS ids of the model: config.json's and generation_config.json's `eos_token_id` (an int or a list), merged."""
    ids: list[int] = []
    sources = [hf_config]
    generation_config = Path(model_path) / "generation_config.json"
    if generation_config.is_file():
        sources.append(json.loads(generation_config.read_text()))
    for source in sources:
        value = source.get("eos_token_id")
        ids += [value] if isinstance(value, int) else list(value or [])
    return tuple(dict.fromkeys(int(i) for i in ids))


def _megatron_sampling_params(sampling: SamplingConfig) -> SamplingParams:
    params = SamplingParams(
        temperature=sampling.temperature,
        top_k=sampling.top_k or 0,
        top_p=sampling.top_p,
        return_log_probs=sampling.logprobs,
        num_tokens_to_generate=sampling.max_new_tokens,
    )
    # Megatron's end-of-generation check is replaced by the stop set: never stop on its own termination id.
    params.add_attributes({"no_early_termination": True})
    return params


# ------------------------------------------------------------------------------------------------------- backend
class MegatronBackend:
    """`GenerationBackend` over Megatron's legacy static-batch inference (TP1, this process)."""

    def __init__(self, config: MegatronEngineConfig) -> None:
        self.config = config
        self.hf_config = load_hf_config(config.model_path)
        self.max_model_len = config.max_model_len or context_length(model_dims(self.hf_config))
        self.eos_ids = eos_token_ids(config.model_path, self.hf_config)
        if config.engine == "dynamic" and model_dims(self.hf_config).mla is not None:  # before building the model
            raise ValueError(
                "the Megatron dynamic engine does not run multi-latent attention models yet (its latent KV "
                "cache): use generation.megatron.engine=static for this model"
            )
        self.model = _build_model(self.hf_config, _DTYPES[config.dtype], config.compiled_fusions)
        if config.load_weights:
            self._load(load_hf_state(config.model_path))
        self.vocab_size = int(self.hf_config["vocab_size"])
        context = StaticInferenceContext(config.max_batch_size, self.max_model_len)
        moe = model_dims(self.hf_config).moe
        self.routing: Optional[RoutingRecorder] = None
        if config.return_routing and moe is not None:
            self.routing = RoutingRecorder(self.model, len(moe.layers), self.max_model_len, moe.num_experts, moe.topk)
        wrapper = self._wrapper(context)
        self.controller = _StopSetController(wrapper, _TokenIdTokenizer())
        self.controller.sampling_rng.manual_seed(config.seed)
        self.dynamic: Optional[DynamicLoop] = None
        if config.engine == "dynamic":
            self.dynamic = DynamicLoop(
                self.model,
                self._wrapper,
                _TokenIdTokenizer(),
                sample_next_tokens,
                vocab_size=self.vocab_size,
                max_rows=config.max_batch_size,
                max_model_len=self.max_model_len,
                block_tokens=config.kv_block_tokens,
                seed=config.seed,
                routing=self.routing,
            )
        self._pending: dict[str, torch.Tensor] = {}
        # The same state machine as vLLM's engines; asleep it holds its weights still, and gives back what the
        # allocator caches (the KV context and activations are allocated per generation).
        self.lifecycle = EngineLifecycle("Megatron engine", sleeps=config.sleep_when_idle, sleep=_release_cached_memory)

    def _wrapper(self, context: Any) -> _UnpaddedLogitsWrapper:
        """The inference wrapper of the model over `context` (static or dynamic), recording routing if asked."""
        wrapper = _UnpaddedLogitsWrapper(self.model, context, self.vocab_size)
        wrapper.routing = self.routing
        return wrapper

    # ------------------------------------------------------------------------------------------------ generation
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig) -> GenerationOutput:
        """Sample `sampling.n` responses per prompt; overlong prompts handled per `sampling.overlong_prompt`."""
        self.lifecycle.check_generate()
        if sampling.stop_strings:
            raise ValueError(
                "the Megatron generation backend works on token ids and cannot match stop strings "
                f"{list(sampling.stop_strings)}: use generation.stop_token_ids, or generation.backend=vllm"
            )
        fitted = fit_prompts(
            prompts, max_prompt_tokens(self.max_model_len, sampling.max_new_tokens), sampling.overlong_prompt
        )
        rows = [ids for ids in fitted.token_ids for _ in range(sampling.n)]  # prompt-major
        results = self._run(rows, sampling) if rows else []
        by_prompt = {index: results[j * sampling.n : (j + 1) * sampling.n] for j, index in enumerate(fitted.indices)}
        return assemble_output(
            fitted,
            len(prompts),
            sampling.n,
            by_prompt,
            lambda index, requests, cut: self._prompt_samples(index, requests, sampling, cut),
        )

    def _run(self, rows: list[list[int]], sampling: SamplingConfig) -> list[InferenceRequest]:
        """Megatron's finished requests for `rows`, in row order."""
        from mrl.cpu import megatron_patches

        megatron_patches.apply()  # no-op on GPUs; re-asserts CPU stand-ins a vLLM engine in this process may replace
        stops = () if sampling.ignore_eos else self.eos_ids
        self.controller.stop_ids = torch.tensor(sorted({*stops, *sampling.stop_token_ids}), dtype=torch.long)
        if self.dynamic is not None:
            return self.dynamic.run(rows, sampling, self.controller.stop_ids)
        if sampling.seed is not None:
            self.controller.sampling_rng.manual_seed(sampling.seed)
        params = _megatron_sampling_params(sampling)
        requests = [
            InferenceRequest(request_id=i, prompt="", sampling_params=params, prompt_tokens=list(ids))
            for i, ids in enumerate(rows)
        ]
        # A static batch prefills up to its shortest prompt and feeds the rest one token per step: batch rows of
        # similar length together.
        by_length = sorted(requests, key=lambda r: len(r.prompt_tokens))
        for start in range(0, len(by_length), self.config.max_batch_size):
            batch = by_length[start : start + self.config.max_batch_size]
            if self.routing is not None:
                self.routing.start(len(batch))
            self.controller.generate_all_output_tokens_static_batch(OrderedDict((r.request_id, r) for r in batch))
            if self.routing is not None:  # the tokens the engine fed: the prompt and all but the last sampled token
                for row, request in enumerate(batch):
                    request.routing = self.routing.row(
                        row, len(request.prompt_tokens) + len(request.generated_tokens) - 1
                    )
        return requests

    def _prompt_samples(
        self, index: int, requests: Optional[list[InferenceRequest]], sampling: SamplingConfig, truncated: bool
    ) -> list[GeneratedSample]:
        """The n samples of prompt `index` (None: the prompt was rejected)."""
        if requests is None:
            return [
                GeneratedSample(index, k, [], [], [] if sampling.logprobs else None, FinishReason.ABORTED)
                for k in range(sampling.n)
            ]
        stops = set(self.controller.stop_ids.tolist())
        samples = []
        for k, request in enumerate(requests):
            tokens = [int(t) for t in request.generated_tokens.tolist()]
            logprobs = [float(x) for x in request.generated_log_probs] if sampling.logprobs else None
            reason = FinishReason.STOP if tokens and tokens[-1] in stops else FinishReason.LENGTH
            samples.append(
                GeneratedSample(
                    index,
                    k,
                    list(request.prompt_tokens),
                    tokens,
                    logprobs,
                    reason,
                    truncated,
                    getattr(request, "routing", None),
                )
            )
        return samples

    # ---------------------------------------------------------------------------------------------------- refit
    def update_weights(self, named_tensors: Iterable[NamedTensor] | Mapping[str, torch.Tensor]) -> RefitStats:
        """Copy HF-named tensors (a stream or a state dict, any order) into the model; all of them or none."""
        return refit(LocalWeights(named_tensors), self, InProcessTransport(), bucket_bytes=_WHOLE_MODEL)

    @property
    def expected_names(self) -> frozenset[str]:
        return frozenset(expected_hf_shapes(model_dims(self.hf_config)))

    def load_payload(self, payload: Payload) -> None:
        """Collect one bucket; the model changes only in `finish_refit`, once the state is complete."""
        self.lifecycle.check_load()
        self._pending.update(unpack_payload(payload))

    def finish_refit(self, complete: bool = True) -> None:
        """Load the collected state (all or nothing); after a failed refit drop it and keep the old weights."""
        pending, self._pending = self._pending, {}
        if not complete:
            return
        try:
            self._load(pending)
        except ConversionError as err:
            raise RefitError(f"refit rejected, the engine keeps its previous weights: {err}") from err

    def shutdown(self) -> None:
        """Nothing to stop: the engine lives in this process."""

    def _load(self, hf_state: Mapping[str, torch.Tensor]) -> None:
        with torch.no_grad():
            load_hf_weights(self.model, hf_state, self.hf_config)  # validates every name and shape, then copies

    # ---------------------------------------------------------------------------------------------------- memory
    def prepare_for_refit(self) -> None:
        self.lifecycle.wake_weights()

    def prepare_for_generation(self) -> None:
        self.lifecycle.wake_all()

    def finish_generation(self, refit_follows: bool = False) -> None:
        self.lifecycle.sleep()  # it keeps its weights either way


def _release_cached_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _build_model(hf_config: Mapping[str, Any], dtype: torch.dtype, compiled_fusions: Optional[bool]) -> Any:
    """The model of `hf_config` at TP1 (process groups created if needed), with the KV-cache-aware attention."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        init_process_groups(ParallelDims())
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if (tp, pp) != (1, 1):
        raise ValueError(
            f"the Megatron generation backend runs at TP1/PP1, but this process's groups are "
            f"tp={tp}, pp={pp}: build it in a process of its own"
        )
    config = transformer_config_from_hf(hf_config, params_dtype=dtype, compiled_fusions=compiled_fusions)
    model = build_model(hf_config, config)
    return model.eval()
