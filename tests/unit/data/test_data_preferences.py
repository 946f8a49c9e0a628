"""Preference pairs from files (every accepted shape, bad rows skipped and counted) and preference batches."""

import json
from collections import Counter

import pytest
import torch

from mrl.config.errors import ConfigError
from mrl.data.preferences import (PreferencePair, build_preference_batch, encode_prompt_messages, load_preferences,
                                  prompt_fits)
from mrl.data.templates import PromptTemplate

pytestmark = pytest.mark.unit

PLAIN = PromptTemplate(kind="plain", instruction="")


def write_jsonl(path, lines):
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


# --------------------------------------------------------------------------------------------------------- shapes
def test_plain_rows(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": " What is 1+1? ", "chosen": " 2 ", "rejected": "3",
                                               "score": 1}])
    assert load_preferences(path).pairs == [PreferencePair((user("What is 1+1?"),), "2", "3", 0)]


def test_ultrafeedback_and_trl_conversational_rows(tmp_path):
    convo = [{"role": "system", "content": "Be brief."}, user("Hi"), assistant("Hello"), user("Capital of France?")]
    path = write_jsonl(tmp_path / "uf.jsonl", [
        {"prompt": "Capital of France?", "prompt_id": "x",
         "chosen": convo + [assistant("Paris.")], "rejected": convo + [assistant("Lyon.")]},
        {"chosen": [user("2+2?"), assistant("4")], "rejected": [user("2+2?"), assistant("5")]},  # no prompt key
        {"prompt": "Name a color", "chosen": [assistant("red")], "rejected": [assistant("")]},   # empty rejected
        {"prompt": "Q", "chosen": [user("Q"), assistant("a")], "rejected": [user("other Q"), assistant("b")]},
        {"prompt": [user("Why?")], "chosen": [assistant(" Because. ")], "rejected": [assistant("No idea.")]},  # TRL
        {"prompt": [user("Why?")], "chosen": "Because.", "rejected": "No idea."},  # TRL, string answers
        {"prompt": "Sky?", "chosen": [assistant("blue")], "rejected": [assistant("green")]},
    ])
    data = load_preferences(path)
    assert data.pairs == [
        PreferencePair(tuple(convo), "Paris.", "Lyon.", 0),
        PreferencePair((user("2+2?"),), "4", "5", 1),
        PreferencePair((user("Why?"),), "Because.", "No idea.", 4),
        PreferencePair((user("Why?"),), "Because.", "No idea.", 5),
        PreferencePair((user("Sky?"),), "blue", "green", 6),
    ]
    assert data.skipped == Counter({"empty rejected": 1,
                                    "chosen and rejected conversations differ before the answer": 1})


def test_hh_rlhf_rows(tmp_path):
    dialogue = "\n\nHuman: Hi there\n\nAssistant: Hello! How can I help?\n\nHuman: Tell me a joke.\n\nAssistant:"
    path = write_jsonl(tmp_path / "hh.jsonl", [
        {"chosen": dialogue + " Why did the chicken cross the road?", "rejected": dialogue + " No."},
        {"chosen": "\n\nHuman: A\n\nAssistant: yes", "rejected": "\n\nHuman: B\n\nAssistant: no"},
    ])
    data = load_preferences(path)
    prompt = (user("Hi there"), assistant("Hello! How can I help?"), user("Tell me a joke."))
    assert data.pairs == [PreferencePair(prompt, "Why did the chicken cross the road?", "No.", 0)]
    assert data.skipped == Counter({"chosen and rejected differ before the last Assistant turn": 1})


