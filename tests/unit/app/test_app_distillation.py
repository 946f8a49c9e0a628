"""The models that read the policy's token ids (distillation's teacher, PPO's critic) must share its tokenizer:
checked when the run starts, before any worker, with the key, the folder and the fix (exit 2 at the command line)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mrl.app.commands import run_grpo
from mrl.config import ConfigError, load_config
from mrl.data.arith import build_arith_tokenizer
from mrl.testing.tiny_models import build_tiny_hf_model

pytestmark = pytest.mark.unit

RECIPE = Path(__file__).resolve().parents[3] / "recipes" / "arith-tiny-cpu.yaml"


@pytest.fixture(scope="module")
def other_tokenizer(tmp_path_factory) -> Path:
    """A tiny model with a BPE tokenizer: not the arithmetic task's character tokenizer."""
    return build_tiny_hf_model(tmp_path_factory.mktemp("bpe"), "qwen2", layers=1, hidden=16, heads=2, intermediate=32)


@pytest.mark.parametrize("key", ["distillation.teacher", "ppo.critic.model_name"])
def test_a_model_with_another_tokenizer_is_refused_naming_its_key_before_anything_starts(tmp_path, other_tokenizer, key):
    overrides = [f"run.output_dir={tmp_path}", "stages=[]"]
    overrides += [f"+distillation.teacher={other_tokenizer}"] if key == "distillation.teacher" else [
        "grpo.advantage_estimator=gae", f"ppo.critic.model_name={other_tokenizer}"]
    with pytest.raises(ConfigError) as info:
        run_grpo(load_config(RECIPE, overrides))
    error = info.value
    assert error.key == key and error.given == str(other_tokenizer)
    assert "tokenizer differs from the policy's" in str(error) and error.fix
    if key == "ppo.critic.model_name":
        assert not (tmp_path / "critic_init").exists()  # refused before anything was written for the critic


def test_a_teacher_with_the_students_tokenizer_passes_the_check(tmp_path, other_tokenizer):
    from mrl.app.preflight import check_tokenizers

    same = build_tiny_hf_model(tmp_path / "teacher", "qwen2", layers=1, hidden=16, heads=2, intermediate=32)
    cfg = load_config(RECIPE, [f"run.output_dir={tmp_path}", "stages=[]", f"+distillation.teacher={same}"])
    from transformers import PreTrainedTokenizerFast

    check_tokenizers(cfg, PreTrainedTokenizerFast.from_pretrained(other_tokenizer))  # both BPE, the same vocabulary
    with pytest.raises(ConfigError, match="teacher's tokenizer differs"):
        check_tokenizers(cfg, build_arith_tokenizer())
