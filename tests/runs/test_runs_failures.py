"""What a user meets when things go wrong or are left out, through the real command line.

- GRPO without validation data: validation is skipped (said once), the run completes;
- checkpointing.enabled=false: nothing is written under checkpointing.dir (the final HF export still is).
"""

from __future__ import annotations

import json

from mrl.testing.runs import RECIPE, SHORT_ARITH, finish, metrics, mrl


def test_grpo_without_validation_data_and_without_checkpoints(tmp_path):
    """Starts from a 1-digit SFT model made here (5 steps); prompts come from a file (no held-out set, no eval.data)."""
    sft_dir, out = tmp_path / "sft", tmp_path / "grpo"
    finish(mrl("sft", "--config", RECIPE, *SHORT_ARITH, f"run.output_dir={sft_dir}", "checkpointing.enabled=false",
               "sft.max_num_steps=5"))  # a model folder to start from; what it learned does not matter here
    assert not (sft_dir / "checkpoints").exists() and (sft_dir / "final_hf" / ".complete").is_file()
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"problem": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                             for a in range(10) for b in range(10)))
    text = finish(mrl("grpo", "--config", RECIPE, *SHORT_ARITH, f"run.output_dir={out}", "~data.arith",
                      f"data.train={train}", "data.instruction=''", f"policy.model_name={sft_dir / 'final_hf'}",
                      "~policy.build",
                      "grpo.max_num_steps=2", "checkpointing.enabled=false"))
    assert text.count("validation is skipped") == 1
    logged = metrics(out / "logs")
    assert sorted(logged) == [1, 2] and not any(k.startswith("val/") for row in logged.values() for k in row)
    assert not (out / "checkpoints").exists()
    assert (out / "final_hf" / ".complete").is_file()
    assert json.loads((out / "summary.json").read_text())["val_accuracy_before"] is None
