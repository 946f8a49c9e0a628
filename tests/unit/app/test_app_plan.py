"""`mrl plan` (mrl/app/plan.py) on the shipped cluster recipes: the verdicts and their reasons, the settings offered
when a layout does not fit, the assumptions and their overrides, the model's config.json found where a user keeps
it, the command line's exit status, and `mrl submit` refusing a layout that cannot fit. The figures themselves are
checked against megatron-core and vLLM in test_app_plan_memory.py and tests/functional/app/test_app_plan_kv.py."""

from __future__ import annotations

import shutil

import pytest

from mrl.app.plan import ASSUMPTIONS, SHIPPED_CONFIGS, make_plan, model_config, parse_assumptions, render
from mrl.app.plan_memory import GiB
from mrl.app.slurm import PreflightError, check_memory
from mrl.cli import main
from mrl.config import ConfigError, load_config
from mrl.config.recipes import RECIPES as RECIPES_DIR

R1_8K = RECIPES_DIR / "grpo-deepscaler-1.5b-8K.yaml"
QWEN3 = RECIPES_DIR / "grpo-qwen3-30b-a3b-2n8g.yaml"
DEEPSEEK_V3 = RECIPES_DIR / "grpo-deepseek-v3-32n8g.yaml"


ONE_NODE_ENGINES = ["generation.vllm.pipeline_parallel_size=1", "generation.vllm.gpu_memory_utilization=0.6"]


def test_the_cluster_recipes_fit_an_h100_and_deepseek_v3s_bf16_engines_only_across_nodes():
    for recipe in (R1_8K, QWEN3, DEEPSEEK_V3):
        plan = make_plan(load_config(recipe))
        assert plan.fits, render(plan, load_config(recipe))
        assert all(s.train_phase <= plan.gpu_bytes and s.generate_phase <= plan.gpu_bytes for s in plan.stages)
    v3 = make_plan(load_config(DEEPSEEK_V3))  # engines of TP 8 x PP 4: layers 0-14, 15-29, 30-45, 46-60
    assert (v3.engine.gpus, v3.engine.stages) == (32, 4) and v3.engine.sequences >= 64  # a step's 512 over 8 engines
    assert 42 * GiB < v3.engine.weights < 43 * GiB  # the 16-layer stage: 1/4 of the layers and a bit, over TP 8
    cfg = load_config(DEEPSEEK_V3, ONE_NODE_ENGINES)
    plan = make_plan(cfg)
    assert not plan.fits and len(plan.stages) == 8
    assert plan.engine.weights > plan.engine.budget  # 671B in bf16 over an engine of TP 8: 156 GiB a GPU
    # twice the GPU: no gpu_memory_utilization holds the weights, and the verdict says so, not "raise it"
    (problem,) = plan.problems
    assert problem.startswith("the engine's weights do not fit its GPUs: an engine of TP 8 puts 156.2 GiB of weights "
                              "on each GPU, more than the GPU's 79.6 GiB")
    assert not any("gpu_memory_utilization" in fix and "raise" in fix for fix in plan.fixes)
    assert plan.fixes[0] == ("an engine over several nodes: generation.vllm.tensor_parallel_size=8 and "
                             "generation.vllm.pipeline_parallel_size=4 (32 GPUs an engine, 42.9 GiB of weights a GPU)")
    assert plan.fixes[1].startswith("a bigger GPU for this engine layout: b200-180gb (`--gpu b200-180gb`)")
    text = render(plan, cfg)
    assert "verdict: does NOT fit" in text and "generation.vllm.pipeline_parallel_size=4" in text
    assert "engine TP 8 x PP 4 (32 GPUs, 4 nodes)" in render(v3, load_config(DEEPSEEK_V3))


