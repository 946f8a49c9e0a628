"""YAML inheritance, Hydra-grammar overrides and interpolation."""

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
