"""A trained reward model as a GRPO reward, alone or combined with the task's verifier:
    reward_i = weight * r(prompt_i, response_i) + verifier_weight * verifier_i
where r is the reward model's score at the response's last token (mrl/algorithms/rm.py) and verifier_i the wrapped
environment's 0/1 score (math or arith). The reward model runs in its own Megatron worker group (frozen, no optimizer:
`PolicySpec.trainable=False`), in the policy's parallel layout, and scores token ids: the rollout's own prompt and
response tokens (metadata `prompt_token_ids`, `response_token_ids`), so it must share the policy's tokenizer (checked
when the run starts). As in training (mrl/app/reward_model.py), a response's closing end-of-turn token is left off,
so a finished response and one cut at the length limit are both read at their last content token (the verifier
scores the cut one 0). The per-sample score is kept in the metadata as `reward_model_score`.
"""

from __future__ import annotations

from typing import Any, Collection, Mapping, Protocol, Sequence

import torch

from mrl.environments.base import PROMPT_TOKEN_IDS, RESPONSE_TOKEN_IDS, Environment, EnvironmentStep, Message
from mrl.policy.interface import RankBatch

REWARD_MODEL_SCORE = "reward_model_score"
#: Sequences per scoring call.
ROWS_PER_CALL = 256


class Scorer(Protocol):
    """A reward model's worker group (`mrl.policy.group.Policy` built on a reward model)."""

    @property
    def data_parallel_size(self) -> int: ...

    def scores(self, batch: RankBatch) -> torch.Tensor: ...


def sequence_rows(sequences: Sequence[Sequence[int]], pad_id: int, data_parallel: int) -> RankBatch:
    """Right-padded rows of whole sequences (repeated up to a multiple of `data_parallel`), every token in the mask."""
    rows = list(sequences) + [sequences[0]] * (-len(sequences) % data_parallel)
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    lengths = torch.tensor([len(r) for r in rows])
    mask = (torch.arange(width)[None, :] < lengths[:, None]).float()
    return RankBatch(ids, mask, lengths=lengths)


class RewardModelEnvironment:
    """Wraps a verifier environment and adds the reward model's score (see the module docstring)."""

    def __init__(
        self,
        verifier: Environment,
        scorer: Scorer,
        *,
        pad_id: int,
        weight: float = 1.0,
        verifier_weight: float = 0.0,
        end_token_ids: Collection[int] = (),
    ) -> None:
        self.verifier, self.scorer, self.pad_id = verifier, scorer, pad_id
        self.weight, self.verifier_weight = weight, verifier_weight
        self.end_token_ids = set(end_token_ids)  # a response's closing token(s), left off before scoring

    def _content(self, response: Sequence[int]) -> list[int]:
        response = list(response)
        return response[:-1] if response and response[-1] in self.end_token_ids else response

    def score(self, metadata: Sequence[Mapping[str, Any]]) -> torch.Tensor:
        """[N] reward-model scores of the samples' prompt + response tokens."""
        sequences = []
        for i, meta in enumerate(metadata):
            if PROMPT_TOKEN_IDS not in meta or RESPONSE_TOKEN_IDS not in meta:
                raise KeyError(
                    f"sample {i}: the reward model needs '{PROMPT_TOKEN_IDS}' and '{RESPONSE_TOKEN_IDS}' "
                    "in the environment metadata (mrl.algorithms.rollout adds them)"
                )
            sequences.append(list(meta[PROMPT_TOKEN_IDS]) + self._content(meta[RESPONSE_TOKEN_IDS]))
        out = []
        for start in range(0, len(sequences), ROWS_PER_CALL):
            chunk = sequences[start : start + ROWS_PER_CALL]
            scores = self.scorer.scores(sequence_rows(chunk, self.pad_id, self.scorer.data_parallel_size))
            out.append(scores[: len(chunk)].float())
        return torch.cat(out) if out else torch.zeros(0)

    def step(self, message_logs: Sequence[Sequence[Message]], metadata: Sequence[Mapping[str, Any]]) -> EnvironmentStep:
        result = self.verifier.step(message_logs, metadata)
        scores = self.score(metadata)
        result.rewards = self.weight * scores + self.verifier_weight * result.rewards.float()
        result.metadata = [dict(m, **{REWARD_MODEL_SCORE: float(s)}) for m, s in zip(result.metadata, scores)]
        return result

    def shutdown(self) -> None:
        self.verifier.shutdown()
