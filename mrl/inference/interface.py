"""The generation interface: token ids in, sampled token ids + logprobs of the sampled tokens out.

Engines work on token ids only (tokenisation lives in mrl/data), so what the trainer scores is exactly what the
engine sampled. Every backend (vLLM on CPU or CUDA, Megatron static inference) implements `GenerationBackend`;
the algorithm loops see nothing else.

Output layout: `GenerationOutput.samples` is prompt-major, sample `k` of prompt `i` sits at `i * n + k`, and it
always holds `num_prompts * n` samples, also for prompts that were rejected for being too long (those come back
empty with `FinishReason.ABORTED`), so GRPO groups keep their shape and a bad prompt never crashes a step.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Optional, Protocol, runtime_checkable

import torch

from mrl.inference.lifecycle import EngineLifecycle
from mrl.inference.refit import RefitSink, RefitStats
from mrl.model.router_replay import no_route, routing_dtype

#: What to do with a prompt longer than the engine allows: keep its last tokens, or answer it with empty samples.
OverlongPromptPolicy = Literal["truncate", "reject"]


class FinishReason(str, enum.Enum):
    """Why a sample ended."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_new_tokens reached (the response is cut)
    ABORTED = "aborted"  # never generated (prompt rejected) or aborted by the engine


@dataclass(frozen=True)
class SamplingConfig:
    """How to sample. One config applies to every prompt of a `generate` call."""

    n: int = 1
    """Samples per prompt (the GRPO group size)."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]."""
    top_k: Optional[int] = None
    """Sample among the k most likely tokens; None = all."""
    max_new_tokens: int = 64
    """Response tokens at most."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end a response besides EOS (the stop token is kept in `token_ids`)."""
    stop_strings: tuple[str, ...] = ()
    """Strings that end a response (needs the engine's tokenizer to detokenise)."""
    ignore_eos: bool = False
    """Keep sampling after EOS (benchmarks: fixed-length responses)."""
    seed: Optional[int] = None
    """Base seed: prompt i, sample k use seed + i * n + k (reproducible, distinct per sample); None = engine's RNG."""
    logprobs: bool = True
    """Return the logprob of every sampled token."""
    overlong_prompt: OverlongPromptPolicy = "reject"
    """A prompt longer than the engine allows (max_model_len - max_new_tokens): keep its last tokens ("truncate")
    or answer it with n empty ABORTED samples ("reject"). Either way it is counted and the batch goes on."""

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"SamplingConfig.n={self.n}: need at least one sample per prompt")
        if self.temperature < 0:
            raise ValueError(f"SamplingConfig.temperature={self.temperature}: must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingConfig.top_p={self.top_p}: must be in (0, 1]")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"SamplingConfig.top_k={self.top_k}: must be >= 1, or None for no top-k")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingConfig.max_new_tokens={self.max_new_tokens}: must be >= 1")
        if self.overlong_prompt not in ("truncate", "reject"):
            raise ValueError(f"SamplingConfig.overlong_prompt={self.overlong_prompt!r}: choose 'truncate' or 'reject'")


@dataclass(frozen=True)
class GeneratedSample:
    """One sampled response."""

    prompt_index: int
    """Index of the prompt in the `generate` call."""
    sample_index: int
    """0 .. n-1 within its prompt's group."""
    prompt_token_ids: list[int]
    """The prompt as the engine saw it (after truncation)."""
    token_ids: list[int]
    """Sampled response tokens, stop token included."""
    logprobs: Optional[list[float]]
    """Engine logprob of each sampled token (len == len(token_ids)); None when not requested."""
    finish_reason: FinishReason
    prompt_truncated: bool = False
    """The prompt was longer than the engine allows and lost its first tokens."""
    routing: Optional[torch.Tensor] = None
    """[tokens, layers, k] in `routing_dtype` (uint8 or int16): the experts the engine routed each token it fed
    through the model to (prompt, then response; a response's last token was never fed), per decoder layer; only when
    asked (router replay)."""

    @property
    def length(self) -> int:
        """Number of response tokens."""
        return len(self.token_ids)

    @property
    def truncated(self) -> bool:
        """The response was cut by max_new_tokens before it stopped by itself."""
        return self.finish_reason is FinishReason.LENGTH


