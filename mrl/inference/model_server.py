"""An OpenAI-compatible chat endpoint in front of mrl's rollout engine (NeMo Gym's "model server" role).

    POST /v1/chat/completions {messages, max_tokens, temperature, top_p, n, stop, seed}
        -> the chat template renders `messages` (+ the assistant header) -> token ids
        -> engine.generate(ids, sampling)                  the same engine GRPO refits: new weights serve at once
        -> {"choices": [{"message": {"role": "assistant", "content": text, "prompt_token_ids": [...],
                                     "generation_token_ids": [...], "generation_log_probs": [...]},
                         "finish_reason": "stop" | "length"}], "usage": {...}}
    POST /v1/responses {input: text | messages, instructions, max_output_tokens, temperature, top_p, seed}
        -> the same, one sample: {"object": "response", "status": "completed" | "incomplete",
                                  "output": [{"type": "message", "role": "assistant",
                                              "content": [{"type": "output_text", "text": ...}],
                                              "prompt_token_ids", "generation_token_ids", "generation_log_probs"}],
                                  "output_text", "usage": {"input_tokens", "output_tokens", "total_tokens"}}
    GET /v1/models, GET /health

The token ids and logprobs ride along with every message, so an agent that talks to this server over HTTP can hand
the trainer exactly the tokens the engine sampled (no re-tokenisation). The engine serves one request at a time
(a lock; the engine batches the `n` samples of a request). A missing or out-of-range field answers 422 naming it, a
conversation the chat template cannot render or a prompt longer than the engine takes 400. Run it with
`mrl.environments.servers.serve(build_model_app(...))`, which binds loopback unless told otherwise.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any, Optional, Union

from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, ConfigDict, Field

from mrl.inference.interface import FinishReason, GenerationBackend, SamplingConfig

_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str


class ChatRequest(BaseModel):
    """The fields of OpenAI's chat-completions request that mrl honours (others are accepted and ignored)."""

    model_config = ConfigDict(extra="allow")
    model: Optional[str] = None
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=64)
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None


class ResponsesRequest(BaseModel):
    """The fields of OpenAI's Responses request that mrl honours: text or message input, one sample."""

    model_config = ConfigDict(extra="allow")
    model: Optional[str] = None
    input: Union[str, list[ChatMessage]] = Field(..., min_length=1)
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: Optional[int] = None

    def messages(self) -> list[dict]:
        turns = (
            [{"role": "user", "content": self.input}]
            if isinstance(self.input, str)
            else [m.model_dump() for m in self.input]
        )
        return ([{"role": "system", "content": self.instructions}] if self.instructions else []) + turns


def _sampling(request: ChatRequest, default_max_tokens: int, turn_end_id: Optional[int]) -> SamplingConfig:
    stops = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    return SamplingConfig(
        n=request.n,
        temperature=request.temperature,
        top_p=request.top_p,
        max_new_tokens=request.max_completion_tokens or request.max_tokens or default_max_tokens,
        stop_token_ids=(turn_end_id,) if turn_end_id is not None else (),
        stop_strings=tuple(stops),
        seed=request.seed,
    )


def _response(sample: Any, prompt_ids: list[int], tokenizer: Any, model: str) -> dict:
    """One sample as a Responses API object (with the token ids and logprobs on its message)."""
    choice = _choice(0, sample, prompt_ids, tokenizer)
    message = choice["message"]
    text = message.pop("content")
    complete = choice["finish_reason"] == "stop"
    output = {
        "type": "message",
        "id": f"msg_{uuid.uuid4().hex}",
        "status": "completed" if complete else "incomplete",
        **message,
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }
    return {
        "id": f"resp_{uuid.uuid4().hex}",
        "object": "response",
        "created_at": int(time.time()),
        "model": model,
        "status": "completed" if complete else "incomplete",
        "incomplete_details": None if complete else {"reason": "max_output_tokens"},
        "output": [output],
        "output_text": text,
        "usage": {
            "input_tokens": len(prompt_ids),
            "output_tokens": len(sample.token_ids),
            "total_tokens": len(prompt_ids) + len(sample.token_ids),
        },
    }


def _choice(index: int, sample: Any, prompt_ids: list[int], tokenizer: Any) -> dict:
    text = tokenizer.decode(list(sample.token_ids), skip_special_tokens=True)
    message = {
        "role": "assistant",
        "content": text,
        "prompt_token_ids": prompt_ids,
        "generation_token_ids": list(sample.token_ids),
        "generation_log_probs": list(sample.logprobs or []),
    }
    return {"index": index, "message": message, "finish_reason": _FINISH.get(sample.finish_reason, "stop")}


def build_model_app(
    engine: GenerationBackend, tokenizer: Any, *, model_name: str = "mrl-policy", default_max_tokens: int = 256
) -> FastAPI:
    """The FastAPI app of the model server (see the module docstring)."""
    from mrl.data.templates import chat_turn_end_id

    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "the model server renders chat messages with the tokenizer's chat template; this tokenizer has none"
        )
    app, lock, turn_end = FastAPI(title="mrl model server"), threading.Lock(), chat_turn_end_id(tokenizer)

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "mrl"}]}

    def render(messages: list[dict], field: str) -> list[int]:
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as error:  # the template refuses the conversation (roles, order)
            raise HTTPException(400, f"{field}: the chat template cannot render them: {error}") from error
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    def generate(prompt_ids: list[int], sampling: SamplingConfig, field: str) -> Any:
        with lock:
            engine.prepare_for_generation()  # a no-op once awake; a colocated engine asleep is woken to answer
            out = engine.generate([prompt_ids], sampling)
        if out.num_prompts_rejected:
            raise HTTPException(400, f"{field}: the prompt has {len(prompt_ids)} tokens, more than the engine takes")
        return out

    @app.post("/v1/chat/completions")
    def chat(request: ChatRequest) -> dict:
        prompt_ids = render([m.model_dump() for m in request.messages], "messages")
        out = generate(prompt_ids, _sampling(request, default_max_tokens, turn_end), "messages")
        choices = [_choice(i, s, prompt_ids, tokenizer) for i, s in enumerate(out.samples)]
        completion = sum(len(s.token_ids) for s in out.samples)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": request.model or model_name,
            "choices": choices,
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": completion,
                "total_tokens": len(prompt_ids) + completion,
            },
        }

    @app.post("/v1/responses")
    def responses(request: ResponsesRequest) -> dict:
        prompt_ids = render(request.messages(), "input")
        sampling = SamplingConfig(
            n=1,
            temperature=request.temperature,
            top_p=request.top_p,
            max_new_tokens=request.max_output_tokens or default_max_tokens,
            stop_token_ids=(turn_end,) if turn_end is not None else (),
            seed=request.seed,
        )
        out = generate(prompt_ids, sampling, "input")
        return _response(out.samples[0], prompt_ids, tokenizer, request.model or model_name)

    return app
