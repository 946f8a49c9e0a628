"""Problem datasets from files (bad rows skipped and counted), prompt templates and the resumable data loader."""

import json
from collections import Counter

import pytest

from mrl.config.errors import ConfigError
from mrl.data.dataloader import PromptDataLoader
from mrl.data.datasets import Problem, load_problems
from mrl.data.templates import COT_INSTRUCTION, PromptTemplate


def write_jsonl(path, lines):
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


def test_jsonl_rows_are_read_and_bad_rows_skipped_and_counted(tmp_path, caplog):
    path = write_jsonl(tmp_path / "train.jsonl", [
        {"problem": "What is 1+1?", "answer": "2", "solution": "..."},
        {"problem": "  Half of one? ", "answer": "\\frac{1}{2}"},
        {"problem": "Integer answer", "answer": 42},
        {"problem": "Float answer", "answer": 3.0},
        {"answer": "1"},                                  # missing problem
        {"problem": "no answer"},                         # missing answer
        {"problem": "   ", "answer": "1"},                # empty problem
        {"problem": "list answer", "answer": [1, 2]},     # not a usable answer
        {"problem": 7, "answer": "7"},                    # a number is no problem text
        {"problem": None, "answer": "1"},                 # null
        "{not json",                                      # invalid JSON
        "[1, 2]",                                         # not an object
        "",                                               # blank line: ignored, not counted
    ])
    data = load_problems(path)
    assert [p.problem for p in data.problems] == ["What is 1+1?", "Half of one?", "Integer answer", "Float answer"]
    assert [p.answer for p in data.problems] == ["2", "\\frac{1}{2}", "42", "3"]
    assert data.problems[1].row == 1
    assert data.skipped == Counter({"missing 'problem'": 1, "missing 'answer'": 1, "empty 'problem'": 1,
                                    "'answer' neither text nor a number (list)": 1, "'problem' not text (int)": 1,
                                    "null 'problem'": 1, "invalid JSON": 1, "not an object": 1})
    assert data.num_skipped == 8
    assert "invalid JSON: 11; not an object: 12" in caplog.text  # where to look, line by line from 1


def test_configurable_columns_and_max_rows(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": f"q{i}", "final": str(i)} for i in range(5)])
    data = load_problems(path, problem_key="question", answer_key="final", max_rows=3)
    assert data.problems == [Problem(f"q{i}", str(i), i) for i in range(3)]


def test_wrong_columns_name_the_keys_to_set(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "q", "final": "1"}])
    with pytest.raises(ConfigError) as err:
        load_problems(path)
    assert err.value.key == "data.problem_key" and err.value.given == "problem"
    assert err.value.allowed == "columns found: final, question" and str(path) in err.value.message


def test_a_missing_answer_column_names_data_answer_key_and_the_closest_column(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"problem": "1+1", "final_answer": "2"}, "{broken"])
    with pytest.raises(ConfigError) as err:
        load_problems(path, key="data.val")
    assert err.value.key == "data.answer_key"
    assert err.value.message == f"{path}: 1 of its 2 rows lack the column 'answer', and no row is usable"
    assert err.value.fix == "data.answer_key=final_answer"   # the column found that is closest to the one asked


def test_empty_and_unparsable_files_name_the_key_that_named_them(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ConfigError, match="it is empty") as err:
        load_problems(tmp_path / "empty.jsonl", key="eval.data")
    assert err.value.key == "eval.data" and str(tmp_path / "empty.jsonl") in err.value.message
    write_jsonl(tmp_path / "bad.jsonl", ["not json", "{bad", "[1, 2"])
    with pytest.raises(ConfigError, match="none of its 3 lines is valid JSON") as err:
        load_problems(tmp_path / "bad.jsonl")
    assert err.value.key == "data.train" and ".jsonl" in err.value.fix


def test_missing_files_and_unknown_formats_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="data.val: data file .* does not exist"):
        load_problems(tmp_path / "nope.jsonl", key="data.val")
    (tmp_path / "d.csv").write_text("problem,answer\n")
    with pytest.raises(ConfigError, match="mrl does not read the format '.csv'") as err:
        load_problems(tmp_path / "d.csv")
    assert err.value.key == "data.train" and ".jsonl" in err.value.allowed and "to_json" in err.value.fix


