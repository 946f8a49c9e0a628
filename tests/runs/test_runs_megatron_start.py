"""Commands started from a Megatron checkpoint folder (`mrl convert hf-to-megatron` output) instead of the HF folder it
was converted from, through the real command line, on the 1-digit arithmetic task's random initial model:

- GRPO (2 steps, validation before the first and after the last) from the converted folder logs exactly the metrics
  of the run from the HF folder, and writes the same step-0 validation samples: the engine, started from the config
  alone, was refitted before its first generation. With run.final_format=megatron no *.safetensors file appears
  anywhere in its run folder, the source folder or its temporary folder (refit buckets are shared-memory files in
  /dev/shm, removed once loaded, as in every run), and its final_megatron/ holds the weights the HF run exported in
  final_hf/ (converted back, bit for bit). A KL term makes both runs load the frozen reference from their source.
- `mrl rm`'s reward model made from the converted folder (read in memory) is the one made from the HF folder.
- `mrl eval` from the converted folder (no policy of its own: a frozen one refits the engine, then stops) samples
  exactly what the HF run's step-0 validation sampled (same engine seeds and settings).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from mrl.testing.runs import RECIPE, SHORT_ARITH, finish, metrics, mrl


def _grpo(model: Path, out: Path, *extra: str) -> list[str]:
    return ["grpo", "--config", RECIPE, *SHORT_ARITH, f"policy.model_name={model}", "~policy.build",
            "grpo.max_num_steps=2", "loss.kl_beta=0.01", f"run.output_dir={out}", *extra]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Iterator[dict[str, Path]]:
    """The initial model as an HF folder and converted; GRPO from each and `mrl eval` from the converted one, started
    together (most of a run's time is Ray and the workers starting); the temporary folder of the GRPO run from the
    Megatron folder."""
    from mrl.app.starting_model import build_initial_model
    from mrl.config import load_config

    root = tmp_path_factory.mktemp("start")
    cfg = load_config(RECIPE, list(SHORT_ARITH))
    hf = build_initial_model(cfg, cfg.policy.build, root / "hf")  # what `policy.build` starts from
    megatron = root / "megatron"
    finish(mrl("convert", "hf-to-megatron", "--hf", str(hf), "--out", str(megatron)))
    temp = Path(tempfile.mkdtemp(prefix="mrl-tmp-"))  # a short path: Ray's sockets live under it
    started = [mrl(*_grpo(hf, root / "from_hf")),
               mrl(*_grpo(megatron, root / "from_megatron", "run.final_format=megatron"), env={"TMPDIR": str(temp)}),
               mrl("eval", "--config", RECIPE, *SHORT_ARITH, f"policy.model_name={megatron}", "~policy.build",
                   f"run.output_dir={root / 'eval'}")]
    for proc in started:
        finish(proc)
    yield {"hf": hf, "megatron": megatron, "from_hf": root / "from_hf", "from_megatron": root / "from_megatron",
            "eval": root / "eval", "temp": temp}
    shutil.rmtree(temp, ignore_errors=True)  # Ray's session logs of that run


def _logged(out: Path) -> dict[int, dict]:
    """Every metric but times (which differ run to run)."""
    return {step: {k: v for k, v in row.items() if not k.startswith("timing/") and "time" not in k}
            for step, row in metrics(out / "logs").items()}


def test_grpo_from_a_megatron_folder_logs_what_the_hf_start_logs_and_writes_no_safetensors(runs, tmp_path):
    from converters.hf_io import load_hf_state

    out, reference = runs["from_megatron"], runs["from_hf"]
    assert [p for root in (out, runs["megatron"], runs["temp"]) for p in root.rglob("*.safetensors")] == []
    logged = _logged(out)
    assert sorted(logged) == [0, 1, 2] and logged == _logged(reference)
    assert all(logged[step]["train/token_mult_prob_error"] <= 1.001 for step in (1, 2))
    step0 = "val_samples/step_0.jsonl"
    assert (out / step0).read_text() == (reference / step0).read_text()

    final = out / "final_megatron"
    assert (final / ".complete").is_file() and not (out / "final_hf").exists()
    finish(mrl("convert", "megatron-to-hf", "--megatron", str(final), "--out", str(tmp_path / "back")))
    exported, expected = load_hf_state(tmp_path / "back"), load_hf_state(reference / "final_hf")
    assert exported.keys() == expected.keys() and all(exported[k].equal(expected[k]) for k in expected)


def test_eval_from_a_megatron_folder_samples_what_the_hf_model_samples(runs):
    assert (runs["eval"] / "samples.jsonl").read_text() == \
        (runs["from_hf"] / "val_samples" / "step_0.jsonl").read_text()


def make_reward_model(model: str, out: str) -> None:
    """Rank side (a process of its own: reading a Megatron folder makes process groups)."""
    from mrl.app.model_source import classify_model_path
    from mrl.app.reward_model import reward_model_source

    reward_model_source(classify_model_path(model), Path(out), pad_token_id=0, seed=7)


def test_a_reward_model_made_from_a_megatron_folder_is_the_one_made_from_hf(runs, tmp_path):
    from converters.hf_io import load_hf_config, load_hf_state
    from mrl.testing.distributed import run_on_ranks

    for name in ("hf", "megatron"):
        run_on_ranks(make_reward_model, world_size=1, args=(str(runs[name]), str(tmp_path / name)))
    made = {name: tmp_path / name / "reward_model_init" for name in ("hf", "megatron")}
    assert load_hf_config(made["megatron"]) == load_hf_config(made["hf"])
    state, expected = load_hf_state(made["megatron"]), load_hf_state(made["hf"])
    assert "score.weight" in expected and state.keys() == expected.keys()
    assert all(state[k].equal(expected[k]) for k in expected)
