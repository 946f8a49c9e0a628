"""Preference pairs from a model's own answers: right against wrong for the same question, each sample used once,
questions answered all right or all wrong left out, and the file `mrl dpo` reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mrl.app.self_pairs import main, pairs_from_samples
from mrl.data.preferences import load_preferences


def _sample(index: int, response: str, reward: float, problem: str = "What is 7 times 5?") -> dict:
    return {"problem_index": index, "sample_index": 0, "problem": problem, "prompt": "<templated>",
            "response": response, "gold_answer": "35", "extracted_answer": None, "reward": reward,
            "finish_reason": "stop"}


SAMPLES = [_sample(0, "35", 1.0), _sample(0, "7 * 5 = 35", 1.0), _sample(0, "36", 0.0), _sample(0, "To solve", 0.0),
           _sample(0, "36", 0.0), _sample(1, "12", 1.0, "What is 3 times 4?"), _sample(1, "12", 1.0, "What is 3 times 4?"),
           _sample(2, "10", 0.0, "What is 2 times 4?")]


def test_pairs_put_a_right_answer_over_a_wrong_one_for_the_same_question():
    pairs = pairs_from_samples(SAMPLES, "Answer with the number only.", max_pairs_per_problem=5)
    # question 0: two distinct right, two distinct wrong ("36" twice counts once) -> two pairs; 1 all right, 2 all wrong
    assert len(pairs) == 2
    assert {p["prompt"] for p in pairs} == {"What is 7 times 5? Answer with the number only."}
    assert {p["chosen"] for p in pairs} == {"35", "7 * 5 = 35"} and {p["rejected"] for p in pairs} == {"36", "To solve"}
    assert pairs_from_samples(SAMPLES, "x", max_pairs_per_problem=1)[0]["prompt"] == "What is 7 times 5? x"
    assert len(pairs_from_samples(SAMPLES, "x", max_pairs_per_problem=1)) == 1
    assert pairs_from_samples(SAMPLES, "x", seed=3) == pairs_from_samples(SAMPLES, "x", seed=3)


def test_samples_without_the_problem_text_are_refused():
    with pytest.raises(ValueError, match=r"lacks \['problem'\]"):
        pairs_from_samples([{k: v for k, v in SAMPLES[0].items() if k != "problem"}], "")


def test_the_written_pairs_are_what_dpo_reads(tmp_path: Path, capsys):
    samples = tmp_path / "samples.jsonl"
    samples.write_text("".join(json.dumps(s) + "\n" for s in SAMPLES))
    assert main(["--samples", str(samples), "--out", str(tmp_path / "pairs.jsonl"), "--instruction", "Be brief."]) == 0
    assert "2 pairs from 8 samples of 3 questions" in capsys.readouterr().out
    loaded = load_preferences(tmp_path / "pairs.jsonl")
    assert len(loaded) == 2 and loaded.num_skipped == 0
    pair = loaded.pairs[0]
    assert pair.prompt[-1]["content"] == "What is 7 times 5? Be brief." and pair.chosen in ("35", "7 * 5 = 35")


def test_likeliest_pairs_the_wrong_answers_the_model_finds_likeliest_first():
    logprobs = {"35": -0.2, "7 * 5 = 35": -0.4, "36": -0.1, "To solve": -2.5, "12": -0.3, "10": -0.3}
    samples = [{**s, "mean_logprob": logprobs[s["response"]]} for s in SAMPLES]
    one = pairs_from_samples(samples, "x", max_pairs_per_problem=1, rejected="likeliest")
    assert [p["rejected"] for p in one] == ["36"]  # -0.1 beats the ramble's -2.5, whatever the seed
    assert all(pairs_from_samples(samples, "x", 1, seed, "likeliest")[0]["rejected"] == "36" for seed in range(8))
    # random takes the ramble for some seeds: the two modes differ
    assert {pairs_from_samples(samples, "x", 1, seed)[0]["rejected"] for seed in range(8)} == {"36", "To solve"}
    with pytest.raises(ValueError, match=r"lacks \['mean_logprob'\]"):
        pairs_from_samples(SAMPLES, "x", rejected="likeliest")
    with pytest.raises(ValueError, match="one of"):
        pairs_from_samples(samples, "x", rejected="hardest")
