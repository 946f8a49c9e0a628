"""The prompt and response path with the real Qwen3, DeepSeek-V3 and Llama-3 tokenizers: the prompt ids are exactly
the chat template's rendering as the tokenizer itself tokenises it (one BOS at most, never two), a response ends
with the template's own end-of-turn token (Llama-3: <|eot_id|>, not its EOS <|end_of_text|>), generation stops on
it, and the SFT loss mask covers the response and that token only."""

from __future__ import annotations

import pytest

from mrl.config import load_config
from mrl.data.sft import build_sft_batch
from mrl.data.templates import PromptTemplate
from mrl.inference.factory import sampling_config

# name -> (the token that closes an assistant turn, BOS tokens at the start of a prompt)
EXPECTED = {"qwen3": ("<|im_end|>", 0), "deepseek_v3": ("<｜end▁of▁sentence｜>", 1), "llama3": ("<|eot_id|>", 1)}
PROBLEM = "Janet's ducks lay 16 eggs per day. She eats three. How many are left?"
RESPONSE = "16 - 3 = 13 eggs are left. The answer is \\boxed{13}."


@pytest.fixture(scope="module", params=list(EXPECTED))
def tokenizer(request, real_assets):
    from transformers import AutoTokenizer

    return request.param, AutoTokenizer.from_pretrained(real_assets / "tokenizers" / request.param)


def test_prompt_ids_are_the_chat_templates_own_tokens(tokenizer):
    name, tok = tokenizer
    template = PromptTemplate("chat")
    (ids,), kept = template.encode([PROBLEM], tok)
    messages = [{"role": "user", "content": template.user_text(PROBLEM)}]
    expected = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert kept == [0] and ids == list(expected)
    assert tok.decode(ids) == template.render(PROBLEM, tok)
    bos_count = EXPECTED[name][1]
    assert ids.count(tok.bos_token_id) == bos_count if tok.bos_token_id is not None else bos_count == 0
    if bos_count:
        assert ids[0] == tok.bos_token_id


def test_a_response_ends_with_the_templates_end_of_turn_and_generation_stops_there(tokenizer, tmp_path):
    name, tok = tokenizer
    turn_end = PromptTemplate("chat").turn_end_id(tok)
    assert tok.convert_ids_to_tokens(turn_end) == EXPECTED[name][0]
    cfg = load_config(None, [f"run.output_dir={tmp_path}", "generation.stop_token_ids=[7]"])
    for purpose in ("train", "eval"):
        assert sampling_config(cfg, purpose=purpose, turn_end_id=turn_end).stop_token_ids == (7, turn_end)


def test_sft_loss_mask_covers_only_the_response_and_its_end_of_turn(tokenizer):
    _, tok = tokenizer
    template = PromptTemplate("chat")
    batch = build_sft_batch([PROBLEM], [RESPONSE], tok, template)
    (prompt,), _ = template.encode([PROBLEM], tok)
    length = int(batch.lengths[0])
    masked = [i for i, m in enumerate(batch.loss_mask[0].tolist()) if m]
    assert masked == list(range(len(prompt), length))
    assert batch.input_ids[0, : len(prompt)].tolist() == prompt
    response_ids = batch.input_ids[0, len(prompt):length].tolist()
    assert response_ids[-1] == template.turn_end_id(tok)
    assert tok.decode(response_ids[:-1]) == RESPONSE
