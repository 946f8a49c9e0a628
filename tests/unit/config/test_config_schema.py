"""Schema validation: unknown keys with suggestions, types, cross-field rules, every shipped recipe."""

import json
from pathlib import Path

import pytest
import yaml

from mrl.config import ConfigError, MrlConfig, load_config, to_yaml, validate_tree
from mrl.config.checks import rollout_problems

RECIPES_DIR = Path(__file__).parents[3] / "recipes"
RECIPES = sorted(RECIPES_DIR.glob("*.yaml"))


def problems(tree) -> list[ConfigError]:
    with pytest.raises(ConfigError) as info:
        validate_tree(tree)
    return info.value.problems or [info.value]


def test_unknown_key_names_the_dotted_key_and_suggests():
    (p,) = problems({"policy": {"optimizer": {"lrr": 1e-3}}})
    assert p.key == "policy.optimizer.lrr"
    assert "policy.optimizer.lr" in p.fix
    (p,) = problems({"polcy": {}})
    assert p.key == "polcy" and "policy" in p.fix
    (p,) = problems({"policy": {"bogus": 1}})
    assert p.key == "policy.bogus" and p.fix is None and p.given == 1 and "train_global_batch_size" in p.allowed


def test_wrong_type_and_choice_name_what_is_allowed():
    (p,) = problems({"policy": {"precision": "fp8"}})
    assert p.key == "policy.precision" and p.given == "fp8" and "'float32'" in p.allowed
    (p,) = problems({"grpo": {"num_generations_per_prompt": "many"}})
    assert p.key == "grpo.num_generations_per_prompt" and p.given == "many"
    for threads in (0, "fast", 1.5, True):  # a number or "auto": one problem, not one per member of the union
        (p,) = problems({"cluster": {"omp_num_threads": threads}})
        assert p.key == "cluster.omp_num_threads" and p.given == threads and "'auto'" in p.allowed and p.fix
    assert validate_tree({"cluster": {"omp_num_threads": 3}}).cluster.omp_num_threads == 3


def test_a_switch_that_is_not_true_or_false_names_its_values():
    (p,) = problems({"grpo": {"leave_one_out": "sure"}})
    assert p.key == "grpo.leave_one_out" and p.given == "sure" and p.allowed.startswith("true or false (Baseline")
    (p,) = problems({"generation": {"vllm": {"enforce_eager": "maybe"}}})  # Optional[bool]: null is the default
    assert p.allowed.startswith("true, false or null (Skip vLLM's compilation")


def test_true_is_not_a_number_a_section_is_not_a_value_and_a_range_is_spelt_out():
    for tree in ({"grpo": {"max_num_steps": True}}, {"loss": {"clip_low": False}}, {"grpo": {"val_every": True}}):
        (p,) = problems(tree)  # lax pydantic would read true as 1
        assert p.message == "true/false is not a number" and isinstance(p.given, bool)
    (p,) = problems({"grpo": {"max_num_steps": True}})
    assert p.allowed.startswith("an integer >= 1 (") and "given: true" in p.render()
    (p,) = problems({"grpo": {"max_num_steps": 0}})
    assert p.allowed.startswith("an integer >= 1 (")
    assert validate_tree({"grpo": {"max_num_steps": 3}}).grpo.max_num_steps == 3
    (p,) = problems({"policy": {"sequence_packing": True}})
    assert p.key == "policy.sequence_packing" and p.fix == "policy.sequence_packing.enabled=true"
    assert "tokens_per_microbatch" in p.allowed
    (p,) = problems({"policy": {"optimizer": 3}})
    assert p.key == "policy.optimizer" and p.fix.startswith("set a key under it, e.g. policy.optimizer.")


def test_enforce_eager_is_the_key_else_the_environment_else_compiled(monkeypatch):
    """null: $MRL_VLLM_ENFORCE_EAGER (the test suite's conftest sets 1), else vLLM's own default, compiled."""
    eager = lambda tree: validate_tree(tree).generation.vllm.eager()  # noqa: E731
    monkeypatch.delenv("MRL_VLLM_ENFORCE_EAGER", raising=False)
    assert eager({}) is False
    assert eager({"generation": {"vllm": {"enforce_eager": True}}}) is True
    monkeypatch.setenv("MRL_VLLM_ENFORCE_EAGER", "1")
    assert eager({}) is True
    assert eager({"generation": {"vllm": {"enforce_eager": False}}}) is False
    monkeypatch.setenv("MRL_VLLM_ENFORCE_EAGER", "0")
    assert eager({}) is False
    monkeypatch.setenv("MRL_VLLM_ENFORCE_EAGER", "yes")
    (p,) = problems({})
    assert p.key == "generation.vllm.enforce_eager" and p.given == "yes" and "1 (eager)" in p.allowed
    assert "MRL_VLLM_ENFORCE_EAGER" in p.message and p.fix
    assert eager({"generation": {"vllm": {"enforce_eager": True}}}) is True  # the key wins: the variable is not read


