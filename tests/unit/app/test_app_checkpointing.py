"""Resuming a run's newest checkpoint (mrl/app/checkpointing.py) when the step is damaged or leaves nothing to train:
the error names the step and the fix (a plain re-run would meet it again), on a fake runtime whose policy loads
what it is told to."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mrl.app.checkpointing import RunCheckpoints
from mrl.app.errors import CheckpointIncompatibleError
from mrl.checkpoint.manager import TRAIN_STATE_FILE, model_record, save_train_state
from mrl.config import validate_tree
from mrl.distributed import WorkerDiedError, WorkerError
from mrl.testing.tiny_models import build_tiny_hf_model


class _Policy:
    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error

    def load(self, path: str) -> list:
        if self.error is not None:
            raise self.error
        return []


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_hf_model(tmp_path_factory.mktemp("model") / "m", hidden=32, layers=1, heads=2, intermediate=32)


def _checkpoints(tmp_path, model_dir, policy: _Policy) -> RunCheckpoints:
    cfg = validate_tree({"checkpointing": {"enabled": True, "dir": str(tmp_path / "ckpt")},
                         "policy": {"precision": "float32"}, "run": {"output_dir": str(tmp_path)}})
    return RunCheckpoints(cfg, SimpleNamespace(policy=policy, critic=None, model_dir=model_dir))


def _step(tmp_path, model_dir):
    from converters.hf_io import load_hf_config

    step = tmp_path / "ckpt" / "step_5"
    step.mkdir(parents=True)
    record = model_record(load_hf_config(model_dir), tokenizer_dir=model_dir, precision="float32")
    save_train_state(step, {"step": 5, "rng": {}, "model_record": record})
    return step


def test_a_controller_state_that_cannot_be_read_names_the_step_to_remove(tmp_path, model_dir):
    step = tmp_path / "ckpt" / "step_5"
    step.mkdir(parents=True)
    (step / TRAIN_STATE_FILE).write_bytes(b"not a torch file")
    with pytest.raises(CheckpointIncompatibleError, match="its controller state cannot be read") as err:
        _checkpoints(tmp_path, model_dir, _Policy()).resume(step)
    assert f"remove {step}: the run then resumes from the step before it" in str(err.value)


def test_weights_the_workers_cannot_load_name_the_step_and_a_death_stays_a_death(tmp_path, model_dir):
    step = _step(tmp_path, model_dir)
    failed = WorkerError("rank 0 raised CheckpointException in 'load': a shard is short\n--- remote traceback ---\nX",
                         group="policy", rank=0)
    with pytest.raises(CheckpointIncompatibleError, match="the policy's workers could not load it") as err:
        _checkpoints(tmp_path, model_dir, _Policy(failed)).resume(step)
    assert "a shard is short" in str(err.value) and "remote traceback" not in str(err.value)
    assert f"remove {step}" in str(err.value)
    died = WorkerDiedError("rank 0 died", group="policy", rank=0)
    with pytest.raises(WorkerDiedError):
        _checkpoints(tmp_path, model_dir, _Policy(died)).resume(step)


def test_a_checkpoint_at_the_last_step_says_nothing_is_left(tmp_path, model_dir, monkeypatch, capsys):
    checkpoints = _checkpoints(tmp_path, model_dir, _Policy())
    monkeypatch.setattr(checkpoints, "newest", lambda: tmp_path / "ckpt" / "step_5")
    monkeypatch.setattr(checkpoints, "resume", lambda path: {"step": 5})
    assert checkpoints.resume_newest(1, "sft.max_num_steps") == {"step": 5}
    assert "nothing left to train: the checkpoint is at step 5, sft.max_num_steps=1" in capsys.readouterr().err
    assert checkpoints.resume_newest(8, "sft.max_num_steps") == {"step": 5}
    assert "nothing left" not in capsys.readouterr().err


def test_a_checkpoint_folder_that_cannot_be_made_mid_run_ends_it_as_a_refused_write(tmp_path):
    """checkpointing.dir is checked before the run starts (mrl/app/preflight.py); a file put in its way since ends the
    run as storage that refuses a write does (RunFailed: exit 4, where a re-run resumes), not with a traceback."""
    from mrl.app.commands import explained_failures
    from mrl.app.errors import RunFailed

    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    cfg = validate_tree({"checkpointing": {"enabled": True, "dir": str(a_file / "ckpt")},
                         "run": {"output_dir": str(tmp_path)}})
    checkpoints = RunCheckpoints(cfg, SimpleNamespace(policy=None, critic=None, model_dir=tmp_path))
    with pytest.raises(RunFailed) as failed, explained_failures(cfg):
        checkpoints.save(1, {}, {})
    text = str(failed.value)
    assert f"could not write checkpoint step 1 under {a_file / 'ckpt'}: the folder cannot be made: {a_file} is a " \
           "file" in text
    assert "point checkpointing.dir / run.output_dir elsewhere" in text and "no checkpoint was written yet" in text
