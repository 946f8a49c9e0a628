"""`mrl sft`, `mrl dpo` and `mrl rm` with `policy.lora`, through the real command line (SFT from an HF model, DPO and
the reward model from SFT's export, as a staged recipe chains them):

- each trains (its training loss over the last steps below the first steps');
- the base stays what it was, bit for bit: in the exported model every tensor that is not an adapted layer's weight
  (embeddings, norms) equals the starting model's, and every adapted one moved; the reward model's fresh score head
  trained beside the adapters;
- SFT's and DPO's adapters alone (final_hf/lora_adapter/), loaded by HF PEFT over the starting model, give the
  exported merged model's logits.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from mrl.testing.runs import RECIPE, SHORT_ARITH, finish, metrics, mrl

LORA = ("+policy.lora.rank=8", "checkpointing.enabled=false", "logger.log_every=1")
#: HF names of the weights LoRA adapts (linear_qkv, linear_proj, linear_fc1, linear_fc2).
ADAPTED = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "gate_proj.weight", "up_proj.weight",
           "down_proj.weight")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Iterator[dict[str, Path]]:
    """The 1-digit task's initial model as an HF folder, SFT from it with LoRA, then DPO and a reward model from SFT's
    export with fresh adapters, started together."""
    from mrl.app.starting_model import build_initial_model
    from mrl.config import load_config

    root = tmp_path_factory.mktemp("lora")
    cfg = load_config(RECIPE, list(SHORT_ARITH))
    hf = build_initial_model(cfg, cfg.policy.build, root / "hf")
    start = (f"policy.model_name={hf}", "~policy.build", "policy.scheduler.warmup_steps=0", *LORA)
    pairs = (*SHORT_ARITH, "dpo.max_num_steps=30", "rm.max_num_steps=30", "dpo.max_num_epochs=30",
             "rm.max_num_epochs=30", "dpo.val_every=0", "rm.val_every=0", "cluster.omp_num_threads=1")
    lr = {"dpo": 1e-2, "rm": 3e-3}  # Bradley-Terry is the more sensitive to the step size (the recipes say why)
    finish(mrl("sft", "--config", RECIPE, *SHORT_ARITH, *start, "policy.optimizer.lr=1e-2",
               f"run.output_dir={root / 'sft'}"))
    sft = root / "sft" / "final_hf"  # DPO and the reward model start from SFT's merged model, with fresh adapters
    tuned = (f"policy.model_name={sft}", *start[1:])
    started = [mrl(command, "--config", RECIPE, *tuned, *pairs, f"policy.optimizer.lr={lr[command]}",
                   f"run.output_dir={root / command}") for command in ("dpo", "rm")]
    for proc in started:
        finish(proc)
    yield {"hf": hf, "sft": root / "sft", "dpo": root / "dpo", "rm": root / "rm"}


def _start(runs: dict[str, Path], command: str) -> Path:
    return runs["hf"] if command == "sft" else runs["sft"] / "final_hf"


def _state(folder: Path) -> dict[str, torch.Tensor]:
    from converters.hf_io import load_hf_state

    return load_hf_state(folder)


@pytest.mark.parametrize("command", ["sft", "dpo", "rm"])
def test_each_command_trains_the_adapters_and_leaves_the_base_bit_for_bit(runs, command):
    logged = metrics(runs[command] / "logs")
    losses = [logged[step]["train/loss"] for step in sorted(logged) if "train/loss" in logged[step]]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5, losses
    base, trained = _state(_start(runs, command)), _state(runs[command] / "final_hf")
    for name, tensor in trained.items():
        if name == "score.weight":  # the reward model's head: fresh, trained in full
            continue
        if name.endswith(ADAPTED):
            assert not torch.equal(tensor, base[name]), name  # W + s * B @ A with B trained
        else:
            assert torch.equal(tensor, base[name]), name  # frozen: embeddings, norms
    assert any(name.endswith(ADAPTED) for name in trained)
    if command == "rm":
        assert "score.weight" in trained and not (runs[command] / "final_hf" / "lora_adapter").exists()


@pytest.mark.parametrize("command", ["sft", "dpo"])
def test_the_adapters_alone_on_the_starting_model_are_the_exported_model(runs, command):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    final = runs[command] / "final_hf"
    adapter = final / "lora_adapter"
    start = _start(runs, command)
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == str(start)
    merged = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(start, dtype=torch.float32)
    ids = torch.randint(3, merged.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = merged(ids).logits
        got = PeftModel.from_pretrained(base, str(adapter)).eval()(ids).logits
    assert (got - want).abs().max() <= 1e-4
