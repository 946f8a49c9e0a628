"""Preference pairs (a prompt, a chosen and a rejected answer) for DPO and reward-model training.

Sources are local jsonl / parquet files, `.json` files holding one JSON array of rows (LLaMA-Factory's
dpo_en_demo.json), or a Hugging Face dataset name (as `mrl.data.datasets`). The shape is detected per row:
    plain       {"prompt": str, "chosen": str, "rejected": str}
    messages    {"prompt": str (optional), "chosen": [messages], "rejected": [messages]}  (UltraFeedback-binarized:
                full conversations, the last message is the answer, the earlier ones the shared prompt), or
                {"prompt": [messages], "chosen": [one assistant message] | str, "rejected": ...}  (TRL)
    hh-rlhf     {"chosen": "\\n\\nHuman: ...\\n\\nAssistant: ...", "rejected": "..."}  (the prompt is the text up to
                and including the last "\\n\\nAssistant:", and must be the same in both)
    sharegpt    {"conversations": [{"from": "human"|"gpt"|"system", "value": str}, ...],
                 "chosen": {"from": "gpt", "value": str}, "rejected": {...}}
Every pair's prompt becomes chat messages ({"role", "content"}) ending with a user turn; answers are stripped.

Bad rows never crash a run: they are skipped and counted by reason (`PreferenceSet.skipped`); only a source with
no usable row is an error (a `ConfigError` naming the key that named the file), and it names the columns found and
the accepted shapes.

Batches (`build_preference_batch`) follow the SFT layout (mrl/data/sft.py), chosen and rejected interleaved:
    input_ids  [2P, T]  row 2i = pair i's prompt + chosen + end of turn, row 2i+1 = the same with rejected, then
                        right padding; T >= max(lengths) + 1 (at least one padding column)
    loss_mask  [2P, T]  1 on the response tokens and the end of turn, 0 elsewhere
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence, Union

import torch

from mrl.config.errors import ConfigError
from mrl.data.datasets import INVALID_JSON, read_rows, unreadable_source
from mrl.data.templates import PromptTemplate, no_chat_template

logger = logging.getLogger(__name__)

ACCEPTED_SHAPES = (
    '{"prompt": str, "chosen": str, "rejected": str}; '
    '{"chosen": [messages], "rejected": [messages]} (UltraFeedback, last message is the answer); '
    '{"prompt": [messages], "chosen": [assistant message] or str, "rejected": ...} (TRL); '
    '{"chosen": "\\n\\nHuman: ...\\n\\nAssistant: ...", "rejected": ...} (HH-RLHF); '
    '{"conversations": [{"from", "value"}], "chosen": {"from", "value"}, "rejected": ...} (sharegpt)'
)
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}
HH_HUMAN, HH_ASSISTANT = "\n\nHuman:", "\n\nAssistant:"
_HH_TURN = re.compile(r"\n\n(Human|Assistant):")

Messages = list[dict[str, str]]
Parsed = Union[tuple[Messages, str, str], str]  # (prompt messages, chosen, rejected), or why the row is skipped


@dataclass(frozen=True)
class PreferencePair:
    """One comparison; `row` is its index in the source (for error reports)."""

    prompt: tuple[dict, ...]  # chat messages {"role", "content"} ending with a user turn
    chosen: str
    rejected: str
    row: int = -1


@dataclass
class PreferenceSet:
    pairs: list[PreferencePair]
    source: str
    skipped: Counter = field(default_factory=Counter)  # reason -> rows skipped

    @property
    def num_skipped(self) -> int:
        return sum(self.skipped.values())

    def __len__(self) -> int:
        return len(self.pairs)


# ------------------------------------------------------------------------------------------------------- loading
def load_preferences(
    source: str | Path, *, max_rows: Optional[int] = None, split: str = "train", key: str = "data.train"
) -> PreferenceSet:
    """Read a jsonl/json/parquet file (or a dataset folder) into `PreferencePair`s, skipping and counting bad
    rows; at most `max_rows` pairs. `key`: the config key that named `source` (for the error when no row is
    usable)."""
    rows, columns = read_rows(str(source), split, key=key)
    result = PreferenceSet([], str(source))
    for index, row in rows:
        pair, reason = _to_pair(index, row)
        if pair is None:
            result.skipped[reason] += 1
            continue
        result.pairs.append(pair)
        if max_rows is not None and len(result.pairs) >= max_rows:
            break
    if not result.pairs:
        raise unreadable_source(str(source), key, result.skipped) or ConfigError(
            f"{source} has no usable preference pair (rows skipped, by reason: {dict(result.skipped)}); columns "
            f"found: {', '.join(sorted(columns)) or 'none'}",
            key=key,
            allowed=f"rows shaped as {ACCEPTED_SHAPES}",
            fix=f"write the rows in one of these shapes, or point {key} at a preference file",
        )
    if result.num_skipped:
        logger.warning("%s: skipped %d bad rows %s", source, result.num_skipped, dict(result.skipped))
    return result


def _to_pair(index: int, row: Any) -> tuple[Optional[PreferencePair], str]:
    if row is INVALID_JSON:
        return None, "invalid JSON"
    if not isinstance(row, dict):
        return None, "not an object"
    parsed = _parse_row(row)
    if isinstance(parsed, str):
        return None, parsed
    prompt, chosen, rejected = parsed
    reason = _pair_problem(prompt, chosen, rejected)
    if reason:
        return None, reason
    return PreferencePair(tuple(prompt), chosen, rejected, index), ""


def _parse_row(row: dict) -> Parsed:
    """Detect the row's shape and split it into (prompt messages, chosen, rejected)."""
    prompt, chosen, rejected = row.get("prompt"), row.get("chosen"), row.get("rejected")
    if "conversations" in row:
        return _parse_sharegpt(row["conversations"], chosen, rejected)
    if isinstance(prompt, list):
        return _parse_prompt_messages(prompt, chosen, rejected)
    if isinstance(chosen, list) and isinstance(rejected, list) and (prompt is None or isinstance(prompt, str)):
        return _parse_conversations(prompt, chosen, rejected)
    if isinstance(chosen, str) and isinstance(rejected, str):
        if prompt is None:
            return _parse_hh(chosen, rejected)
        if isinstance(prompt, str):
            return [_message("user", prompt.strip())], chosen.strip(), rejected.strip()
    return "unknown shape"