def test_files_in_the_wrong_format_and_folders_without_data_name_the_key(tmp_path):
    pytest.importorskip("pyarrow")
    (tmp_path / "binary.jsonl").write_bytes(b"PAR1\x15\x04\xff\xfe rows")  # Parquet bytes under a text name
    with pytest.raises(ConfigError, match="is not UTF-8 text") as err:
        load_problems(tmp_path / "binary.jsonl", key="data.val")
    assert err.value.key == "data.val" and ".parquet" in err.value.fix
    write_jsonl(tmp_path / "rows.parquet", [{"problem": "a", "answer": "1"}])  # JSON lines under a Parquet name
    with pytest.raises(ConfigError, match="is not a readable Parquet file") as err:
        load_problems(tmp_path / "rows.parquet")
    assert err.value.key == "data.train" and ".jsonl" in err.value.fix
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "notes.txt").write_text("no data here")
    with pytest.raises(ConfigError, match="no 'train' split") as err:
        load_problems(tmp_path / "folder")
    assert err.value.key == "data.train" and "'train' split" in err.value.fix


def test_text_in_another_encoding_names_its_line_and_byte_and_how_to_re_encode_it(tmp_path):
    latin1 = tmp_path / "rows.jsonl"
    rows = '{"problem": "1+1", "answer": "2"}\n{"problem": "caf\u00e9", "answer": "1"}\n'
    latin1.write_bytes(rows.encode("latin-1"))  # as a Windows-1252 editor or spreadsheet export saves it
    with pytest.raises(ConfigError) as err:
        load_problems(latin1, key="data.val")
    assert err.value.key == "data.val"
    assert err.value.message == (f"{latin1} is not UTF-8 text (line 2: byte 0xe9): saved in latin-1 or another "
                                 "8-bit encoding?")
    assert f"iconv -f latin1 -t utf-8 {latin1} > {tmp_path / 'rows-utf8.jsonl'}" in err.value.fix


def test_a_byte_order_mark_is_not_a_bad_first_row(tmp_path):
    rows = [{"problem": "a", "answer": "1"}, {"problem": "b", "answer": "2"}]
    for name, text in (("rows.jsonl", "\n".join(json.dumps(r) for r in rows)), ("rows.json", json.dumps(rows))):
        (tmp_path / name).write_text(text, encoding="utf-8-sig")  # as Windows editors save UTF-8
        data = load_problems(tmp_path / name)
        assert [p.problem for p in data.problems] == ["a", "b"] and data.num_skipped == 0, name


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.table({"problem": ["a", "", "c"], "answer": ["1", "2", None]})
    pq.write_table(table, tmp_path / "d.parquet")
    data = load_problems(tmp_path / "d.parquet")
    assert [p.problem for p in data.problems] == ["a"]
    assert data.num_skipped == 2


# ---------------------------------------------------------------------------------------------------- templates
def test_plain_template():
    assert PromptTemplate("plain").render("What is 2+2?") == f"What is 2+2? {COT_INSTRUCTION}"
    assert PromptTemplate("plain", instruction="").render("37+05=") == "37+05="
    assert COT_INSTRUCTION == "Let's think step by step and output the final answer within \\boxed{}."


def test_chat_template_uses_the_tokenizer_template(tmp_path):
    from transformers import AutoTokenizer

    from mrl.testing.tiny_models import build_tokenizer

    tok = AutoTokenizer.from_pretrained(build_tokenizer(tmp_path / "tok"))
    text = PromptTemplate("chat").render("What is 2+2?", tok)
    assert text == f"<|im_start|>user\nWhat is 2+2? {COT_INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n"
    ids, kept = PromptTemplate("chat").encode(["What is 2+2?"], tok)
    assert kept == [0] and tok.decode(ids[0]) == text
    tok.chat_template = None
    with pytest.raises(ValueError, match="prompt_template=plain"):
        PromptTemplate("chat").render("x", tok)


def test_a_response_ends_with_the_templates_end_of_turn(tmp_path):
    """ChatML closes a turn with <|im_end|>, not the EOS <|endoftext|>: chat responses stop (and SFT targets end)
    there; plain prompts end with EOS."""
    from transformers import AutoTokenizer

    from mrl.data.sft import build_sft_batch
    from mrl.testing.tiny_models import build_tokenizer

    tok = AutoTokenizer.from_pretrained(build_tokenizer(tmp_path / "tok"))
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert im_end != tok.eos_token_id
    assert PromptTemplate("chat").turn_end_id(tok) == im_end
    assert PromptTemplate("plain").turn_end_id(tok) == tok.eos_token_id
    batch = build_sft_batch(["What is 2+2?"], ["4"], tok, PromptTemplate("chat", instruction=""))
    last = int(batch.lengths[0]) - 1
    assert batch.input_ids[0, last] == im_end and batch.loss_mask[0, last] == 1
    tok.chat_template = None
    assert PromptTemplate("chat").turn_end_id(tok) == tok.eos_token_id