@dataclass
class GenerationOutput:
    """All samples of one `generate` call, prompt-major (see the module docstring)."""

    samples: list[GeneratedSample]
    num_prompts: int
    n: int
    num_prompts_truncated: int = 0
    num_prompts_rejected: int = 0
    metrics: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.samples) != self.num_prompts * self.n:
            raise ValueError(f"{len(self.samples)} samples for {self.num_prompts} prompts x n={self.n}")

    def lengths(self) -> torch.Tensor:
        """Response lengths, [num_prompts * n] int64."""
        return torch.tensor([s.length for s in self.samples], dtype=torch.long)

    def padded_tokens(self, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Responses right-padded to the longest: token ids [S, T] int64 and logprobs [S, T] fp32 (0 at padding)."""
        width = max((s.length for s in self.samples), default=0)
        ids = torch.full((len(self.samples), width), pad_token_id, dtype=torch.long)
        logprobs = torch.zeros((len(self.samples), width), dtype=torch.float32)
        for row, sample in enumerate(self.samples):
            ids[row, : sample.length] = torch.tensor(sample.token_ids, dtype=torch.long)
            if sample.logprobs is not None:
                logprobs[row, : sample.length] = torch.tensor(sample.logprobs, dtype=torch.float32)
        return ids, logprobs


def compact_routing(routing: torch.Tensor, num_experts: int) -> torch.Tensor:
    """An engine's expert ids (any integer dtype; vLLM 0.32: uint8, or uint16 past 256 experts) in
    `routing_dtype(num_experts)`; an id outside the model's experts is refused (the engine serves another model)."""
    if routing.numel() and not 0 <= int(routing.min()) <= int(routing.max()) < num_experts:
        raise ValueError(
            f"expert ids {int(routing.min())}..{int(routing.max())} are not those of a model with "
            f"{num_experts} routed experts (0..{num_experts - 1})"
        )
    return routing.to(routing_dtype(num_experts))


def routing_rows(routings: Sequence[Optional[torch.Tensor]], width: int) -> Optional[torch.Tensor]:
    """[B, width, layers, k] each row's routing ([tokens, layers, k] from its first token on, or None) on its tokens'
    positions, in the rows' dtype, `no_route` where there is none (padding, a response's last token, a row without
    routing); None when no row carries any."""
    carried = [r for r in routings if r is not None]
    if not carried:
        return None
    dtype = carried[0].dtype
    out = torch.full((len(routings), width, *carried[0].shape[1:]), no_route(dtype), dtype=dtype)
    for row, routing in enumerate(routings):
        if routing is None:
            continue
        if routing.shape[1:] != carried[0].shape[1:] or routing.dtype != dtype:
            raise ValueError(
                f"row {row}: routing of shape {list(routing.shape)} ({routing.dtype}) against "
                f"{list(carried[0].shape)} ({dtype}) in another row (another model?)"
            )
        tokens = min(len(routing), width)
        out[row, :tokens] = routing[:tokens]
    return out


@runtime_checkable
class GenerationBackend(Protocol):
    """A rollout engine driven by the single controller."""

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig) -> GenerationOutput:
        """Sample `sampling.n` responses for every prompt (token ids)."""
        ...

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]
    ) -> RefitStats:
        """Load new weights with Hugging Face names and layout, streamed in bounded buckets: a stream yielding each
        layer's tensors together, or an in-memory state dict in any order."""
        ...

    def prepare_for_generation(self) -> None:
        """Weights and KV cache resident (colocated engines release them while the policy trains); `generate`
        refuses an engine that is not (mrl/inference/lifecycle.py)."""
        ...

    def finish_generation(self, refit_follows: bool = False) -> None:
        """Release what memory the platform allows until the next `prepare_for_refit` / `prepare_for_generation`.
        `refit_follows`: a refit will rewrite every weight before the next generation, so an engine may discard its
        weights instead of keeping them (vLLM sleep level 2, generation.sleep_level)."""
        ...


class RolloutEngine(GenerationBackend, RefitSink, Protocol):
    """What a run holds as its engine: it generates, loads refits, and stops."""

    @property
    def lifecycle(self) -> EngineLifecycle:
        """The engine's state (awake, asleep, weights discarded) and its recent transitions (lifecycle.py)."""
        ...

    def shutdown(self) -> None:
        """Stop the engine's workers now (not at interpreter exit)."""
        ...