def test_sharegpt_rows_in_a_json_array_file(tmp_path):
    rows = [
        {"conversations": [{"from": "system", "value": "You are kind."}, {"from": "human", "value": "Hello"},
                           {"from": "gpt", "value": "Hi!"}, {"from": "human", "value": "How are you?"}],
         "chosen": {"from": "gpt", "value": "Fine, thanks."}, "rejected": {"from": "gpt", "value": "Go away."}},
        {"conversations": [{"from": "human", "value": "Same?"}],
         "chosen": {"from": "gpt", "value": "same"}, "rejected": {"from": "gpt", "value": " same "}},
        {"conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}],  # ends with gpt
         "chosen": {"from": "gpt", "value": "x"}, "rejected": {"from": "gpt", "value": "y"}},
    ]
    path = tmp_path / "dpo_en_demo.json"
    path.write_text(json.dumps(rows, indent=2))  # one JSON array over many lines, as LLaMA-Factory ships it
    data = load_preferences(path)
    prompt = ({"role": "system", "content": "You are kind."}, user("Hello"), assistant("Hi!"), user("How are you?"))
    assert data.pairs == [PreferencePair(prompt, "Fine, thanks.", "Go away.", 0)]
    assert data.skipped == Counter({"chosen equals rejected": 1, "prompt does not end with a user turn": 1})


def test_parquet_rows_and_max_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "prefs.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": f"Q{i}", "chosen": f"good {i}", "rejected": f"bad {i}"}
                                         for i in range(5)]), path)
    data = load_preferences(path, max_rows=2)
    assert data.pairs == [PreferencePair((user("Q0"),), "good 0", "bad 0", 0),
                          PreferencePair((user("Q1"),), "good 1", "bad 1", 1)]


def test_bad_rows_are_skipped_and_counted_by_reason(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [
        {"prompt": "ok", "chosen": "a", "rejected": "b"},
        "{not json",
        "[1, 2]",
        {"question": "q", "answer": "a"},                     # unknown shape
        {"chosen": "just text", "rejected": "other text"},    # two strings, no prompt, no HH turns: unknown
        {"prompt": "q", "chosen": "   ", "rejected": "b"},
        {"prompt": "q", "chosen": "same", "rejected": "same"},
        {"prompt": [assistant("hi")], "chosen": "a", "rejected": "b"},
        {"prompt": [user("q")], "chosen": [assistant("a"), assistant("b")], "rejected": "c"},
        {"chosen": [user("q"), {"role": "assistant"}], "rejected": [user("q"), assistant("b")]},
        "",                                                   # blank line: ignored, not counted
    ])
    data = load_preferences(path)
    assert len(data) == 1 and data.num_skipped == 9
    assert data.skipped == Counter({"invalid JSON": 1, "not an object": 1, "unknown shape": 2, "empty chosen": 1,
                                    "chosen equals rejected": 1, "prompt does not end with a user turn": 1,
                                    "answer is not one assistant message": 1, "malformed message": 1})


def test_no_usable_row_names_the_columns_and_the_shapes(tmp_path):
    path = write_jsonl(tmp_path / "wrong.jsonl", [{"question": "q", "good": "a", "bad": "b"}])
    with pytest.raises(ConfigError, match=r"columns found: bad, good, question") as err:
        load_preferences(path, key="data.val")
    assert err.value.key == "data.val" and "unknown shape" in err.value.message and "sharegpt" in err.value.allowed
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_preferences(tmp_path / "missing.jsonl")


def test_empty_and_unparsable_preference_files_are_config_errors(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ConfigError, match="it is empty") as err:
        load_preferences(tmp_path / "empty.jsonl")
    assert err.value.key == "data.train"
    write_jsonl(tmp_path / "bad.jsonl", ["{oops", "nope"])
    with pytest.raises(ConfigError, match="none of its 2 lines is valid JSON"):
        load_preferences(tmp_path / "bad.jsonl")


# ------------------------------------------------------------------------------------------------------- encoding
def test_chat_prompt_is_the_tokenizers_chat_template(tmp_path):
    from transformers import AutoTokenizer

    from mrl.testing.tiny_models import build_tokenizer

    tok = AutoTokenizer.from_pretrained(build_tokenizer(tmp_path / "tok"))
    messages = (user("Hi"), assistant("Hello"), user("What is 2+2?"))
    text = tok.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")  # no instruction
    ids = encode_prompt_messages(messages, tok, PromptTemplate("chat"))
    assert ids == tok(text, add_special_tokens=False)["input_ids"]
    tok.chat_template = None
    with pytest.raises(ValueError, match="prompt_template=plain"):
        encode_prompt_messages(messages, tok, PromptTemplate("chat"))


