"""YAML inheritance, Hydra-grammar overrides and interpolation."""

import re
from pathlib import Path

import pytest

from mrl.config import ConfigError, load_config
from mrl.config.loader import apply_overrides, deep_merge, load_yaml_tree


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_defaults_chain_merges_bases_then_file(tmp_path):
    write(tmp_path / "base" / "a.yaml", "run: {name: a, seed: 1}\npolicy: {optimizer: {lr: 1.0e-3, weight_decay: 0.5}}\n")
    write(tmp_path / "base" / "b.yaml", "defaults: a.yaml\npolicy: {optimizer: {lr: 2.0e-3}}\n")
    write(tmp_path / "c.yaml", "run: {seed: 3}\n")
    top = write(tmp_path / "top.yaml", "defaults: [base/b.yaml, c.yaml]\nrun: {name: top}\n")
    tree = load_yaml_tree(top)
    # b overrides a's lr but keeps its weight_decay; c then the file itself go on top, key by key.
    assert tree == {"run": {"name": "top", "seed": 3}, "policy": {"optimizer": {"lr": 2.0e-3, "weight_decay": 0.5}}}


def test_defaults_cycle_and_missing_file_are_errors(tmp_path):
    write(tmp_path / "a.yaml", "defaults: b.yaml\n")
    write(tmp_path / "b.yaml", "defaults: a.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_yaml_tree(tmp_path / "a.yaml")
    write(tmp_path / "c.yaml", "defaults: nowhere.yaml\n")
    with pytest.raises(ConfigError, match="not found") as err:
        load_yaml_tree(tmp_path / "c.yaml")
    assert err.value.fix == f"check the defaults: of {tmp_path / 'c.yaml'}"  # the file that names it
    with pytest.raises(ConfigError, match="is a folder, not a config file") as err:
        load_yaml_tree(tmp_path)
    assert err.value.fix == "check the --config path"


def test_a_key_written_twice_is_refused_with_its_lines(tmp_path):
    twice = write(tmp_path / "twice.yaml", "run: {name: a}\npolicy: {precision: float32}\nrun: {seed: 3}\n")
    with pytest.raises(ConfigError, match=r"twice.yaml is not valid YAML: .*the key 'run' appears twice \(lines 1 and 3\)"):
        load_yaml_tree(twice)
    nested = write(tmp_path / "nested.yaml", "policy:\n  optimizer: {lr: 1.0, lr: 2.0}\n")
    with pytest.raises(ConfigError, match="the key 'lr' appears twice"):
        load_yaml_tree(nested)
    assert load_yaml_tree(write(tmp_path / "once.yaml", "run: {name: a}\n")) == {"run": {"name": "a"}}


def test_deep_merge_replaces_lists_and_scalars():
    assert deep_merge({"a": {"x": 1, "l": [1, 2]}, "b": 1}, {"a": {"l": [3]}, "b": {"y": 2}}) == \
        {"a": {"x": 1, "l": [3]}, "b": {"y": 2}}


def test_override_grammar_set_add_force_delete():
    tree = {"policy": {"optimizer": {"lr": 1.0}}, "run": {"name": "x"}}
    out = apply_overrides(tree, ["policy.optimizer.lr=0.5", "+grpo.max_num_steps=7", "++run.name=y", "~policy.optimizer.lr",
                                 "generation.stop_strings=[a,'b c']"])
    assert out == {"policy": {"optimizer": {}}, "run": {"name": "y"}, "grpo": {"max_num_steps": 7},
                   "generation": {"stop_strings": ["a", "b c"]}}
    assert tree["policy"]["optimizer"]["lr"] == 1.0  # the input is not modified


@pytest.mark.parametrize("override, message", [
    ("+run.name=z", "adds a key that is not set yet"),
    ("~run.seed", "cannot delete"),
    ("policy.lr==", "cannot parse"),
])
def test_bad_overrides_are_config_errors(override, message):
    with pytest.raises(ConfigError, match=message):
        apply_overrides({"run": {"name": "x"}}, [override])


def test_a_key_without_a_value_is_told_to_take_one():
    with pytest.raises(ConfigError, match="cannot parse") as err:
        apply_overrides({"grpo": {"max_num_steps": 3}}, ["grpo.max_num_steps"])
    assert err.value.fix == "give it a value: grpo.max_num_steps=<value> (or ~grpo.max_num_steps to drop it)"
    with pytest.raises(ConfigError, match="cannot parse") as err:
        apply_overrides({"grpo": {"max_num_steps": 3}}, ["grpo.max_num_steps=[1"])
    assert "a list is key=[1,2]" in err.value.fix


def test_interpolation_sees_schema_defaults_and_overrides(tmp_path):
    f = write(tmp_path / "r.yaml", "run: {name: exp}\npolicy: {train_global_batch_size: '${grpo.num_prompts_per_step}'}\n"
                                   "grpo: {num_prompts_per_step: 16, num_generations_per_prompt: 4}\n")
    cfg = load_config(f, ["run.name=exp2"])
    assert cfg.run.output_dir == "results/exp2"            # schema default interpolating an override
    assert cfg.checkpointing.dir == "results/exp2/checkpoints"
    assert cfg.policy.train_global_batch_size == 16
    with pytest.raises(ConfigError, match="interpolation failed"):
        load_config(f, ["run.name=${nope.x}"])


def test_a_config_that_is_not_utf8_text_names_the_file_and_whether_to_re_encode_it(tmp_path):
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("run:\n  name: caf\u00e9\n".encode("latin-1"))
    with pytest.raises(ConfigError) as err:
        load_yaml_tree(latin1)
    assert err.value.message == f"{latin1} is not UTF-8 text (line 2: byte 0xe9): saved in latin-1 or another 8-bit " \
        "encoding?"
    assert err.value.fix.startswith(f"re-encode it as UTF-8, e.g. iconv -f latin1 -t utf-8 {latin1} > ")
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\xe8\x00\x00\x00\x00\x00\x00\x00{\"__metadata__\"" + bytes(range(256)))
    with pytest.raises(ConfigError) as err:
        load_config(weights)
    assert err.value.message == f"{weights} is not UTF-8 text (a binary file?): not a YAML config"
    assert "--config" in err.value.fix


def test_a_yaml_error_names_the_file_and_a_tab_is_told_to_be_spaces(tmp_path):
    tab = write(tmp_path / "tab.yaml", "run:\n\tname: x\n")
    with pytest.raises(ConfigError) as err:
        load_yaml_tree(tab)
    assert err.value.message.startswith("tab.yaml is not valid YAML: ")
    assert f'in "{tab.resolve()}", line 2, column 1' in err.value.message and "<unicode string>" not in str(err.value)
    assert err.value.fix == "indent with spaces, not tabs (line 2)"
    inline = write(tmp_path / "inline.yaml", "run: {name: x, seed:\t3}\n")
    with pytest.raises(ConfigError) as err:
        load_yaml_tree(inline)
    assert err.value.fix == "write spaces for the tab (line 1, column 21)"
    colon = write(tmp_path / "colon.yaml", "run:\n  name: a: b\n")
    with pytest.raises(ConfigError) as err:
        load_yaml_tree(colon)
    assert f'in "{colon.resolve()}", line 2' in err.value.message and err.value.fix is None


@pytest.mark.parametrize("override, message, fix", [
    ("eval.pass_k=1,4", "a comma-separated value is Hydra's sweep", "write a list in brackets: eval.pass_k=[1,4] "
     "(a text with a comma in quotes: 'eval.pass_k=\"1,4\"')"),
    ("++eval.pass_k=1,4", "a comma-separated value is Hydra's sweep", "write a list in brackets: ++eval.pass_k=[1,4]"),
    ("eval.pass_k=range(1,4)", "range(...) is Hydra's sweep", "give one value, or a list in brackets: eval.pass_k=[a,b]"),
])
def test_a_sweep_is_refused_with_the_list_to_write(override, message, fix):
    with pytest.raises(ConfigError, match=re.escape(message)) as err:
        apply_overrides({"eval": {"pass_k": [1]}}, [override])
    assert err.value.key == "eval.pass_k" and err.value.given == override and err.value.fix.startswith(fix)
    assert apply_overrides({"eval": {"pass_k": [1]}}, ["eval.pass_k=[1,4]"]) == {"eval": {"pass_k": [1, 4]}}
