"""The synthetic arithmetic task: determinism, the held-out split and the near-miss SFT labels."""

import random

import pytest

from mrl.data.arith import ArithTask, build_arith_tokenizer


def test_prompts_are_fixed_width_and_answers_exact():
    task = ArithTask(digits=2, num_heldout=200, seed=0)
    assert task.prompt(37, 5) == "37+05="
    problems = task.train_problems()
    assert all(len(p.problem) == 6 for p in problems)
    assert all(int(p.answer) == int(p.problem[:2]) + int(p.problem[3:5]) for p in problems)


def test_heldout_split_is_disjoint_and_deterministic():
    task = ArithTask(digits=2, num_heldout=200, seed=0)
    assert len(task.heldout_pairs) == 200 and len(task.train_pairs) == 100 * 100 - 200
    assert not set(task.heldout_pairs) & set(task.train_pairs)
    assert ArithTask(digits=2, num_heldout=200, seed=0).heldout_pairs == task.heldout_pairs
    assert ArithTask(digits=2, num_heldout=200, seed=1).heldout_pairs != task.heldout_pairs
    examples = task.sft_examples(random.Random(0), 2000)
    heldout_prompts = {task.prompt(a, b) for a, b in task.heldout_pairs}
    assert not any(e.prompt in heldout_prompts for e in examples)


def test_sft_labels_carry_the_near_miss_fraction():
    task = ArithTask(digits=2, num_heldout=200, near_miss_fraction=0.3, seed=0)
    examples = task.sft_examples(random.Random(1), 4000)
    wrong = [e for e in examples if not e.correct]
    assert abs(len(wrong) / len(examples) - 0.3) < 0.03
    for e in examples:
        truth = int(e.prompt[:2]) + int(e.prompt[3:5])
        offset = int(e.target) - truth
        assert (offset == 0) == e.correct and offset in (0, -2, -1, 1, 2) and int(e.target) >= 0
    assert task.sft_examples(random.Random(1), 50) == examples[:50]


def test_invalid_settings_name_the_key():
    with pytest.raises(ValueError, match="num_heldout"):
        ArithTask(digits=1, num_heldout=200)
    with pytest.raises(ValueError, match="near_miss_fraction"):
        ArithTask(near_miss_fraction=1.5)


def test_character_tokenizer_one_token_per_character():
    tok = build_arith_tokenizer()
    assert len(tok) == 17
    ids = tok("37+05=42")["input_ids"]
    assert len(ids) == 8 and tok.decode(ids) == "37+05=42"
    assert tok.eos_token_id == 0 and tok.pad_token_id == 1


def test_sft_batch_masks_the_response_and_eos():
    from mrl.data.sft import build_sft_batch
    from mrl.data.templates import PromptTemplate

    tok = build_arith_tokenizer()
    batch = build_sft_batch(["37+05=", "1+2="], ["42", "3"], tok, PromptTemplate("plain", instruction=""))
    eos, pad = tok.eos_token_id, tok.pad_token_id
    assert batch.input_ids[0].tolist() == tok("37+05=42")["input_ids"] + [eos]
    assert batch.input_ids[1].tolist() == tok("1+2=3")["input_ids"] + [eos] + [pad] * 3
    assert batch.loss_mask.tolist() == [[0] * 6 + [1, 1, 1], [0] * 4 + [1, 1] + [0] * 3]
    assert batch.lengths.tolist() == [9, 6] and batch.num_truncated == 0
    cut = build_sft_batch(["37+05=", "1+2="], ["42", "3"], tok, PromptTemplate("plain", instruction=""), max_length=7)
    assert cut.input_ids[0].tolist() == tok("37+05=4")["input_ids"]  # the first 7 tokens: the answer loses its end
    assert cut.loss_mask.tolist() == [[0] * 6 + [1], [0] * 4 + [1, 1, 0]]
    assert cut.lengths.tolist() == [7, 6] and cut.num_truncated == 1