def test_tp_must_divide_heads_of_built_model():
    tree = {"cluster": {"devices_per_node": 4},
            "policy": {"parallel": {"tensor_parallel_size": 4}, "build": {"num_attention_heads": 6}}}
    (p,) = problems(tree)
    assert p.key == "policy.parallel.tensor_parallel_size" and p.given == 4 and "[1, 2, 3, 6]" in p.allowed


def test_a_model_config_that_is_not_json_names_the_model_and_the_file(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    (p,) = problems({"policy": {"model_name": str(tmp_path)}})
    assert p.key == "policy.model_name" and p.given == str(tmp_path)
    assert "config.json is not valid JSON" in p.message and str(tmp_path / "config.json") in p.fix
    (tmp_path / "config.json").write_text("[1, 2]")
    (p,) = problems({"policy": {"model_name": str(tmp_path)}})
    assert "holds a list" in p.message


def test_tp_must_divide_kv_heads_read_from_hf_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 8, "num_key_value_heads": 2}))
    tree = {"cluster": {"devices_per_node": 4},
            "policy": {"model_name": str(tmp_path), "parallel": {"tensor_parallel_size": 4}}}
    (p,) = problems(tree)
    assert p.key == "policy.parallel.tensor_parallel_size" and "key/value heads" in p.message


def test_batch_sizes_must_divide():
    tree = {"cluster": {"devices_per_node": 2}, "policy": {"train_global_batch_size": 64, "train_micro_batch_size": 3}}
    keys = [p.key for p in problems(tree)]
    assert keys == ["policy.train_global_batch_size"]  # 64 % (3 * dp 2) != 0
    tree = {"grpo": {"num_prompts_per_step": 3, "num_generations_per_prompt": 5},
            "policy": {"train_global_batch_size": 4, "train_micro_batch_size": 1}}
    cfg = validate_tree(tree)  # a plain config may be SFT's, DPO's, a reward model's: no rollouts to split
    (p,) = rollout_problems(cfg)  # what `mrl grpo` checks before anything starts
    assert p.key == "policy.train_global_batch_size" and "rollouts of a step" in p.message and p.given == 4
    staged = {**tree, "stages": [{"name": "s", "algorithm": "sft"}, {"name": "g", "algorithm": "grpo"}]}
    assert "rollouts of a step" in problems(staged)[0].message
    assert validate_tree({**tree, "stages": [{"name": "s", "algorithm": "sft"}]}).policy.train_global_batch_size == 4


def test_several_problems_are_reported_together():
    tree = {"policy": {"parallel": {"sequence_parallel": True},
                       "sequence_packing": {"enabled": True, "tokens_per_microbatch": 10},
                       "dynamic_batching": {"enabled": True, "tokens_per_microbatch": 8192}}}
    keys = {p.key for p in problems(tree)}
    assert keys == {"policy.parallel.sequence_parallel", "policy.dynamic_batching.enabled",
                    "policy.sequence_packing.tokens_per_microbatch"}


def test_default_config_is_valid_and_round_trips_through_yaml():
    cfg = MrlConfig()
    again = validate_tree(yaml.safe_load(to_yaml(cfg)))
    assert again == cfg
    assert cfg.data_parallel_size == 1


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_every_recipe_validates(recipe):
    cfg = load_config(recipe)
    assert cfg.run.name


def test_deepscaler_stages_carry_the_published_hyperparameters():
    by_len = {n: load_config(RECIPES_DIR / f"grpo-deepscaler-1.5b-{n}.yaml") for n in ("8K", "16K", "24K")}
    assert [c.policy.max_total_sequence_length for c in by_len.values()] == [8192, 16384, 24576]
    assert [c.loss.kl_beta for c in by_len.values()] == [0.0, 1e-3, 1e-4]
    assert [c.loss.clip_high for c in by_len.values()] == [0.2, 0.28, 0.28]
    assert [c.policy.optimizer.lr for c in by_len.values()] == [2e-6, 2e-6, 5e-7]
    for c in by_len.values():
        assert c.policy.model_name == "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"
        assert (c.grpo.num_prompts_per_step, c.grpo.num_generations_per_prompt) == (128, 8)
    staged = load_config(RECIPES_DIR / "deepscaler-1.5b-staged.yaml")
    assert [s.config for s in staged.stages[:3]] == [f"grpo-deepscaler-1.5b-{n}.yaml" for n in ("8K", "16K", "24K")]


