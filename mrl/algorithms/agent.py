"""Multi-turn rollouts against a resource server (mrl/environments/servers), token in / token out.

One episode per (dataset row, sample of its GRPO group):
    context  = the row's prompt ids (+ the server's first observation, masked)
    repeat until the model makes no tool call, the server says done or a turn/token budget is spent:
        the engine continues `context` until the turn ends      the model's own tokens: loss mask 1, engine logprobs
        parse a tool call from the turn's text                   (`ToolFormat`: a JSON call, or the bare text)
        call the tool over HTTP -> observation text
        append the observation as the template's tool turn       its tokens: loss mask 0 (never trained on)
    verify(session, row, response) -> reward; the server's aggregate_metrics over the step's verified episodes are
    logged as train/env/<name> (val/env/<name>)
The server's dialect (the environment's `client_class`) says what `response` is: for mrl's servers the last turn's
text and the turn count, for NeMo Gym's a Responses object of the episode's transcript (its tool calls, their
outputs and the final message, kept in `Episode.transcript` in that form for either).
The model's tokens are never decoded and re-encoded: the row the policy trains on holds exactly the ids the engine
sampled, so the trainer's logprobs of them equal the engine's (no retokenisation drift; measured by
train/token_mult_prob_error like any rollout). All live episodes' turns go to the engine in one `generate` call per
round, and their tool calls run concurrently (asyncio). A server that is down, slow past its timeout or answers
garbage costs that episode its reward (0) and is counted (`train/env_server_errors`); the run goes on. A tool call
the server refuses as the model's mistake (a tool it lacks, arguments it does not take: a 4xx) is an observation the
model reads, not a server error.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, Optional, Sequence

import torch

from mrl.algorithms.rollout import Rollouts, decode_text
from mrl.data.datasets import Problem
from mrl.data.templates import PLAIN_OBSERVATION, PromptTemplate
from mrl.environments.servers.client import AsyncResourceClient
from mrl.inference.interface import FinishReason, GenerationBackend, SamplingConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_JSON_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)
#: Seeds of successive rounds of one step stay apart (a round's samples use seed + i * n + k).
ROUND_SEED_STRIDE = 1_000_003


@dataclass(frozen=True)
class ToolFormat:
    """How a turn's text becomes a tool call. "json": `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
    (Hermes style; a turn without one is the final answer). "bare": the whole turn (stripped) is the one argument
    `argument` of the one tool `tool` (small models that cannot write JSON); an empty turn is the final answer."""

    kind: Literal["json", "bare"] = "json"
    tool: Optional[str] = None
    argument: Optional[str] = None

    def parse(self, text: str) -> Optional[tuple[str, dict]]:
        """(tool name, arguments) of the turn, or None when it makes no call."""
        if self.kind == "bare":
            body = text.strip()
            return (str(self.tool), {str(self.argument): body}) if body else None
        match = _JSON_CALL.search(text)
        if match is None:
            return None
        try:
            call = json.loads(match.group(1))
            return str(call["name"]), dict(call.get("arguments") or {})
        except (ValueError, KeyError, TypeError):
            return ("", {})  # a malformed call: the tool answers with an error the model sees


@dataclass(frozen=True)
class AgentLimits:
    max_turns: int = 4
    """Model turns per episode at most."""
    max_new_tokens: int = 16
    """Tokens of one model turn at most."""
    max_total_tokens: int = 256
    """Prompt + every turn + every observation at most; an episode that reaches it ends (truncated)."""
    timeout_s: float = 10.0
    """Per HTTP call to the resource server."""
    opening_observation: bool = True
    """Show the server's opening observation after the prompt (tiny models trained on the bare prompt: off)."""


@dataclass
class Episode:
    """One multi-turn rollout as it grows (ids, mask and engine logprobs stay aligned)."""

    row: dict
    ids: list[int]
    prompt_length: int
    mask: list[float] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    session: Any = None
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    last_text: str = ""
    done: bool = False
    truncated: bool = False
    finish_reason: FinishReason = FinishReason.STOP
    reward: float = 0.0
    verified: Optional[dict] = None
    """The server's verify result: {"reward": ..., <components>} (None when verify failed)."""
    server_error: Optional[str] = None
    task: int = 0
    """The row's index in the batch, and the episode's among its row's samples (NeMo Gym's aggregate needs both)."""
    sample: int = 0
    transcript: list[dict] = field(default_factory=list)
    """The episode after the prompt as OpenAI Responses output items: function_call, function_call_output, message."""

    def __post_init__(self) -> None:
        self.mask = [0.0] * len(self.ids)
        self.logprobs = [0.0] * len(self.ids)

    def append(self, tokens: Sequence[int], *, model: bool, logprobs: Optional[Sequence[float]] = None) -> None:
        self.ids += list(tokens)
        self.mask += [1.0 if model else 0.0] * len(tokens)
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(tokens)

    def end(self, *, error: Optional[str] = None) -> None:
        self.done = True
        if error is not None and self.server_error is None:
            self.server_error = error