def test_a_layout_that_cannot_train_names_the_settings_that_would_fit():
    cfg = load_config(QWEN3, ["policy.parallel.expert_parallel_size=1"])  # every rank holds all 128 experts
    plan = make_plan(cfg)
    assert not plan.fits and plan.problems[0].startswith("training needs")
    assert plan.stages[0].states.params > 15e9  # 30.5B over TP 2
    assert any("expert_parallel_size" in fix for fix in plan.fixes)
    undistributed = make_plan(load_config(R1_8K), gpu="a100-40gb", assume=["allocator_slack=0.3"])
    assert not undistributed.fits
    assert any(fix.startswith("policy.optimizer.use_distributed_optimizer=true") for fix in undistributed.fixes)


def test_assumptions_print_their_source_and_assume_replaces_one():
    cfg = load_config(R1_8K)
    plan = make_plan(cfg)
    text = render(plan, cfg)
    for key, assumption in ASSUMPTIONS.items():
        assert f"{key} = {assumption.value:g}" in text and assumption.source in text
    more = make_plan(cfg, assume=["engine_overhead_gib=12"])
    assert plan.engine.kv_bytes - more.engine.kv_bytes == 10 * GiB
    assert more.assumptions["engine_overhead_gib"].source == "given with --assume"
    with pytest.raises(ConfigError, match="not an assumption of the plan") as bad:
        parse_assumptions(["kv_heads=2"])
    assert bad.value.key == "--assume" and "engine_overhead_gib" in str(bad.value.render())
    with pytest.raises(ConfigError, match="not a number"):
        parse_assumptions(["allocator_slack=lots"])
    with pytest.raises(ConfigError, match="unknown GPU") as gpu:
        make_plan(cfg, gpu="h100")
    assert "h100-80gb" in gpu.value.render()


@pytest.mark.parametrize(
    "pair, allowed",
    [
        ("mfu=0", "above 0 and at most 1"),  # divides: a ZeroDivisionError before
        ("mfu=-1", "above 0 and at most 1"),
        ("decode_efficiency=1.5", "above 0 and at most 1"),
        ("refit_gib_per_s=0", "above 0 (GiB/s"),
        ("mean_prompt_tokens=nan", "above 0 (tokens"),
        ("node_broadcast_gib_per_s=inf", "above 0 (GiB/s"),
        ("cuda_context_gib=-1000", ">= 0 (GiB"),  # turned a layout that does not fit into one that does
    ],
)
def test_assume_refuses_a_value_outside_its_range(pair, allowed):
    with pytest.raises(ConfigError, match="out of its range") as bad:
        parse_assumptions([pair])
    key = pair.partition("=")[0]
    text = bad.value.render()
    assert bad.value.key == "--assume" and key in text and f"allowed: a number {allowed}" in text
    assert f"fix: --assume {key}=NUMBER within that range (the plan's default: {ASSUMPTIONS[key].value:g})" in text
    edges = parse_assumptions(["cuda_context_gib=0", "mfu=1", "allocator_slack=2"])
    assert [edges[k].value for k in ("cuda_context_gib", "mfu", "allocator_slack")] == [0, 1, 2]


def test_the_model_config_comes_from_a_folder_the_hub_cache_or_the_shipped_copies(tmp_path, monkeypatch):
    from mrl.data import hub

    cache = tmp_path / "hub-cache"
    monkeypatch.setattr(hub, "cache_dir", lambda: cache)
    folder = tmp_path / "model"
    folder.mkdir()
    shutil.copy(SHIPPED_CONFIGS / "Qwen--Qwen3-30B-A3B_config.json", folder / "config.json")
    config, source = model_config(load_config(R1_8K, [f"policy.model_name={folder}"]))
    assert config["num_experts"] == 128 and source == str(folder / "config.json")
    _, source = model_config(load_config(R1_8K))
    assert source.endswith("(published config.json shipped with mrl)")
    # `mrl download` put the model in the hub cache: its config.json there comes first (at the revision's commit)
    repo = cache / "models--deepseek-ai--DeepSeek-R1-Distill-Qwen-1.5B"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    (repo / "snapshots" / ("0" * 40)).mkdir(parents=True)
    shutil.copy(folder / "config.json", repo / "snapshots" / ("0" * 40) / "config.json")
    config, source = model_config(load_config(R1_8K))
    assert source == "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B (hub cache)" and config["num_experts"] == 128
    with pytest.raises(ConfigError, match="no config.json found") as missing:
        model_config(load_config(R1_8K, ["policy.model_name=some-org/unknown"]))
    assert "mrl download some-org/unknown" in missing.value.render()