def test_token_budget_micro_batches_under_pipeline_parallelism():
    pipeline = {"cluster": {"devices_per_node": 2}, "policy": {"parallel": {"pipeline_parallel_size": 2},
                                                               "train_global_batch_size": 4}}
    tree = {**pipeline, "policy": {**pipeline["policy"], "dynamic_batching": {"enabled": True}}}
    (p,) = problems(tree)
    assert p.key == "policy.dynamic_batching.enabled" and "sequence_packing" in p.fix
    layout = {"pipeline_parallel_size": 2, "context_parallel_size": 2}
    tree = {"cluster": {"devices_per_node": 4},
            "policy": {"parallel": layout, "train_global_batch_size": 4,
                       "sequence_packing": {"enabled": True, "tokens_per_microbatch": 4098}}}
    (p,) = problems(tree)
    assert p.key == "policy.sequence_packing.tokens_per_microbatch" and p.allowed == "a multiple of 4"
    tree["policy"]["sequence_packing"]["tokens_per_microbatch"] = 4100
    validate_tree(tree)  # 4100 = 4 * 1025


def test_a_logprob_budget_is_checked_as_the_training_budget_and_named_by_its_own_key():
    base = {"policy": {"max_total_sequence_length": 4096,
                       "sequence_packing": {"enabled": True, "logprob_tokens_per_microbatch": 2048}}}
    (p,) = problems(base)
    assert p.key == "policy.sequence_packing.logprob_tokens_per_microbatch" and p.given == 2048
    assert p.allowed == ">= 4096"
    layout = {"pipeline_parallel_size": 2, "context_parallel_size": 2}
    tree = {"cluster": {"devices_per_node": 4},
            "policy": {"parallel": layout, "train_global_batch_size": 4,
                       "sequence_packing": {"enabled": True, "tokens_per_microbatch": 4100,
                                            "logprob_tokens_per_microbatch": 8194}}}
    (p,) = problems(tree)  # the training budget's rules are not repeated for the logprob budget
    assert p.key == "policy.sequence_packing.logprob_tokens_per_microbatch" and p.allowed == "a multiple of 4"
    tree["policy"]["sequence_packing"]["logprob_tokens_per_microbatch"] = 8200
    cfg = validate_tree(tree)
    assert cfg.policy.sequence_packing.budget(logprob=True) == (
        "policy.sequence_packing.logprob_tokens_per_microbatch", 8200)


def test_the_length_multiple_the_workers_need_is_the_one_checked():
    """TP2 + SP, CP2, PP2: every sequence splits into 2*cp chunks, each over the tp ranks, so packs are multiples of
    tp * 2 * cp = 8 (the workers' rule); 12 used to pass here (lcm(2*cp, tp) = 4) and fail in every worker."""
    from mrl.parallel.layout import ParallelDims

    layout = {"tensor_parallel_size": 2, "sequence_parallel": True, "context_parallel_size": 2,
              "pipeline_parallel_size": 2}
    tree = {"cluster": {"devices_per_node": 8},
            "policy": {"parallel": layout, "train_global_batch_size": 4, "max_total_sequence_length": 12,
                       "sequence_packing": {"enabled": True, "tokens_per_microbatch": 12}},
            "generation": {"max_new_tokens": 4}}
    (p,) = problems(tree)
    workers = ParallelDims(tp=2, cp=2, pp=2, sequence_parallel=True, world_size=8).length_multiple
    assert p.key == "policy.sequence_packing.tokens_per_microbatch" and p.allowed == f"a multiple of {workers}"
    assert workers == 8
    tree["policy"]["sequence_packing"]["tokens_per_microbatch"] = 16
    validate_tree(tree)