def _pair_problem(prompt: Messages, chosen: str, rejected: str) -> str:
    """Why a parsed pair is unusable ("" when it is fine)."""
    if not prompt or prompt[-1]["role"] != "user":
        return "prompt does not end with a user turn"
    if not prompt[-1]["content"].strip():
        return "empty prompt"
    if not chosen:
        return "empty chosen"
    if not rejected:
        return "empty rejected"
    if chosen == rejected:
        return "chosen equals rejected"
    return ""


def _message(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


def _messages(value: Any) -> Optional[Messages]:
    """`value` as a list of {"role", "content"} messages (extra keys dropped); None when it is not one."""
    if not isinstance(value, list):
        return None
    out = []
    for m in value:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            return None
        out.append(_message(m["role"], m["content"]))
    return out


def _parse_conversations(prompt: Optional[str], chosen: list, rejected: list) -> Parsed:
    """UltraFeedback-binarized: two full conversations sharing everything but the last (assistant) message."""
    chosen_msgs, rejected_msgs = _messages(chosen), _messages(rejected)
    if chosen_msgs is None or rejected_msgs is None:
        return "malformed message"
    if not chosen_msgs or not rejected_msgs or {chosen_msgs[-1]["role"], rejected_msgs[-1]["role"]} != {"assistant"}:
        return "conversation does not end with an assistant answer"
    if chosen_msgs[:-1] != rejected_msgs[:-1]:
        return "chosen and rejected conversations differ before the answer"
    shared = chosen_msgs[:-1]
    if not shared and isinstance(prompt, str):  # {"prompt": str, "chosen": [assistant message]}
        shared = [_message("user", prompt.strip())]
    return shared, chosen_msgs[-1]["content"].strip(), rejected_msgs[-1]["content"].strip()


def _parse_prompt_messages(prompt: list, chosen: Any, rejected: Any) -> Parsed:
    """TRL's conversational shape: the prompt is a message list, each answer one assistant message (or a str)."""
    messages = _messages(prompt)
    if messages is None:
        return "malformed message"
    chosen_text, rejected_text = _one_answer(chosen), _one_answer(rejected)
    if chosen_text is None or rejected_text is None:
        return "answer is not one assistant message"
    return messages, chosen_text, rejected_text


def _one_answer(value: Any) -> Optional[str]:
    if isinstance(value, str):
        return value.strip()
    messages = _messages(value)
    if messages is None or len(messages) != 1 or messages[0]["role"] != "assistant":
        return None
    return messages[0]["content"].strip()


def _parse_hh(chosen: str, rejected: str) -> Parsed:
    """HH-RLHF: the shared dialogue is everything up to and including the last "\\n\\nAssistant:"."""
    cut_chosen, cut_rejected = chosen.rfind(HH_ASSISTANT), rejected.rfind(HH_ASSISTANT)
    if cut_chosen < 0 or cut_rejected < 0:
        return "unknown shape"  # two bare strings without a prompt and without HH-RLHF turns
    if chosen[:cut_chosen] != rejected[:cut_rejected]:
        return "chosen and rejected differ before the last Assistant turn"
    prompt = _hh_messages(chosen[:cut_chosen])
    if prompt is None:
        return "text before the first Human turn"
    end = cut_chosen + len(HH_ASSISTANT)
    return prompt, chosen[end:].strip(), rejected[cut_rejected + len(HH_ASSISTANT) :].strip()


def _hh_messages(dialogue: str) -> Optional[Messages]:
    """ "\\n\\nHuman: a\\n\\nAssistant: b\\n\\nHuman: c" -> user a, assistant b, user c (None if text precedes)."""
    parts = _HH_TURN.split(dialogue)  # [before, role, content, role, content, ...]
    if parts[0].strip():
        return None
    roles = {"Human": "user", "Assistant": "assistant"}
    return [_message(roles[role], content.strip()) for role, content in zip(parts[1::2], parts[2::2])]


def _parse_sharegpt(conversations: Any, chosen: Any, rejected: Any) -> Parsed:
    """LLaMA-Factory's sharegpt preference rows (human/gpt/system turns, chosen/rejected gpt messages)."""
    if not isinstance(conversations, list):
        return "malformed message"
    prompt = []
    for turn in conversations:
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            return "malformed message"
        if turn.get("from") not in SHAREGPT_ROLES:
            return f"unknown sharegpt role {turn.get('from')!r}"
        prompt.append(_message(SHAREGPT_ROLES[turn["from"]], turn["value"]))
    answers = [a["value"] if isinstance(a, dict) else a for a in (chosen, rejected)]
    if not all(isinstance(a, str) for a in answers):
        return "malformed message"
    return prompt, answers[0].strip(), answers[1].strip()


# ------------------------------------------------------------------------------------------------------ tokenising
def encode_prompt_messages(messages: Sequence[dict], tokenizer: Any, template: PromptTemplate) -> list[int]:
    """Token ids of a prompt given as chat messages.

    chat:  the tokenizer's chat template with the generation prompt (the template holds the special tokens, so
           none are added again); plain: the contents joined with a blank line, with the tokenizer's special tokens.
    The template's instruction is not added: it is meant for math problems."""
    if template.kind == "plain":
        text = "\n\n".join(m["content"] for m in messages)
        return list(tokenizer(text, add_special_tokens=True)["input_ids"])
    if not getattr(tokenizer, "chat_template", None):
        raise no_chat_template()
    text = tokenizer.apply_chat_template([dict(m) for m in messages], tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def prompt_fits(prompt_ids: Sequence[int], max_length: Optional[int]) -> bool:
    """Whether a prompt leaves room for at least one response token within `max_length` (None: no limit)."""
    return max_length is None or len(prompt_ids) < max_length


@dataclass
class PreferenceBatch:
    input_ids: torch.Tensor  # [2P, T] int64, row 2i = pair i's chosen, row 2i+1 = its rejected
    loss_mask: torch.Tensor  # [2P, T] float32, 1 on response tokens and the end-of-turn token
    lengths: torch.Tensor  # [2P] int64 real tokens


def build_preference_batch(
    prompts: Sequence[list[int]],
    chosen: Sequence[str],
    rejected: Sequence[str],
    tokenizer: Any,
    template: PromptTemplate,
    *,
    max_length: Optional[int] = None,
    pad_to_multiple: int = 1,
    turn_end: bool = True,
) -> PreferenceBatch:
    """Token ids and response masks of P pairs, chosen and rejected interleaved (see the module docstring).

    `prompts` are encoded prompt ids (`encode_prompt_messages`). Each answer is tokenised on its own (the
    prompt/response boundary is exact) and the template's end-of-turn token appended (unless `turn_end` is False:
    reward models read the answer's last token, mrl/app/reward_model.py). A sequence longer than
    `max_length` loses the END of its response (the prompt is kept whole, at least one response token stays and
    the end of turn is then dropped); a prompt of `max_length` tokens or more is an error (filter pairs with
    `prompt_fits` first). T is max(lengths) + 1 rounded up to `pad_to_multiple`, so it may exceed `max_length`."""
    if not len(prompts) == len(chosen) == len(rejected):
        raise ValueError(f"{len(prompts)} prompts, {len(chosen)} chosen and {len(rejected)} rejected answers")
    if not prompts:
        raise ValueError("build_preference_batch needs at least one pair")
    if pad_to_multiple < 1:
        raise ValueError(f"pad_to_multiple must be >= 1, got {pad_to_multiple}")
    end = template.turn_end_id(tokenizer)
    if end is None and turn_end:
        raise ValueError("the tokenizer has no EOS token; preference training needs one to end each answer")
    rows: list[tuple[list[int], list[float]]] = []
    for index, (p_ids, answers) in enumerate(zip(prompts, zip(chosen, rejected))):
        if not prompt_fits(p_ids, max_length):
            raise ValueError(
                f"pair {index}: the prompt has {len(p_ids)} tokens and max_length is {max_length}, "
                "leaving no room for the answer; drop such pairs first (prompt_fits) or raise the "
                "max length"
            )
        for answer in answers:
            rows.append(_answer_row(list(p_ids), answer, tokenizer, end if turn_end else None, max_length))
    return _pad_rows(rows, _pad_id(tokenizer), pad_to_multiple)


def _answer_row(
    prompt_ids: list[int], answer: str, tokenizer: Any, turn_end: Optional[int], max_length: Optional[int]
) -> tuple[list[int], list[float]]:
    """(prompt + answer + end of turn (when given), its mask); the answer cut from the right to fit `max_length`."""
    response = list(tokenizer(answer, add_special_tokens=False)["input_ids"]) + (
        [turn_end] if turn_end is not None else []
    )
    if max_length is not None and len(prompt_ids) + len(response) > max_length:
        response = response[: max_length - len(prompt_ids)]  # >= 1 token: the caller checked the prompt fits
    return prompt_ids + response, [0.0] * len(prompt_ids) + [1.0] * len(response)


def _pad_id(tokenizer: Any) -> int:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError("the tokenizer has neither a pad nor an EOS token to pad preference batches with")
    return pad


def _pad_rows(rows: Iterable[tuple[list[int], list[float]]], pad: int, multiple: int) -> PreferenceBatch:
    """Right-pad to max length + 1 (one padding column at least), rounded up to `multiple`."""
    rows = list(rows)
    lengths = [len(ids) for ids, _ in rows]
    width = -(-(max(lengths) + 1) // multiple) * multiple
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)  # [2P, T]
    loss_mask = torch.zeros((len(rows), width), dtype=torch.float32)  # [2P, T]
    for i, (ids, mask) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        loss_mask[i, : len(mask)] = torch.tensor(mask, dtype=torch.float32)
    return PreferenceBatch(input_ids, loss_mask, torch.tensor(lengths, dtype=torch.long))