def test_the_command_prints_the_plan_and_exits_2_when_it_does_not_fit(capsys):
    assert main(["plan", "--config", str(R1_8K)]) == 0
    assert "verdict: fits" in capsys.readouterr().out
    assert main(["plan", "--config", str(DEEPSEEK_V3), "--gpu", "h200-141gb", *ONE_NODE_ENGINES]) == 2
    assert "verdict: does NOT fit" in capsys.readouterr().out
    assert main(["plan", "--config", str(R1_8K), "--assume", "nonsense=1"]) == 2
    assert "--assume" in capsys.readouterr().err
    assert main(["plan", "--config", str(R1_8K), "--assume", "mfu=0"]) == 2
    assert "--assume: mfu is out of its range" in capsys.readouterr().err


def test_submit_refuses_a_layout_that_cannot_fit_with_the_plan_as_the_message():
    check_memory(load_config(R1_8K), "h100-80gb", [])
    with pytest.raises(PreflightError, match="does not fit a h100-80gb GPU") as refused:
        check_memory(load_config(DEEPSEEK_V3, ONE_NODE_ENGINES), "h100-80gb", [])
    assert "verdict: does NOT fit" in str(refused.value)
    check_memory(load_config(None), "h100-80gb", [])  # a random model (no model_name): nothing to plan


def test_a_run_on_a_gpu_checks_its_layout_against_that_gpu(capsys):
    from mrl.app.plan import check_this_gpu

    assert check_this_gpu(load_config(R1_8K), 80 * GiB) is None  # fits: nothing said
    with pytest.raises(ConfigError, match="does not fit this GPU") as refused:
        check_this_gpu(load_config(R1_8K), 24 * GiB)
    assert refused.value.key == "cluster.memory_check" and "verdict: does NOT fit" in str(refused.value)
    assert "cluster.memory_check=warn" in refused.value.render()
    warned = check_this_gpu(load_config(R1_8K, ["cluster.memory_check=warn"]), 24 * GiB)
    assert warned is not None and not warned.fits and "may not fit this GPU" in capsys.readouterr().err
    assert check_this_gpu(load_config(R1_8K, ["cluster.memory_check=off"]), 24 * GiB) is None


def test_the_refit_buckets_and_what_a_colocated_gpu_hands_over_are_printed():
    cfg = load_config(R1_8K)
    plan = make_plan(cfg)
    assert plan.refit.total == 2 * 1_777_088_000  # every HF tensor in bf16
    assert plan.refit.largest == 2 * 151_936 * 1536  # the embedding, alone: larger than the 256 MiB bound
    assert plan.refit.buckets > plan.refit.total // (256 << 20)
    text = render(plan, cfg)
    assert f"refit: 3.3 GiB in {plan.refit.buckets} buckets of at most 445 MiB" in text
    assert ("hands over: optimizer states to host memory 19.9 GiB, gradients freed 6.6 GiB; keeps weights 3.3 GiB"
            in text)


