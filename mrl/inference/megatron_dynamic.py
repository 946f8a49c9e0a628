"""Megatron's dynamic inference engine as the Megatron backend's loop (`generation.megatron.engine: dynamic`).

Generation data flow (one `run` call, the backend's rows: prompt token ids, prompt-major):
    rows --add_request (one request a row, termination id -1: only the stop set ends a row)--> waiting queue
    --step_modern: the engine admits what its KV blocks and token budget hold, runs one forward over every active
      request's new tokens (a whole prompt, or one decode token), samples with `_MrlSampling`, ends rows whose
      token is in the stop set (`_DynamicStopSetController`) or that reached their length--> finished records
    --merge--> `FinishedRow` (prompt, tokens, logprobs) per row, in row order.

What mrl sets around the engine (megatron-core 0.19.2):
- The KV cache holds every row at once (max_batch_size rows of max_model_len tokens, in blocks of `block_tokens`),
  so no request is paused for lack of blocks; the token budget of a step is one whole prompt at least (no chunked
  prefill). It has a slot per attention layer of the HybridModel, not per layer (`attention_context`).
- Sampling: `_MrlSampling` replaces the controller's sampler with the backend's (`sample_next_tokens`: temperature, then
  top-k, then top-p, vLLM's order) from one generator, reseeded per call when `SamplingConfig.seed` is set; the
  logprobs are the engine's raw ones (temperature 1, unfiltered), as the static loop's and vLLM's `raw_logprobs`.
- The engine marks the whole process as inferring (`InferenceMode`) from its construction or resume until its
  suspension, and a training forward in the same process then fails: `run` suspends it after every call (which also
  frees its KV cache until the next call).
- Refit: the engine computes with the backend's model, whose parameters a refit overwrites in place.
- Router replay: the backend's `RoutingRecorder` (mrl/inference/megatron_routing.py) records each forward's routing
  at each token's request (= row) and position, which the context names; mrl's own capture, not megatron-core's
  (`moe_enable_routing_replay`, which builds routers with its own replay state and keeps the routing in the KV
  blocks), so that the trainer's replay and both loops share one recorder.
- No stack dump on SIGTERM or SIGINT (`mrl.cpu.megatron_dynamic.no_stack_dumps_on_stop_signals`, applied when this
  module is imported).
Not supported yet (refused by `MegatronBackend`): multi-latent attention (its latent cache and decode kernel).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from megatron.core.inference.config import InferenceConfig
from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext
from megatron.core.inference.engines.dynamic_engine import DynamicInferenceEngine
from megatron.core.inference.sampling.torch_sampling import TorchSampling
from megatron.core.inference.sampling_params import SamplingParams
from megatron.core.inference.text_generation_controllers.text_generation_controller import (
    TextGenerationController,
)

from mrl.cpu.megatron_dynamic import no_stack_dumps_on_stop_signals
from mrl.inference.interface import SamplingConfig
from mrl.inference.megatron_routing import RoutingRecorder
from mrl.model import hybrid
from mrl.parallel.devices import current_device

#: KV block of the engine's paged cache, in tokens (flash-attn's paged kernels want a multiple of 256 on GPUs).
DEFAULT_BLOCK_TOKENS = 256


no_stack_dumps_on_stop_signals()  # right after megatron-core registered them (the import above)


@dataclass
class FinishedRow:
    """One row's result, with the attributes the backend reads from Megatron's static requests."""

    prompt_tokens: list[int]
    generated_tokens: torch.Tensor  # [tokens] int64
    generated_log_probs: list[float]
    routing: Optional[torch.Tensor] = None  # [fed tokens, MoE layers, k] when the backend records routing


class _MrlSampling(TorchSampling):
    """The controller's sampler, sampling with mrl's `sample_next_tokens` and the call's settings; it keeps the last
    step's tokens for the stop set."""

    def __init__(self, vocab_size: int, seed: int, sample: Callable[..., torch.Tensor]) -> None:
        # On the device the logits are on (torch.multinomial samples with a generator of its tensor's device), as
        # Megatron's own controller places its sampling generator; TorchSampling keeps it as its `_rng`.
        self.generator = torch.Generator(device=current_device()).manual_seed(seed)
        super().__init__(self.generator, vocab_size)
        self.sample = sample  # (logits [b, V], temperature, top_k, top_p, generator) -> tokens [b]
        self.settings: Optional[SamplingConfig] = None
        self.last = torch.empty(0, dtype=torch.long)

    def sample_kernel(
        self,
        logits: torch.Tensor,
        n: int,
        context: Any,
        *,
        no_top_k: bool,
        no_top_p: bool,
        gather_indices: Optional[torch.Tensor] = None,
        token_to_request_index: Optional[torch.Tensor] = None,
        output: Optional[torch.Tensor] = None,
        eager: bool = False,
        cache_key: Any = None,
    ) -> torch.Tensor:
        if token_to_request_index is not None:
            raise NotImplementedError("speculative decoding is not used by mrl's Megatron backend")
        settings = self.settings
        assert settings is not None, "run() sets the call's sampling settings first"
        rows = logits[gather_indices[:n]] if gather_indices is not None else logits[:n]
        tokens = self.sample(rows, settings.temperature, settings.top_k or 0, settings.top_p, self.generator)
        self.last = tokens.cpu()
        if output is None:
            return tokens
        output.copy_(tokens)
        return output