def observation_tokens(text: str, tokenizer: "PreTrainedTokenizerBase", template: PromptTemplate) -> list[int]:
    """The tokens that follow a model turn (which ended with its end-of-turn token) to show `text` and open the next
    assistant turn: the chat template's tool turn and assistant header, or, for plain prompts, the text and a
    newline."""
    if template.kind == "plain":
        return list(tokenizer(PLAIN_OBSERVATION.format(text), add_special_tokens=False)["input_ids"])
    marker = "mrl-agent-turn"
    messages = [{"role": "user", "content": "1"}, {"role": "assistant", "content": marker}]
    full = tokenizer.apply_chat_template(
        messages + [{"role": "tool", "content": text}], tokenize=False, add_generation_prompt=True
    )
    assert isinstance(full, str)  # tokenize=False renders one conversation as its text
    after = full[full.index(marker) + len(marker) :]
    end_id = template.turn_end_id(tokenizer)
    end_text = decode_text(tokenizer, [end_id], skip_special_tokens=False) if end_id is not None else ""
    if end_text and after.startswith(end_text):
        after = after[len(end_text) :]  # the model wrote its turn's end itself
    return list(tokenizer(after, add_special_tokens=False)["input_ids"])


class AgentRunner:
    """Runs episodes of many rows at once against one resource server (see the module docstring)."""

    def __init__(
        self,
        url: str,
        tokenizer: "PreTrainedTokenizerBase",
        template: PromptTemplate,
        fmt: ToolFormat,
        limits: AgentLimits,
        client_class: type[AsyncResourceClient] = AsyncResourceClient,
    ) -> None:
        self.url, self.tokenizer, self.template, self.fmt, self.limits = url, tokenizer, template, fmt, limits
        self.client_class = client_class

    # ---------------------------------------------------------------------------------------- server calls
    def _gather(self, calls) -> list:
        async def run() -> list:
            async with self.client_class(self.url, timeout_s=self.limits.timeout_s) as client:
                return await asyncio.gather(*(call(client) for call in calls))

        return asyncio.run(run())

    def _seed(self, episodes: list[Episode]) -> None:
        handles = self._gather([lambda c, e=e: c.seed_session(e.row) for e in episodes])
        for episode, handle in zip(episodes, handles):
            if not handle.ok:
                episode.end(error=f"seed_session: {handle.error}")
                continue
            episode.session = handle
            if handle.observation and self.limits.opening_observation:
                episode.append(self._observation_in_prompt(handle.observation), model=False)

    def _observation_in_prompt(self, text: str) -> list[int]:
        """The server's opening observation, right after the prompt (before the model's first turn)."""
        return list(self.tokenizer(f"{text}\n", add_special_tokens=False)["input_ids"])

    def _call_tools(self, calls: list[tuple[Episode, tuple[str, dict]]]) -> None:
        results = self._gather(
            [lambda c, e=e, call=call: c.call_tool(e.session, call[0], call[1]) for e, call in calls]
        )
        for (episode, call), result in zip(calls, results):
            episode.tool_calls += 1
            if infrastructure_failure(result.error_kind):
                episode.end(error=f"tool call {call[0]!r}: {result.error}")
                continue
            episode.tool_errors += result.error is not None
            text = result.output if result.error is None else f"error: {result.error}"
            episode.transcript.append(
                {"type": "function_call_output", "call_id": f"call_{episode.turns}", "output": str(text)}
            )
            episode.append(observation_tokens(str(text), self.tokenizer, self.template), model=False)
            if result.done:
                episode.end()

    def _verify(self, episodes: list[Episode]) -> None:
        live = [e for e in episodes if e.session is not None and e.server_error is None]
        response = self.client_class.response_body
        results = self._gather(
            [lambda c, e=e: c.verify(e.session, e.row, response(e.last_text, e.turns, e.transcript)) for e in live]
        )
        for episode, result in zip(live, results):
            if result.error is not None:
                episode.server_error = f"verify: {result.error}"
            else:
                episode.reward = float(result.reward)
                episode.verified = {"reward": episode.reward, **result.components}

    def aggregate(self, episodes: Sequence[Episode]) -> dict[str, float]:
        """The server's /aggregate_metrics over the episodes it verified ({} when none was or the call failed)."""
        row = self.client_class.metric_row
        results = [row(e.verified, e.task, e.sample) for e in episodes if e.verified is not None]
        if not results:
            return {}
        (metrics,) = self._gather([lambda c: c.aggregate_metrics(results)])
        return {key: float(value) for key, value in metrics.items() if isinstance(value, (int, float))}

    # ------------------------------------------------------------------------------------------ the loop
    def _turn(self, engine: GenerationBackend, live: list[Episode], sampling: SamplingConfig) -> None:
        """One model turn of every live episode (one batched engine call), then their tool calls."""
        out = engine.generate([e.ids for e in live], sampling)
        calls = []
        for episode, sample in zip(live, out.samples):
            episode.append(sample.token_ids, model=True, logprobs=sample.logprobs)
            episode.turns += 1
            episode.finish_reason = sample.finish_reason
            episode.last_text = decode_text(self.tokenizer, sample.token_ids, skip_special_tokens=True)
            call = self.fmt.parse(episode.last_text)  # a turn cut at max_turn_tokens still makes its call
            episode.transcript.append(transcript_item(episode.last_text, call, f"call_{episode.turns}"))
            if sample.finish_reason is FinishReason.ABORTED:
                episode.end(error="the engine rejected the episode's context")
            elif call is None:
                episode.end()
            else:
                calls.append((episode, call))
        if calls:
            self._call_tools(calls)
        for episode in live:
            if not episode.done and (
                episode.turns >= self.limits.max_turns or len(episode.ids) >= self.limits.max_total_tokens
            ):
                episode.truncated = len(episode.ids) >= self.limits.max_total_tokens
                episode.end()

    def run(
        self,
        engine: GenerationBackend,
        rows: Sequence[dict],
        prompt_ids: Sequence[Sequence[int]],
        sampling: SamplingConfig,
    ) -> list[Episode]:
        """`sampling.n` episodes per row, every one played to its end, then verified."""
        episodes = [
            Episode(dict(row), list(ids), len(ids), task=task, sample=sample)
            for task, (row, ids) in enumerate(zip(rows, prompt_ids))
            for sample in range(sampling.n)
        ]
        self._seed(episodes)
        engine.prepare_for_generation()  # a colocated engine may be asleep (validation after a refit)
        base = replace(sampling, n=1, max_new_tokens=self.limits.max_new_tokens)
        for turn in range(self.limits.max_turns):
            live = [e for e in episodes if not e.done]
            if not live:
                break
            seed = None if base.seed is None else base.seed + turn * ROUND_SEED_STRIDE
            self._turn(engine, live, replace(base, seed=seed))
        self._verify(episodes)
        return episodes