def test_an_engine_whose_weights_exceed_its_gpu_is_offered_what_holds_them_not_a_larger_share():
    # Qwen3-30B-A3B on one A100 40GB an engine: 56.9 GiB of weights a GPU; TP 2 leaves 28 GiB, over the recipe's share
    cfg = load_config(QWEN3, ["generation.vllm.tensor_parallel_size=1"])
    plan = make_plan(cfg, gpu="a100-40gb")
    engine_problems = [p for p in plan.problems if p.startswith("the engine")]
    assert engine_problems == [
        "the engine's weights do not fit its GPUs: an engine of TP 1 puts 56.9 GiB of weights on each GPU, more than "
        "the GPU's 40.0 GiB (59.6 GiB with vLLM's 2.0 GiB and one sequence's KV cache); no "
        "generation.vllm.gpu_memory_utilization can hold them"]
    assert "more tensor parallelism for the engine: generation.vllm.tensor_parallel_size=4 (14.2 GiB of weights a " \
           "GPU)" in plan.fixes
    wider = make_plan(load_config(QWEN3, ["generation.vllm.tensor_parallel_size=4"]), gpu="a100-40gb")
    assert not any(p.startswith("the engine") for p in wider.problems)  # what the fix says holds
    assert any(f.startswith("a bigger GPU for this engine layout: h100-80gb") for f in plan.fixes)
    # a share too small for weights that fit the GPU: then a larger share is the fix, with the value that holds
    small = make_plan(load_config(R1_8K, ["generation.vllm.gpu_memory_utilization=0.05"]))
    assert small.problems == ["the engine's KV cache (0.0 GiB) holds no 8192-token sequence: "
                              "generation.vllm.gpu_memory_utilization=0.05 gives it 4.0 GiB of the GPU, its weights "
                              "take 3.3 GiB"]
    assert small.fixes[0].startswith("generation.vllm.gpu_memory_utilization=0.07 or more")
    assert make_plan(load_config(R1_8K, ["generation.vllm.gpu_memory_utilization=0.07"])).fits


def test_a_staged_recipe_is_planned_stage_by_stage_each_with_its_commands_workers(capsys):
    from mrl.app.plan_stages import fits, plan_command, render_plans

    plans = plan_command(RECIPES_DIR / "deepscaler-1.5b-staged.yaml", [])
    assert [(p.stage, p.command) for p in plans] == [("grpo-8K", "grpo"), ("grpo-16K", "grpo"), ("grpo-24K", "grpo"),
                                                     ("eval-aime24", "eval")]
    assert [p.plan.engine.sequence_tokens for p in plans] == [8192, 16384, 24576, 8192]
    # the later stages start from exports not written yet: planned with the model the first stage starts from
    assert plans[1].plan.model_source.endswith("as the earlier stage exports it to "
                                               f"{plans[0].cfg.run.output_dir}/final_hf")
    assert plans[3].plan.stages == [] and plans[3].plan.refit is None and plans[3].plan.time is None  # eval: no policy
    assert fits(plans)
    text = render_plans(plans)
    assert [line for line in text.splitlines() if line.startswith("=== stage")] == [
        "=== stage 1/4 'grpo-8K' (mrl grpo) ===", "=== stage 2/4 'grpo-16K' (mrl grpo) ===",
        "=== stage 3/4 'grpo-24K' (mrl grpo) ===", "=== stage 4/4 'eval-aime24' (mrl eval) ==="]
    assert text.count("verdict: fits") == 4 and text.count("assumptions (--assume") == 1
    assert text.endswith("recipe verdict: every stage planned fits (4 of 4 stages planned)")
    # on an A100 40GB the first stage fits and the longer ones do not: the recipe does not, naming them, on the
    # command line and in `mrl submit`'s preflight (both planned the first stage alone, and passed)
    small = plan_command("deepscaler-1.5b-staged", [], gpu="a100-40gb")
    assert [p.plan.fits for p in small] == [True, False, False, True]
    assert main(["plan", "--config", "deepscaler-1.5b-staged", "--gpu", "a100-40gb"]) == 2
    printed = capsys.readouterr().out
    assert printed.rstrip().endswith("recipe verdict: does NOT fit: stage 'grpo-16K', 'grpo-24K' (each stage's "
                                     "verdict above says why)")
    from mrl.app.slurm import check_command_memory

    with pytest.raises(PreflightError, match="a stage's layout does not fit a a100-40gb GPU") as refused:
        check_command_memory(["mrl", "run", "deepscaler-1.5b-staged"], "a100-40gb", [])
    assert "=== stage 2/4 'grpo-16K' (mrl grpo) ===" in str(refused.value)
    check_command_memory(["mrl", "run", "deepscaler-1.5b-staged"], "h100-80gb", [])  # fits: nothing raised


