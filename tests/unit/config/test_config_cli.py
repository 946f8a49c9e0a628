"""`mrl` command line, in-process: exit codes and messages a user sees."""

from pathlib import Path

import pytest
import yaml

from mrl.cli import main

RECIPE = str(Path(__file__).parents[3] / "recipes" / "arith-tiny-cpu.yaml")


def test_config_show_prints_merged_tree_with_overrides(capsys):
    assert main(["config", "show", "--config", RECIPE, "policy.optimizer.lr=0.5", "run.name=x"]) == 0
    tree = yaml.safe_load(capsys.readouterr().out)
    assert tree["policy"]["optimizer"]["lr"] == 0.5
    assert tree["run"]["output_dir"] == "results/x"
    assert tree["policy"]["build"]["hidden_size"] == 128    # from the recipe
    assert tree["policy"]["optimizer"]["adam_eps"] == 1e-8   # from the schema defaults


def test_unknown_key_exits_2_naming_it_with_a_suggestion(capsys):
    assert main(["config", "show", "--config", RECIPE, "policy.bogus=1"]) == 2
    err = capsys.readouterr().err
    assert "policy.bogus" in err and "unknown key" in err
    assert main(["grpo", "--config", RECIPE, "grpo.num_generation_per_prompt=4"]) == 2
    assert "did you mean 'grpo.num_generations_per_prompt'" in capsys.readouterr().err


def test_missing_config_file_exits_2(capsys, tmp_path):
    assert main(["sft", "--config", str(tmp_path / "none.yaml")]) == 2
    assert "not found" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["dpo", "rm"])
def test_pair_commands_refuse_odd_micro_batches(command, capsys):
    pairs = str(Path(RECIPE).with_name("dpo-arith-tiny-cpu.yaml"))
    assert main([command, "--config", pairs, "policy.train_micro_batch_size=1", "policy.train_global_batch_size=2",
                 "policy.parallel.context_parallel_size=2", "cluster.devices_per_node=2"]) == 2
    err = capsys.readouterr().err
    assert "policy.train_micro_batch_size" in err and "an even number" in err
    assert "context_parallel_size" not in err  # pairs train under context parallelism (test_policy_preference.py)


def test_help_everywhere(capsys):
    for argv in (["--help"], ["grpo", "--help"], ["convert", "hf-to-megatron", "--help"], ["config", "show", "--help"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 0
    assert "--config" in capsys.readouterr().out