def test_ppo_and_distillation_run_synchronous_steps_on_every_sample_one_at_a_time():
    gae = {"grpo": {"advantage_estimator": "gae", "dynamic_sampling": True, "max_off_policy_steps": 1},
           "loss": {"importance_sampling": "tis"}, "cluster": {"devices_per_node": 2},
           "generation": {"colocated": False, "num_devices": 1}, "distillation": {"teacher": "t"}}
    keys = {p.key: p for p in problems(gae)}
    assert set(keys) == {"grpo.max_off_policy_steps", "grpo.dynamic_sampling", "grpo.advantage_estimator"}
    assert "PPO" in keys["grpo.max_off_policy_steps"].message and keys["grpo.max_off_policy_steps"].allowed == "0"
    assert "distillation section" in keys["grpo.advantage_estimator"].fix
    (p,) = problems({"distillation": {"teacher": "t"}, "grpo": {"dynamic_sampling": True}})
    assert p.key == "grpo.dynamic_sampling" and "distillation" in p.message
    (p,) = problems({"grpo": {"advantage_estimator": "gae"}, "ppo": {"critic": {"parallel": {"tensor_parallel_size": 2}}}})
    assert p.key == "ppo.critic.parallel" and "tp=2" in p.message  # one device: TP2 cannot fit
    (p,) = problems({"distillation": {}})
    assert p.key == "distillation.teacher"
    tree = {"grpo": {"advantage_estimator": "gae"}, "ppo": {"critic": {"parallel": {"tensor_parallel_size": 2}}},
            "cluster": {"devices_per_node": 2}}
    assert validate_tree(tree).ppo.critic.parallel.tensor_parallel_size == 2


def test_asynchronous_grpo_needs_importance_weights_and_an_engine_of_its_own():
    keys = {p.key: p for p in problems({"grpo": {"max_off_policy_steps": 1}})}
    assert set(keys) == {"loss.importance_sampling", "generation.colocated"}
    assert "loss.importance_sampling=tis" in keys["loss.importance_sampling"].fix
    assert "generation.num_devices" in keys["generation.colocated"].fix
    ok = {"grpo": {"max_off_policy_steps": 1}, "loss": {"importance_sampling": "tis"}, "cluster": {"devices_per_node": 2},
          "generation": {"colocated": False, "num_devices": 1}}
    assert validate_tree(ok).grpo.max_off_policy_steps == 1
    (p,) = problems({**ok, "grpo": {"max_off_policy_steps": 2}})
    assert p.key == "grpo.max_off_policy_steps" and p.given == 2


def test_the_arith_task_holds_out_at_most_half_of_its_pairs():
    """1-digit addition has 10 x 10 pairs: 50 may be held out, not the default 200 (mrl/data/arith.py would raise a
    ValueError with a traceback after the checks)."""
    (p,) = problems({"data": {"arith": {"digits": 1}}})
    assert p.key == "data.arith.num_heldout" and p.given == 200 and p.allowed == "1..50"
    assert "data.arith.num_heldout=20" in p.fix
    assert validate_tree({"data": {"arith": {"digits": 1, "num_heldout": 50}}}).data.arith.num_heldout == 50


DEFAULTS_SNAPSHOT = Path(__file__).parent / "default_config.yaml"


def test_default_config_matches_the_snapshot():
    """The whole user-facing surface (every key and default) changes only on purpose: after a deliberate change,
    regenerate the snapshot with `mrl config show > tests/unit/config/default_config.yaml` and review the diff."""
    assert to_yaml(load_config(None)) == DEFAULTS_SNAPSHOT.read_text()


CONFIGS = Path(__file__).parents[3] / "mrl" / "_shipped" / "hf_configs"
MOE_RECIPES = {"grpo-qwen3-30b-a3b-2n8g.yaml": "Qwen--Qwen3-30B-A3B_config.json",
               "grpo-deepseek-v3-32n8g.yaml": "deepseek-ai--DeepSeek-V3_config.json"}


@pytest.mark.parametrize("recipe", list(MOE_RECIPES))
def test_moe_recipes_fit_the_published_models(recipe, tmp_path):
    """The cluster layouts of the MoE recipes against the real config.json (heads over TP, layers over the pipeline
    stages, experts over EP, sequence parallelism with experts under TP); changing one size breaks a named rule."""
    (tmp_path / "config.json").write_text((CONFIGS / MOE_RECIPES[recipe]).read_text())
    model = [f"policy.model_name={tmp_path}"]
    cfg = load_config(RECIPES_DIR / recipe, model)
    assert cfg.policy.parallel.expert_parallel_size > 1 and cfg.policy.sequence_packing.enabled
    for override, key in (("policy.parallel.expert_parallel_size=3", "policy.parallel.expert_parallel_size"),
                          ("policy.parallel.sequence_parallel=false", "policy.parallel.sequence_parallel")):
        with pytest.raises(ConfigError) as info:
            load_config(RECIPES_DIR / recipe, [*model, override])
        assert key in {p.key for p in (info.value.problems or [info.value])}, override