def test_a_staged_recipe_of_random_models_lists_its_stages_unplanned(tmp_path):
    from mrl.app.plan_stages import fits, plan_command, render_plans

    plans = plan_command("arith-tiny-cpu", [f"run.output_dir={tmp_path}"])  # not the demo's results/, once it ran
    assert [p.plan for p in plans] == [None] * len(plans) and fits(plans)
    assert "not planned: a random model (policy.build)" in render_plans(plans)


def test_ppos_critic_and_distillations_teacher_are_counted_on_the_policys_gpus(tmp_path):
    """The critic is the policy's states once more; the teacher its weights over the policy's TP x PP, from its own
    config.json (here the policy's model at twice the layers: twice the policy's parameters)."""
    import json

    base = make_plan(load_config(R1_8K))
    ppo = make_plan(load_config(R1_8K, ["grpo.advantage_estimator=gae"]))
    for plain, with_critic in zip(base.stages, ppo.stages):
        g = plain.states
        assert with_critic.states.critic == g.weights + g.gradients + g.optimizer
        assert with_critic.train_phase > plain.train_phase + g.weights + g.gradients + g.optimizer
    config, _ = model_config(load_config(R1_8K))
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2 * config["num_hidden_layers"]}))
    cfg = load_config(R1_8K, [f"+distillation.teacher={tmp_path}"])
    distill = make_plan(cfg)
    (stage,) = distill.stages  # the recipe's TP 1, PP 1: one rank holds the whole teacher
    policy_bytes = stage.states.weights  # bf16
    # twice the layers, the same embedding and output layer: between 1x and 2x the policy's weights
    assert policy_bytes < stage.states.teacher < 2 * policy_bytes
    assert stage.train_phase > base.stages[0].train_phase + stage.states.teacher
    assert "beside" in render(distill, cfg)


def test_lora_leaves_the_weights_and_gives_gradients_and_adam_to_the_adapters_alone():
    """policy.lora: the base's weights stay (plus the adapters', a few percent), its gradients and Adam states go
    (plan_memory's arithmetic is checked against Megatron's adapted model in test_app_plan_memory.py)."""
    cfg = load_config(R1_8K, ["+policy.lora.rank=16"])
    full, lora = make_plan(load_config(R1_8K)).stages[0].states, make_plan(cfg).stages[0].states
    assert full.weights < lora.weights < 1.05 * full.weights
    assert lora.gradients < 0.05 * full.gradients and lora.optimizer < 0.05 * full.optimizer
    assert "LoRA rank 16 (the base frozen)" in render(make_plan(cfg), cfg)


def test_a_logprob_budget_that_does_not_fit_is_named_among_the_fixes():
    """The logprob pass holds one layer's activations and its logits: a logprob budget far above the training budget
    makes it the peak, and the plan offers the logprob budget back."""
    fits = make_plan(load_config(R1_8K))
    assert fits.fits and not any("logprob" in fix for fix in fits.fixes)
    huge = load_config(R1_8K, ["policy.sequence_packing.logprob_tokens_per_microbatch=1048576"])
    plan = make_plan(huge)
    stage = plan.stages[0]
    assert stage.activations.logprob_peak > stage.activations.train_peak
    assert not plan.fits
    assert any("policy.sequence_packing.logprob_tokens_per_microbatch" in fix for fix in plan.fixes)
