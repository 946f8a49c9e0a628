"""The synthetic task of the embedded CPU recipe: fixed-width addition, "37+05=" -> "42" then EOS.

Why this task (measured, see the project notes): with one character per token every prompt has the same length,
a 1M-parameter model learns it in minutes on 2 cores, and GRPO visibly improves on it when the SFT warm-up was
trained on labels of which a fraction are near misses (a+b +-1 or +-2): the SFT policy then puts only part of its
mass on the right answer and a 0/1 correctness reward has something to move.

Determinism: all pairs are shuffled once with `seed`; the first `num_heldout` are the held-out split, never used
for SFT or GRPO; the SFT labels and near misses come from the caller's `random.Random`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from mrl.data.datasets import Problem

ARITH_CHARACTERS = list("0123456789+=- ")
ARITH_SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>", "<|unk|>"]
NEAR_MISS_OFFSETS = (-2, -1, 1, 2)


@dataclass(frozen=True)
class SFTExample:
    prompt: str
    target: str  # the label (possibly a near miss), without EOS
    correct: bool


class ArithTask:
    """Two-operand addition with `digits`-digit zero-padded operands."""

    def __init__(
        self,
        digits: int = 2,
        num_heldout: int = 200,
        near_miss_fraction: float = 0.5,
        seed: int = 0,
        label_offset: int = 0,
        context_examples: int = 0,
    ):
        if digits < 1:
            raise ValueError(f"data.arith.digits must be >= 1, got {digits}")
        if not 0 <= near_miss_fraction <= 1:
            raise ValueError(f"data.arith.near_miss_fraction must be in [0, 1], got {near_miss_fraction}")
        self.digits = digits
        self.near_miss_fraction = near_miss_fraction
        self.label_offset = label_offset
        self.context_examples = context_examples
        largest = 10**digits - 1
        pairs = [(a, b) for a in range(largest + 1) for b in range(largest + 1)]
        if not 0 < num_heldout <= len(pairs) // 2:
            raise ValueError(
                f"data.arith.num_heldout={num_heldout} must be between 1 and half of the "
                f"{len(pairs)} pairs of {digits}-digit addition; lower it or raise data.arith.digits"
            )
        random.Random(seed).shuffle(pairs)
        self.heldout_pairs: list[tuple[int, int]] = pairs[:num_heldout]
        self.train_pairs: list[tuple[int, int]] = pairs[num_heldout:]

    @classmethod
    def from_config(cls, cfg: Any, seed: int) -> "ArithTask":
        """From an `ArithTaskConfig` (data.arith) and the run's seed."""
        return cls(cfg.digits, cfg.num_heldout, cfg.near_miss_fraction, seed, cfg.label_offset, cfg.context_examples)

    def question(self, a: int, b: int) -> str:
        return f"{a:0{self.digits}d}+{b:0{self.digits}d}="

    def prompt(self, a: int, b: int) -> str:
        """The question, after `context_examples` solved training pairs when set. The pairs are drawn with a seed of
        the question itself, so a prompt is the same in every split, order and stage; held-out pairs never appear."""
        if not self.context_examples:
            return self.question(a, b)
        rng = random.Random(a * 10**self.digits + b)
        shots = [rng.choice(self.train_pairs) for _ in range(self.context_examples)]
        return "".join(f"{self.question(x, y)}{x + y} " for x, y in shots) + self.question(a, b)

    def _problems(self, pairs: list[tuple[int, int]]) -> list[Problem]:
        return [Problem(self.prompt(a, b), str(a + b), i) for i, (a, b) in enumerate(pairs)]

    def train_problems(self) -> list[Problem]:
        return self._problems(self.train_pairs)

    def heldout_problems(self) -> list[Problem]:
        return self._problems(self.heldout_pairs)

    @staticmethod
    def near_miss(rng: random.Random, a: int, b: int) -> int:
        """A wrong, non-negative answer within 2 of a+b."""
        while True:
            wrong = a + b + rng.choice(NEAR_MISS_OFFSETS)
            if wrong >= 0:
                return wrong

    def sft_examples(self, rng: random.Random, count: int) -> list[SFTExample]:
        """`count` training pairs drawn with replacement; a `near_miss_fraction` of the labels are near misses, the
        others a+b+label_offset (a systematic labelling error when the offset is not 0)."""
        out = []
        for _ in range(count):
            a, b = rng.choice(self.train_pairs)
            wrong = rng.random() < self.near_miss_fraction
            answer = self.near_miss(rng, a, b) if wrong else a + b + self.label_offset
            out.append(SFTExample(self.prompt(a, b), str(answer), not wrong and self.label_offset == 0))
        return out

    def preference_triples(self, pairs: list[tuple[int, int]], seed: int) -> list[tuple[str, str, str]]:
        """(prompt, chosen, rejected) for each operand pair: the right sum is preferred to the SFT labels' systematic
        error a+b+label_offset, or (offset 0) to a near miss drawn with `seed`. A checkable preference: DPO and
        reward models on this task are judged by whether they prefer the right sum."""
        rng = random.Random(seed)
        wrong = lambda a, b: a + b + self.label_offset if self.label_offset else self.near_miss(rng, a, b)  # noqa: E731
        return [(self.prompt(a, b), str(a + b), str(wrong(a, b))) for a, b in pairs]


def build_arith_tokenizer() -> Any:
    """A character-level tokenizer (one token per character, vocabulary of 17) with EOS/pad/unk special tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(ARITH_SPECIAL_TOKENS + ARITH_CHARACTERS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|unk|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>", unk_token="<|unk|>"
    )