def test_plain_prompt_joins_the_contents():
    from mrl.data.arith import build_arith_tokenizer

    tok = build_arith_tokenizer()
    assert encode_prompt_messages([user("12+3=")], tok, PLAIN) == tok("12+3=")["input_ids"] == [4, 5, 13, 6, 14]
    two = encode_prompt_messages([user("1"), assistant("2"), user("3")], tok, PLAIN)
    assert two == tok("1\n\n2\n\n3")["input_ids"]


# -------------------------------------------------------------------------------------------------------- batches
def test_batch_interleaves_chosen_and_rejected_with_an_extra_padding_column():
    from mrl.data.arith import build_arith_tokenizer

    tok = build_arith_tokenizer()
    eos, pad = tok.eos_token_id, tok.pad_token_id  # 0, 1; "0".."9" are 3..12, "+" 13, "=" 14
    prompts = [tok("1+1=")["input_ids"], tok("9=")["input_ids"]]
    batch = build_preference_batch(prompts, ["2", "9"], ["33", "8"], tok, PLAIN)
    assert batch.input_ids.tolist() == [
        [4, 13, 4, 14, 5, eos, pad, pad],      # pair 0 chosen
        [4, 13, 4, 14, 6, 6, eos, pad],        # pair 0 rejected
        [12, 14, 12, eos, pad, pad, pad, pad],  # pair 1 chosen
        [12, 14, 11, eos, pad, pad, pad, pad],  # pair 1 rejected
    ]
    assert batch.loss_mask.tolist() == [
        [0, 0, 0, 0, 1, 1, 0, 0],
        [0, 0, 0, 0, 1, 1, 1, 0],
        [0, 0, 1, 1, 0, 0, 0, 0],
        [0, 0, 1, 1, 0, 0, 0, 0],
    ]
    assert batch.lengths.tolist() == [6, 7, 4, 4]
    assert batch.input_ids.dtype == batch.lengths.dtype == torch.int64 and batch.loss_mask.dtype == torch.float32
    assert build_preference_batch(prompts, ["2", "9"], ["33", "8"], tok, PLAIN, pad_to_multiple=5).input_ids.shape \
        == (4, 10)


def test_overlong_answers_are_cut_from_the_right_and_overlong_prompts_refused():
    from mrl.data.arith import build_arith_tokenizer

    tok = build_arith_tokenizer()
    eos, pad = tok.eos_token_id, tok.pad_token_id
    prompt = tok("1+1=")["input_ids"]  # 4 tokens
    batch = build_preference_batch([prompt], ["2"], ["12345"], tok, PLAIN, max_length=6)
    assert batch.input_ids.tolist() == [[4, 13, 4, 14, 5, eos, pad],  # fits exactly: keeps its end of turn
                                        [4, 13, 4, 14, 4, 5, pad]]    # cut to 2 answer tokens, no end of turn
    assert batch.loss_mask.tolist() == [[0, 0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 1, 1, 0]]
    assert batch.lengths.tolist() == [6, 6]
    one = build_preference_batch([prompt], ["2"], ["12345"], tok, PLAIN, max_length=5)
    assert one.input_ids[:, :5].tolist() == [[4, 13, 4, 14, 5], [4, 13, 4, 14, 4]]  # one answer token each
    assert one.loss_mask.sum(dim=1).tolist() == [1, 1]
    assert prompt_fits(prompt, 5) and not prompt_fits(prompt, 4) and prompt_fits(prompt, None)
    with pytest.raises(ValueError, match=r"pair 1: the prompt has 4 tokens and max_length is 4.*prompt_fits"):
        build_preference_batch([[4], prompt], ["2", "2"], ["3", "3"], tok, PLAIN, max_length=4)
    with pytest.raises(ValueError, match="1 prompts, 2 chosen"):
        build_preference_batch([prompt], ["2", "3"], ["3"], tok, PLAIN)