def test_sft_with_a_tokenizer_without_eos_is_a_configuration_error(tmp_path):
    """No EOS and no chat end-of-turn token: SFT cannot teach the model to stop; a user's mistake in their tokenizer
    folder, refused with the key and the fix (it was a ValueError's traceback)."""
    from transformers import AutoTokenizer

    from mrl.config.errors import ConfigError
    from mrl.data.sft import build_sft_batch
    from mrl.testing.tiny_models import build_tokenizer

    tok = AutoTokenizer.from_pretrained(build_tokenizer(tmp_path / "tok"))
    tok.eos_token = None
    with pytest.raises(ConfigError) as err:
        build_sft_batch(["What is 2+2?"], ["4"], tok, PromptTemplate("plain", instruction=""))
    assert err.value.key == "policy.tokenizer" and "eos_token" in err.value.fix


def test_overlong_prompts_are_rejected_or_truncated_from_the_left():
    from mrl.data.arith import build_arith_tokenizer

    tok = build_arith_tokenizer()
    template = PromptTemplate("plain", instruction="")
    ids, kept = template.encode(["1+1=", "12345+1=", "2+2="], tok, max_length=5)
    assert kept == [0, 2] and [tok.decode(x) for x in ids] == ["1+1=", "2+2="]
    ids, kept = template.encode(["12345+1="], tok, max_length=5, overlong="truncate")
    assert kept == [0] and tok.decode(ids[0]) == "45+1="


# -------------------------------------------------------------------------------------------------- data loader
def test_loader_covers_each_epoch_once_with_a_seeded_shuffle():
    loader = PromptDataLoader(list(range(10)), 3, seed=1)
    epoch0 = [next(loader) for _ in range(3)]  # 9 items; the tail item of the epoch is dropped
    assert all(len(b) == 3 for b in epoch0) and len({x for b in epoch0 for x in b}) == 9
    epoch1 = [next(loader) for _ in range(3)]
    assert loader.epoch == 1 and epoch1 != epoch0  # every epoch is reshuffled
    again = PromptDataLoader(list(range(10)), 3, seed=1)
    assert [next(again) for _ in range(3)] == epoch0
    other_seed = PromptDataLoader(list(range(10)), 3, seed=2)
    assert [next(other_seed) for _ in range(3)] != epoch0


def test_loader_resumes_exactly_from_its_state():
    items = list(range(23))
    reference = PromptDataLoader(items, 4, seed=5)
    expected = [next(reference) for _ in range(14)]  # crosses two epoch boundaries
    loader = PromptDataLoader(items, 4, seed=5)
    for _ in range(6):
        next(loader)
    state = json.loads(json.dumps(loader.state_dict()))  # survives a round trip through a checkpoint file
    resumed = PromptDataLoader(items, 4, seed=5)
    resumed.load_state_dict(state)
    assert [next(resumed) for _ in range(8)] == expected[6:]
    with pytest.raises(ValueError, match="run.seed"):
        PromptDataLoader(items, 4, seed=6).load_state_dict(state)


def test_loader_without_drop_last_and_bad_sizes():
    loader = PromptDataLoader(list(range(5)), 2, shuffle=False, drop_last=False)
    assert [next(loader) for _ in range(4)] == [[0, 1], [2, 3], [4], [0, 1]]
    with pytest.raises(ValueError, match="3 items cannot fill one batch of 4: lower the batch or add data"):
        PromptDataLoader(list(range(3)), 4)


def test_byte_level_tokenizer_declared_as_llama_is_loaded_as_written(tmp_path):
    """transformers 5 loads a byte-level BPE tokenizer whose config says LlamaTokenizerFast (DeepSeek-V3's) with
    SentencePiece's pre-tokenizer: spaces vanish. `load_tokenizer` (the workaround) keeps tokenizer.json's own."""
    import json

    from transformers import AutoTokenizer

    from mrl.data.tokenizers import load_tokenizer
    from mrl.testing.tiny_models import build_tokenizer

    folder = build_tokenizer(tmp_path / "tok")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(dict(config, tokenizer_class="LlamaTokenizerFast")))
    text = "The quick brown fox 12 + 7"
    broken = AutoTokenizer.from_pretrained(folder)
    assert broken.decode(broken(text, add_special_tokens=False)["input_ids"]) != text  # the bug, still there
    tok = load_tokenizer(folder)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    plain = AutoTokenizer.from_pretrained(build_tokenizer(tmp_path / "plain"))
    assert ids == plain(text, add_special_tokens=False)["input_ids"]
    assert tok.chat_template and tok.eos_token == "<|endoftext|>"
    assert load_tokenizer(tmp_path / "plain").decode(ids) == text  # an ordinary tokenizer is loaded as before


