"""The real SmolLM2-135M-Instruct (30 layers, GQA 9/3, tied embeddings) through every part of mrl, and the real
GSM8K and MATH-500 problems through `mrl eval`:
- HF -> Megatron -> HF is bit-exact;
- `mrl score` equals HF transformers within 5e-5 over the 30 layers at TP1 and TP3;
- two GRPO steps of the real recipe: vLLM's logprobs after the refit equal the trainer's (token_mult_prob_error
  <= 1.001), each phase is timed, and the engine saw exactly the chat template's rendering;
- `mrl eval` (first 64 problems, greedy) writes every sample, and the accuracy it reports equals the accuracy
  recomputed from its own samples file with math-verify."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mrl.app.real_assets import MODEL_DIR
from mrl.testing.runs import finish, metrics, mrl
from mrl.testing.tiny_models import hf_token_logprobs

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes"
TIMINGS = ("timing/generation", "timing/reward", "timing/logprobs", "timing/train", "timing/refit")


@pytest.fixture(scope="module")
def model_dir(real_assets) -> Path:
    return real_assets / MODEL_DIR


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def test_hf_megatron_hf_round_trip_is_bit_exact(model_dir, tmp_path):
    finish(mrl("convert", "hf-to-megatron", "--hf", str(model_dir), "--out", str(tmp_path / "meg")))
    finish(mrl("convert", "megatron-to-hf", "--megatron", str(tmp_path / "meg"), "--out", str(tmp_path / "hf")))
    before, after = _tensors(model_dir), _tensors(tmp_path / "hf")
    assert sorted(before) == sorted(after) and len(before) > 200
    assert all(torch.equal(before[name], after[name]) for name in before)



def _gsm8k_rows(real_assets: Path, count: int) -> list[dict]:
    lines = (real_assets / "data" / "gsm8k_test.jsonl").read_text(encoding="utf-8").splitlines()[:count]
    return [json.loads(line) for line in lines]


@pytest.mark.parametrize("layout", [[], ["cluster.devices_per_node=3", "policy.parallel.tensor_parallel_size=3"]],
                         ids=["tp1", "tp3"])
def test_score_equals_transformers_over_30_layers(model_dir, real_assets, tmp_path, layout):
    from mrl.data.templates import PromptTemplate
    from mrl.data.tokenizers import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    rows = [{"prompt": PromptTemplate("chat").render(row["problem"], tokenizer),
             "completion": f"The answer is \\boxed{{{row['answer']}}}.<|im_end|>"}
            for row in _gsm8k_rows(real_assets, 2)]
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    finish(mrl("score", "--model", str(model_dir), "--input", str(source), "--out", str(out), *layout))
    for row, scored in zip(rows, [json.loads(line) for line in out.read_text().splitlines()]):
        prompt = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        full = prompt + tokenizer(row["completion"], add_special_tokens=False)["input_ids"]
        expected = hf_token_logprobs(model_dir, full)[len(prompt) - 1:]
        assert scored["token_ids"] == full[len(prompt):]
        assert (torch.tensor(scored["logprobs"]) - expected).abs().max() <= 5e-5


GRPO_SHORT = ("grpo.max_num_steps=2", "grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=4",
              "policy.train_global_batch_size=8", "generation.max_new_tokens=48", "grpo.val_every=2",
              "eval.max_problems=4", "checkpointing.enabled=false")


def test_grpo_steps_with_the_real_model(real_assets, tmp_path):
    from mrl.data.templates import PromptTemplate
    from mrl.data.tokenizers import load_tokenizer

    out = tmp_path / "grpo"
    finish(mrl("grpo", "--config", str(RECIPES / "grpo-smollm2-135m-gsm8k-cpu.yaml"), *GRPO_SHORT,
               f"run.output_dir={out}"), timeout=1200)
    steps = metrics(out / "logs")
    for step in (1, 2):
        assert all(steps[step][key] > 0 for key in TIMINGS)
        assert steps[step]["train/token_mult_prob_error"] <= 1.001  # step 2 generates after step 1's refit
        assert steps[step]["train/refit_bytes"] > 500e6  # the whole 135M model in fp32 (538 MB)
    tokenizer = load_tokenizer(real_assets / MODEL_DIR)
    samples = [json.loads(line) for line in (out / "val_samples" / "step_2.jsonl").read_text().splitlines()]
    problems = _gsm8k_rows(real_assets, 4)
    assert [s["problem_index"] for s in samples] == [0, 1, 2, 3]
    for sample, row in zip(samples, problems):  # what the engine saw is the chat template's rendering
        assert sample["prompt"] == PromptTemplate("chat").render(row["problem"], tokenizer)


EVAL_RECIPES = ("eval-smollm2-135m-gsm8k.yaml", "eval-smollm2-135m-math500.yaml")


@pytest.fixture(scope="module")
def evals(real_assets, tmp_path_factory) -> dict[str, Path]:
    """Both evals, started side by side: each generates on one core (the recipes' one device, one thread)."""
    outs = {recipe: tmp_path_factory.mktemp(recipe.removesuffix(".yaml")) for recipe in EVAL_RECIPES}
    started = [mrl("eval", "--config", str(RECIPES / recipe), f"run.output_dir={out}") for recipe, out in outs.items()]
    for proc in started:
        finish(proc, timeout=1200)
    return outs


@pytest.mark.parametrize("recipe", EVAL_RECIPES)
def test_eval_accuracy_equals_math_verify_on_its_own_samples(recipe, evals):
    from math_verify import parse, verify

    from mrl.environments.math import boxed_gold, readable

    tmp_path = evals[recipe]
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 64 and [s["problem_index"] for s in samples] == list(range(64))
    recomputed = []
    for sample in samples:
        predicted = parse(readable(sample["response"]), parsing_timeout=None)
        correct = verify(parse(boxed_gold(sample["gold_answer"]), parsing_timeout=None), predicted,
                         timeout_seconds=None)
        stopped = sample["finish_reason"] == "stop"  # a response cut at max_new_tokens scores 0, unread
        recomputed.append(float(correct and stopped))
        assert sample["reward"] == recomputed[-1]
        assert sample["extracted_answer"] == (str(predicted[-1]) if predicted and stopped else None)
    reported = json.loads((tmp_path / "summary.json").read_text())["final"]["val/accuracy"]
    assert reported == pytest.approx(sum(recomputed) / len(recomputed), abs=1e-9)