class _DynamicStopSetController(TextGenerationController):
    """Megatron's controller, ending a request on any token of the call's stop set (kept in its response)."""

    stop_ids = torch.empty(0, dtype=torch.long)

    def _apply_stop_word_finished_ids(
        self, active_request_ids: torch.Tensor, active_request_mask: torch.Tensor
    ) -> None:
        super()._apply_stop_word_finished_ids(active_request_ids, active_request_mask)
        # This step's tokens, one per active request in the same order (the sampler just produced them).
        tokens = self._sampling.last[: len(active_request_ids)]
        active_request_mask[torch.isin(tokens, self.stop_ids).to(active_request_mask.device)] = 0


def kv_block_bytes(config: Any, block_tokens: int, attention_layers: int) -> int:
    """Bytes of one KV block of the dynamic context for a model `config` (keys and values of every attention
    layer)."""
    heads = config.num_query_groups or config.num_attention_heads
    head_dim = config.kv_channels or config.hidden_size // config.num_attention_heads
    return config.params_dtype.itemsize * 2 * attention_layers * block_tokens * heads * head_dim


def attention_layers(model: Any) -> list[int]:
    """The indices of the HybridModel's attention layers (0-based, the engine's model is one whole stage)."""
    return [i for i, kind in enumerate(model.decoder.layer_type_list) if kind == hybrid.ATTENTION]


def attention_context(model: Any, inference: Any) -> Any:
    """Megatron's dynamic context with one KV slot per attention layer of `model`.

    megatron-core 0.19.2 gives a model without Mamba layers a slot per layer of `config.num_layers` (for a
    HybridModel, its MLP layers too: twice the memory the attention needs), and finds a layer's slot through
    `context.layer_map` (its `layer_number - 1` -> slot). The context is made for a copy of the config that
    counts the attention layers, then given the map from those layers' indices to their slots."""
    layers = attention_layers(model)
    counted = copy.copy(model.config)
    counted.num_layers = len(layers)
    counted.num_layers_in_first_pipeline_stage = counted.num_layers_in_last_pipeline_stage = None
    context = DynamicInferenceContext(counted, inference)
    context.layer_map = {index: slot for slot, index in enumerate(layers)}
    return context


class DynamicLoop:
    """Megatron's dynamic engine over the backend's model, built at the first call, suspended between calls.
    `wrap(context)` is the backend's inference wrapper of its model over a context; `sample` its sampler."""

    def __init__(
        self,
        model: Any,
        wrap: Callable[[Any], Any],
        tokenizer: Any,
        sample: Callable[..., torch.Tensor],
        *,
        vocab_size: int,
        max_rows: int,
        max_model_len: int,
        block_tokens: int,
        seed: int,
        routing: Optional[RoutingRecorder] = None,
    ) -> None:
        self.model, self.wrap, self.tokenizer, self.routing = model, wrap, tokenizer, routing
        self.max_rows, self.max_model_len, self.block_tokens = max_rows, max_model_len, block_tokens
        self.sampling = _MrlSampling(vocab_size, seed, sample)
        self.engine: Optional[DynamicInferenceEngine] = None

    def _build(self) -> DynamicInferenceEngine:
        config = self.model.config
        attention = len(attention_layers(self.model))
        blocks = self.max_rows * math.ceil(self.max_model_len / self.block_tokens) + 1  # + megatron's dummy block
        inference = InferenceConfig(
            block_size_tokens=self.block_tokens,
            buffer_size_gb=blocks * kv_block_bytes(config, self.block_tokens, attention) / 2**30,
            max_sequence_length=self.max_model_len,
            max_requests=self.max_rows,
            max_tokens=max(self.max_model_len, min(self.max_rows * self.max_model_len, 16384)),
            materialize_only_last_token_logits=True,
        )
        context = attention_context(self.model, inference)
        if context.kv_block_allocator.total_count < blocks:
            raise RuntimeError(
                f"the dynamic engine's KV cache holds {context.kv_block_allocator.total_count} blocks, "
                f"{blocks} were sized for {self.max_rows} rows of {self.max_model_len} tokens"
            )
        controller = _DynamicStopSetController(self.wrap(context), self.tokenizer)
        controller._sampling = self.sampling
        return DynamicInferenceEngine(controller, context)

    def run(self, rows: list[list[int]], sampling: SamplingConfig, stop_ids: torch.Tensor) -> list[FinishedRow]:
        """Each row's tokens and raw logprobs, in row order."""
        if self.engine is None:
            self.engine = self._build()
        else:
            self.engine.resume()
        engine = self.engine
        try:
            engine.reset()
            engine.controller.stop_ids = stop_ids
            self.sampling.settings = sampling
            if sampling.seed is not None:
                self.sampling.generator.manual_seed(sampling.seed)
            params = SamplingParams(
                temperature=sampling.temperature,
                return_log_probs=True,
                skip_prompt_log_probs=True,  # the responses' alone: only each step's last logits are kept
                num_tokens_to_generate=sampling.max_new_tokens,
                termination_id=-1,  # rows end on the stop set (and their length) alone
            )
            if self.routing is not None:
                self.routing.start(len(rows))
            for index, ids in enumerate(rows):  # request id = row index (the routing recorder's row)
                engine.add_request(index, list(ids), params)
            records = []
            while engine.has_unfinished_requests():
                records += engine.step_modern()["finished_request_records"]
        finally:
            engine.suspend()
        finished = {record.request_id: record.merge() for record in records}
        results = []
        for index, ids in enumerate(rows):
            tokens = torch.as_tensor(finished[index].generated_tokens, dtype=torch.long).cpu()
            fed = len(ids) + len(tokens) - 1  # the last sampled token is never fed
            results.append(
                FinishedRow(
                    list(ids),
                    tokens,
                    [float(x) for x in finished[index].generated_log_probs or []],
                    None if self.routing is None else self.routing.row(index, fed),
                )
            )
        return results