def test_the_character_tokenizer_saved_beside_a_qwen2_config_keeps_its_spaces(tmp_path):
    """transformers 5 loads a plain-backend tokenizer (the arith task's characters) beside a qwen2 config.json as
    `Qwen2Tokenizer`, whose pre-tokenizer drops the spaces; `load_tokenizer` (the workaround) keeps the file's own."""
    import json

    from transformers import AutoTokenizer

    from mrl.data.arith import build_arith_tokenizer
    from mrl.data.tokenizers import load_tokenizer

    built = build_arith_tokenizer()
    built.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    text = "12+30=42 05+17=22 1 - 7 ="
    broken = AutoTokenizer.from_pretrained(tmp_path)
    assert broken.decode(broken(text, add_special_tokens=False)["input_ids"]) != text  # the bug, still there
    tok = load_tokenizer(tmp_path)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == built(text, add_special_tokens=False)["input_ids"] and tok.decode(ids) == text
    assert (tok.eos_token, tok.pad_token) == ("<|endoftext|>", "<|pad|>")


def test_a_tokenizer_that_loses_nothing_as_its_familys_class_is_left_as_transformers_loads_it(tmp_path):
    """mrl's tiny BPE tokenizer beside a qwen2 config: transformers loads it as Qwen2Tokenizer, which splits otherwise
    than the file but keeps every character; vLLM loads it the same way, so `load_tokenizer` does not override it."""
    import json

    from transformers import AutoTokenizer

    from mrl.data.tokenizers import build_tokenizer, load_tokenizer

    folder = build_tokenizer(tmp_path / "tok")
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    text = "The quick brown fox 12 + 7 = 19"
    tok, auto = load_tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    assert type(tok) is type(auto)
    assert tok(text, add_special_tokens=False)["input_ids"] == auto(text, add_special_tokens=False)["input_ids"]


def test_a_missing_column_is_offered_the_likeliest_column_and_the_columns_found(tmp_path):
    question = write_jsonl(tmp_path / "q.jsonl", [{"question": "1+1", "answer": "2"}])
    with pytest.raises(ConfigError) as err:
        load_problems(question)
    assert err.value.key == "data.problem_key" and err.value.fix == "data.problem_key=question"
    solution = write_jsonl(tmp_path / "s.jsonl", [{"problem": "1+1", "Solution": "2"}])
    with pytest.raises(ConfigError) as err:
        load_problems(solution)
    assert err.value.key == "data.answer_key" and err.value.fix == "data.answer_key=Solution"
    unknown = write_jsonl(tmp_path / "u.jsonl", [{"zzz": "1+1", "answer": "2"}])
    with pytest.raises(ConfigError) as err:
        load_problems(unknown)
    assert err.value.allowed == "columns found: answer, zzz" and "one of the columns found" in err.value.fix


def test_a_validation_file_with_other_columns_than_the_training_file_is_told_to_use_the_same(tmp_path):
    from mrl.config import load_config
    from mrl.data.tasks import load_task_data

    train = write_jsonl(tmp_path / "train.jsonl", [{"problem": "1+1", "answer": "2"}])
    val = write_jsonl(tmp_path / "val.jsonl", [{"question": "2+2", "answer": "4"}])
    with pytest.raises(ConfigError) as err:
        load_task_data(load_config(None, [f"data.train={train}", f"data.val={val}"]))
    assert err.value.key == "data.val"
    assert err.value.message == f"{val}: none of its 1 rows has the column 'problem', which the rows of data.train have"
    assert err.value.fix == ("data.train and data.val must use the same column names (data.problem_key names the "
                             f"column in both): rename 'question' in {val} to 'problem'")
    with pytest.raises(ConfigError) as err:  # without data.train, the key is data.problem_key's to change
        load_task_data(load_config(None, [f"data.val={val}"]))
    assert err.value.key == "data.problem_key" and err.value.fix == "data.problem_key=question"


def test_json_lines_under_another_suffix_are_told_to_be_renamed(tmp_path):
    text = write_jsonl(tmp_path / "rows.txt", [{"problem": "1+1", "answer": "2"}, ""])
    with pytest.raises(ConfigError, match="mrl does not read the format '.txt', though it holds JSON lines") as err:
        load_problems(text)
    assert err.value.fix == f"rename it to {tmp_path / 'rows.jsonl'} (mrl reads a file by its suffix)"
    (tmp_path / "notes.txt").write_text("problem,answer\n1+1,2\n")
    with pytest.raises(ConfigError) as err:
        load_problems(tmp_path / "notes.txt")
    assert "to_json" in err.value.fix