def infrastructure_failure(kind: Optional[str]) -> bool:
    """A tool call the server failed (down, timeout, a malformed answer, a 5xx), not one the model got wrong (the tool
    raised, it is unknown, its arguments were refused with a 4xx): the first ends the episode as a server error."""
    return kind is not None and (kind in ("down", "timeout", "malformed") or kind.startswith("http_5"))


def transcript_item(text: str, call: Optional[tuple[str, dict]], call_id: str) -> dict:
    """A model turn as a Responses output item: its tool call, or (no call) its message."""
    if call is not None:
        name, arguments = call
        return {"type": "function_call", "call_id": call_id, "name": name, "arguments": json.dumps(arguments)}
    return {
        "type": "message",
        "id": f"msg_{call_id}",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def rollouts_from_episodes(episodes: Sequence[Episode], pad_id: int) -> Rollouts:
    """The policy's rows of finished episodes (layout of mrl/algorithms/rollout.py; observation tokens masked)."""
    width = max(len(e.ids) for e in episodes)
    ids = torch.full((len(episodes), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(episodes), width))
    gen = torch.zeros((len(episodes), width))
    for row, e in enumerate(episodes):
        ids[row, : len(e.ids)] = torch.tensor(e.ids)
        mask[row, : len(e.mask)] = torch.tensor(e.mask)
        gen[row, : len(e.logprobs)] = torch.tensor(e.logprobs)
    return Rollouts(
        ids,
        mask,
        gen,
        torch.tensor([e.reward for e in episodes]),
        torch.tensor([int(sum(e.mask)) for e in episodes]),
        torch.tensor([e.truncated for e in episodes]),
        num_reward_errors=sum(e.server_error is not None for e in episodes),
        reward_errors=[e.server_error for e in episodes if e.server_error is not None][:4],
        lengths=torch.tensor([len(e.ids) for e in episodes]),
        responses=[e.last_text for e in episodes],
        extracted_answers=[None] * len(episodes),
        finish_reasons=[e.finish_reason for e in episodes],
        reward_errored=[e.server_error is not None for e in episodes],
    )


def episode_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    """Per-environment metrics of a step's episodes: means per episode, and the server failures counted."""
    count = max(len(episodes), 1)
    mean = lambda values: float(sum(values)) / count  # noqa: E731
    return {
        "train/env_turns": mean(e.turns for e in episodes),
        "train/env_tool_calls": mean(e.tool_calls for e in episodes),
        "train/env_tool_errors": mean(e.tool_errors for e in episodes),
        "train/env_server_errors": float(sum(e.server_error is not None for e in episodes)),
    }


def problem_rows(problems: Sequence[Problem], client_class: type[AsyncResourceClient]) -> list[dict]:
    """The rows the server seeds its sessions with, in its dialect (mrl's servers: the whole source row)."""
    return [client_class.row_of(p.problem, p.answer, p.fields) for p in problems]


def runner_for(env: Any, tokenizer: "PreTrainedTokenizerBase", template: PromptTemplate) -> AgentRunner:
    """The agent loop of a `ServerEnvironment` (its `env.server` settings)."""
    cfg = env.cfg  # a ServerEnvConfig, or a NemoGymEnvConfig (JSON tool calls; no opening observation exists)
    return AgentRunner(
        env.url,
        tokenizer,
        template,
        ToolFormat(getattr(cfg, "tool_format", "json"), getattr(cfg, "tool", None), getattr(cfg, "argument", None)),
        AgentLimits(
            cfg.max_turns,
            cfg.max_turn_tokens,
            cfg.max_total_tokens,
            cfg.timeout_s,
            getattr(cfg, "opening_observation", True),
        ),
        env.client_class,
    )


def agent_rollouts(
    env: Any,
    engine: GenerationBackend,
    tokenizer: "PreTrainedTokenizerBase",
    template: PromptTemplate,
    problems: Sequence[Problem],
    prompt_ids: Sequence[Sequence[int]],
    sampling: SamplingConfig,
) -> tuple[Rollouts, dict[str, float]]:
    """`sampling.n` multi-turn episodes per problem as training rows, and the step's per-environment metrics."""
    runner = runner_for(env, tokenizer, template)
    episodes = runner.run(engine, problem_rows(problems, runner.client_class), prompt_ids, sampling)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    server_metrics = {f"train/env/{key}": value for key, value in runner.aggregate(episodes).items()}
    return rollouts_from_episodes(episodes, pad), {**episode_metrics(episodes), **server_metrics}


def validate_episodes(cfg: Any, workers: Any, env: Any, data: Any) -> dict[str, float]:
    """Multi-turn validation: eval sampling on the validation rows; `val/reward` (mean) and `val/accuracy` (the
    fraction of episodes with reward 1); {} without validation rows."""
    from mrl.data.tasks import encode_prompts
    from mrl.inference.factory import sampling_config

    problems = data.val[: cfg.eval.max_problems] if cfg.eval.max_problems else data.val
    if not problems:
        return {}
    problems, prompts = encode_prompts(problems, workers.tokenizer, data, cfg)
    sampling = sampling_config(cfg, purpose="eval", turn_end_id=data.template.turn_end_id(workers.tokenizer))
    runner = runner_for(env, workers.tokenizer, data.template)
    episodes = runner.run(workers.engine, problem_rows(problems, runner.client_class), prompts, sampling)
    rewards = [e.reward for e in episodes]
    server_metrics = {f"val/env/{key}": value for key, value in runner.aggregate(episodes).items()}
    return {
        "val/reward": sum(rewards) / len(rewards),
        "val/accuracy": sum(r >= 1.0 for r in rewards) / len(rewards),
        "val/server_errors": float(sum(e.server_error is not None for e in episodes)),
        "val/episodes": float(len(episodes)),
        **server_metrics,
    }
