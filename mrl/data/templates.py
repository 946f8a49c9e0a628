"""Prompt templates and prompt tokenisation (the engines work on token ids; text becomes ids here).

Two templates:
- "chat":  the tokenizer's own chat template, one user turn "<problem> <instruction>", then the generation prompt
           (the assistant header) so the model answers as the assistant;
- "plain": "<problem> <instruction>" as raw text (base models, and the synthetic arithmetic task whose
           instruction is empty, so the prompt is the problem itself: "37+05=").

A response ends with the token that closes the assistant's turn: the chat template's end-of-turn token (found by
rendering a turn, so Llama-3's <|eot_id|> is found although its EOS is <|end_of_text|>), or EOS for plain prompts.
Generation stops on it and SFT targets end with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional, Sequence

from mrl.config.errors import ConfigError

#: How a multi-turn episode shows an observation after a model turn with a plain template (mrl/algorithms/agent.py):
#: the text on its own line, then the model's next turn.
PLAIN_OBSERVATION = "\n{}\n"
COT_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
_SENTINEL = "mrl-end-of-turn-probe"


@dataclass(frozen=True)
class PromptTemplate:
    kind: Literal["chat", "plain"] = "chat"
    instruction: str = COT_INSTRUCTION

    def __post_init__(self) -> None:
        if self.kind not in ("chat", "plain"):
            raise ValueError(f"data.prompt_template must be 'chat' or 'plain', got {self.kind!r}")

    def user_text(self, problem: str) -> str:
        return f"{problem} {self.instruction}" if self.instruction else problem

    def render(self, problem: str, tokenizer: Any = None) -> str:
        """The prompt text for one problem (chat needs the tokenizer for its template)."""
        text = self.user_text(problem)
        if self.kind == "plain":
            return text
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise no_chat_template()
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )

    def encode(
        self,
        problems: Sequence[str],
        tokenizer: Any,
        *,
        max_length: Optional[int] = None,
        overlong: Literal["truncate", "reject"] = "reject",
    ) -> tuple[list[list[int]], list[int]]:
        """Token ids of each prompt, and the indices of the problems kept.

        A prompt longer than `max_length`: "reject" drops it (its index is missing from the kept list);
        "truncate" keeps its LAST max_length tokens, because a chat prompt ends with the generation header the model
        needs to start answering. Chat templates already contain the special tokens, so none are added again."""
        add_special = self.kind == "plain"
        ids_out, kept = [], []
        for i, problem in enumerate(problems):
            ids = _fit(
                tokenizer(self.render(problem, tokenizer), add_special_tokens=add_special)["input_ids"],
                max_length,
                overlong,
            )
            if ids is not None:
                ids_out.append(ids)
                kept.append(i)
        return ids_out, kept

    def encode_messages(
        self,
        messages: Sequence[dict],
        tools: Optional[list[dict]],
        text: str,
        tokenizer: Any,
        *,
        max_length: Optional[int] = None,
        overlong: Literal["truncate", "reject"] = "reject",
    ) -> Optional[list[int]]:
        """The ids of a prompt that is a conversation of its own (a NeMo Gym row: system and user messages, tools),
        without the instruction: chat renders the messages and tools with the tokenizer's template, plain is `text`
        (the messages' contents); None when it is over max_length and overlong is "reject"."""
        if self.kind == "plain":
            return _fit(tokenizer(text, add_special_tokens=True)["input_ids"], max_length, overlong)
        if not getattr(tokenizer, "chat_template", None):
            raise no_chat_template()
        rendered = tokenizer.apply_chat_template(
            list(messages), tools=tools, tokenize=False, add_generation_prompt=True
        )
        return _fit(tokenizer(rendered, add_special_tokens=False)["input_ids"], max_length, overlong)

    def turn_end_id(self, tokenizer: Any) -> Optional[int]:
        """The token that ends a response: the chat template's end of the assistant turn, else EOS."""
        if self.kind == "chat" and getattr(tokenizer, "chat_template", None):
            found = chat_turn_end_id(tokenizer)
            if found is not None:
                return found
        return tokenizer.eos_token_id


def _fit(ids: Sequence[int], max_length: Optional[int], overlong: str) -> Optional[list[int]]:
    """`ids` within max_length: as they are, their last max_length (truncate), or None (reject)."""
    if max_length is None or len(ids) <= max_length:
        return list(ids)
    return None if overlong == "reject" else list(ids[-max_length:])


def no_chat_template() -> ConfigError:
    """The error for chat prompts from a tokenizer without a chat template (a base model's, often)."""
    return ConfigError(
        "chat prompts need the tokenizer's chat template, and this tokenizer has none",
        key="data.prompt_template",
        given="chat",
        fix="set data.prompt_template=plain, or use a model (or policy.tokenizer) with a chat template",
    )


def chat_turn_end_id(tokenizer: Any) -> Optional[int]:
    """The special token the chat template writes right after an assistant message's content; None when the
    template writes no special token there."""
    messages = [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": _SENTINEL}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    after = text[text.rfind(_SENTINEL) + len(_SENTINEL) :]
    ids = tokenizer(after, add_special_tokens=False)["input_ids"] if after else []
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    return ids[0] if ids and ids[0] in special else None