def test_uneven_pipeline_split_is_checked_against_the_layers(tmp_path):
    (tmp_path / "config.json").write_text((CONFIGS / "deepseek-ai--DeepSeek-V3_config.json").read_text())
    recipe, model = RECIPES_DIR / "grpo-deepseek-v3-32n8g.yaml", f"policy.model_name={tmp_path}"
    with pytest.raises(ConfigError) as info:  # 61 layers: 7 + 6 leave 48 for 6 stages; 5 + 6 leave 50
        load_config(recipe, [model, "policy.parallel.first_stage_layers=5"])
    assert "61 decoder layers do not split over 8 pipeline stages" in str(info.value.render())


def test_router_replay_needs_a_moe_model():
    (p,) = problems({"policy": {"moe": {"router_replay": "replay"}, "build": {"family": "qwen2"}}})
    assert p.key == "policy.moe.router_replay" and p.given == "replay" and "dense" in str(p)
    moe = {"policy": {"moe": {"router_replay": "measure"}, "build": {"family": "qwen3_moe"}}}
    assert validate_tree(moe).policy.moe.router_replay == "measure"


def test_an_unquoted_yaml_off_is_the_off_choice(tmp_path):
    """YAML 1.1 reads `off` as false; the switches with an "off" choice take it as that choice."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("policy:\n  moe:\n    router_replay: off\ncluster:\n  memory_check: off\n")
    cfg = load_config(recipe)
    assert (cfg.policy.moe.router_replay, cfg.cluster.memory_check) == ("off", "off")
    (p,) = problems({"policy": {"moe": {"router_replay": True}}})
    assert p.key == "policy.moe.router_replay" and p.given is True


def test_a_teacher_of_its_own_devices_takes_the_clusters_last_ones_from_the_policy():
    from mrl.app.runtime import teacher_bundles
    from mrl.inference.factory import engine_seats

    tree = {"cluster": {"devices_per_node": 4}, "generation": {"colocated": False, "num_devices": 1},
            "distillation": {"teacher": "t", "num_devices": 1}, "policy": {"train_micro_batch_size": 1}}
    cfg = validate_tree(tree)
    assert (cfg.policy_world_size, cfg.teacher_devices, teacher_bundles(cfg)) == (2, 1, (3, 1))

    class Placement:  # 4 bundles, no GPUs: an engine is one bundle
        num_bundles, on_gpus, name = 4, False, "p"

    assert engine_seats(cfg, Placement()).actors == (2,)  # policy 0-1, engine 2, teacher 3
    (p,) = problems({**tree, "distillation": {"teacher": "t", "num_devices": 3}})
    assert p.key == "distillation.num_devices" and "none is left for the policy" in p.message
    (p,) = problems({**tree, "distillation": {"teacher": "t", "num_devices": 1,
                                              "parallel": {"tensor_parallel_size": 2}}})
    assert p.key == "distillation.parallel" and "world size 1" in p.message


def test_lora_names_its_layers_and_refuses_a_megatron_final_format():
    cfg = validate_tree({"policy": {"lora": {"rank": 8}}})
    assert (cfg.policy.lora.rank, cfg.policy.lora.alpha) == (8, 32.0)
    assert cfg.policy.lora.targets == ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "experts"]
    (p,) = problems({"policy": {"lora": {"targets": ["q_proj"]}}})
    assert p.key == "policy.lora.targets.0" and p.given == "q_proj" and "linear_qkv" in p.message
    (p,) = problems({"policy": {"lora": {}}, "run": {"final_format": "megatron"}})
    assert p.key == "run.final_format" and "base alone" in p.message and p.fix == "set run.final_format=hf with policy.lora"


def test_an_empty_run_name_or_output_dir_is_refused():
    """`run.name=` would send every such run to results/ (run.output_dir's default), `run.output_dir=` to the
    current folder."""
    for override, key in (("run.name=", "run.name"), ("run.output_dir=", "run.output_dir"),
                          ("run.name=' '", "run.name")):
        with pytest.raises(ConfigError) as err:
            load_config(None, [override])
        assert err.value.key == key and err.value.message.startswith("is empty") and err.value.fix, override
    assert load_config(None, ["run.name=a"]).run.output_dir == "results/a"
