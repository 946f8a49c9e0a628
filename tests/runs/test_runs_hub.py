"""Models and data by hub id, through the real command line and the real huggingface_hub client, on a hub served on
loopback (mrl/testing/hub_server.py) and the cache it fills:

- `mrl download` of a model fetches what mrl reads and nothing else (no pytorch_model.bin, no original/), and of a
  dataset its README and data files; the cache is laid out as `hf download` leaves it.
- The DeepScaleR 8K recipe, unchanged, with its own ids (policy.model_name, data.train, data.val) resolved from that
  cache with HF_HUB_OFFLINE=1 (a tiny stand-in model and a few rows placed under those ids, sizes overridden on the
  command line), runs 2 GRPO steps and records each id's commit in hub.json and summary.json.
- Re-run online once the hub's main has moved to a new commit, the run says so, keeps the recorded commit and resumes.
- A gated, a missing and an uncached id each exit 2 naming the id and the key, without a traceback.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from mrl.testing.hub_cache import folder_files
from mrl.testing.hub_server import client_env, gate, publish, serve_hub
from mrl.testing.runs import MACHINERY, finish, metrics, mrl

pytestmark = pytest.mark.functional

RECIPE = str(Path(__file__).resolve().parents[2] / "recipes" / "grpo-deepscaler-1.5b-8K.yaml")
MODEL, TRAIN, VAL = "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", "agentica-org/DeepScaleR-Preview-Dataset", \
    "HuggingFaceH4/aime_2024"
SMALL = ("cluster.devices_per_node=1", "policy.precision=float32", "policy.max_total_sequence_length=200",
         "policy.train_global_batch_size=4", "policy.logprob_micro_batch_size=4",
         "policy.sequence_packing.tokens_per_microbatch=200", "generation.max_new_tokens=8",
         "generation.vllm.max_model_len=200", "generation.vllm.enforce_eager=true", "grpo.num_prompts_per_step=2",
         "grpo.num_generations_per_prompt=2", "grpo.val_every=2", "env.num_workers=1", "eval.num_samples=1",
         "eval.pass_k=[1]", "checkpointing.save_every=1", *MACHINERY)


def _model_files(folder: Path, seed: int) -> dict[str, bytes]:
    from mrl.testing.tiny_models import build_tiny_hf_model

    model = build_tiny_hf_model(folder, family="qwen2", hidden=64, heads=2, num_kv_heads=2, layers=2, seed=seed)
    # What a real repo also holds and mrl must not fetch: another copy of the weights, the original format.
    return {**folder_files(model), "pytorch_model.bin": b"\0" * 64, "original/consolidated.00.pth": b"\0" * 64}


def _parquet(rows: list[dict]) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), out)
    return out.getvalue()


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """The three repos of the recipe on a loopback hub: DeepScaleR's train rows as one JSON array (deepscaler.json,
    as that repo ships them), AIME's as a parquet file of the train split only (data/train-00000-of-00001.parquet)."""
    root = tmp_path_factory.mktemp("hub")
    commits = {"model": publish(root, MODEL, _model_files(root.parent / "model_a", seed=3))}
    train = [{"problem": f"What is {a}+{b}?", "answer": str(a + b), "solution": "."} for a in range(6) for b in range(4)]
    commits["train"] = publish(root, TRAIN, {"deepscaler.json": json.dumps(train).encode(), "README.md": b"# rows\n"},
                               repo_type="dataset")
    val = [{"id": i, "problem": f"What is {i}+1?", "answer": str(i + 1), "year": "2024"} for i in range(6)]
    commits["val"] = publish(root, VAL, {"data/train-00000-of-00001.parquet": _parquet(val),
                                         "README.md": b"---\nlicense: mit\n---\n"}, repo_type="dataset")
    publish(root, "some-org/gated-model", {"config.json": b"{}"})
    gate(root, "some-org/gated-model")
    with serve_hub(root) as server:
        yield root, server, commits


@pytest.fixture(scope="module")
def downloaded(hub, tmp_path_factory):
    """`mrl download` of the three ids into a fresh HF_HOME, as on a login node."""
    root, server, commits = hub
    home = tmp_path_factory.mktemp("hf_home")
    env = client_env(server.url, home)
    outputs = [finish(mrl("download", MODEL, env=env)), finish(mrl("download", TRAIN, "--dataset", env=env)),
               finish(mrl("download", VAL, "--dataset", env=env))]
    return home, outputs


def test_download_fetches_what_mrl_reads_into_the_hub_cache_layout(hub, downloaded):
    root, server, commits = hub
    home, outputs = downloaded
    repo = home / "hub" / f"models--{MODEL.replace('/', '--')}"
    assert (repo / "refs" / "main").read_text() == commits["model"]
    snapshot = repo / "snapshots" / commits["model"]
    assert sorted(p.name for p in snapshot.iterdir()) == ["chat_template.jinja", "config.json",
                                                          "generation_config.json", "model.safetensors",
                                                          "tokenizer.json", "tokenizer_config.json"]
    assert all(p.is_symlink() and p.resolve().parent == repo / "blobs" for p in snapshot.iterdir())
    asked = " ".join(server.requests)
    assert "pytorch_model.bin" not in asked and "original/" not in asked
    data = home / "hub" / f"datasets--{TRAIN.replace('/', '--')}" / "snapshots" / commits["train"]
    assert sorted(p.name for p in data.iterdir()) == ["README.md", "deepscaler.json"]
    assert f"commit {commits['model']}" in outputs[0]


def test_an_unknown_gated_or_uncached_id_is_a_config_error_naming_it(hub, downloaded, tmp_path):
    root, server, _ = hub
    home, _ = downloaded
    online = client_env(server.url, tmp_path / "other_home")
    cases = [(("download", "some-org/gated-model"), online, ["gated", "hf auth login"]),
             (("download", "some-org/no-such-model"), online, ["no model some-org/no-such-model", "misspelt"]),
             (("download", "some-org/any-model"), client_env("http://127.0.0.1:9", tmp_path / "third_home"),
              ["could not be fetched", "HTTPS_PROXY"]),  # out of reach: only the network helps, no local path
             (("grpo", "--config", RECIPE, *SMALL, "policy.model_name=some-org/not-downloaded",
               f"run.output_dir={tmp_path / 'run'}"), client_env(None, home, offline=True),
              ["policy.model_name", "some-org/not-downloaded", "mrl download some-org/not-downloaded"])]
    for args, env, expected in cases:
        proc = mrl(*args, env=env)
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 2, out
        assert "Traceback" not in out and all(text in out for text in expected), out
        assert "HTTPS_PROXY" not in expected or "local folder" not in out, out  # out of reach: no local path


@pytest.fixture(scope="module")
def grpo_run(hub, downloaded, tmp_path_factory):
    """The DeepScaleR 8K recipe by its own ids, offline from the downloaded cache, 2 steps."""
    home, _ = downloaded
    out = tmp_path_factory.mktemp("deepscaler")
    args = ("grpo", "--config", RECIPE, *SMALL, f"run.output_dir={out}", f"checkpointing.dir={out / 'ckpt'}")
    log = finish(mrl(*args, "grpo.max_num_steps=2", env=client_env(None, home, offline=True)), timeout=400)
    return out, args, log


def test_the_deepscaler_recipe_runs_on_its_hub_ids_offline_and_records_their_commits(hub, grpo_run):
    _, _, commits = hub
    out, _, log = grpo_run
    recorded = json.loads((out / "hub.json").read_text())
    assert {key: record["commit"] for key, record in recorded.items()} == {
        "policy.model_name": commits["model"], "data.train": commits["train"], "data.val": commits["val"]}
    assert recorded["policy.model_name"]["id"] == MODEL and recorded["data.val"]["revision"] == "main"
    assert json.loads((out / "summary.json").read_text())["hub"] == recorded
    logged = metrics(out / "logs")
    assert {1, 2} <= set(logged) and "val/accuracy" in logged[2]
    assert "reading its only split 'train'" in log  # AIME ships a train split alone; it is the held-out data


def test_a_rerun_after_main_moved_keeps_the_recorded_commit_and_resumes(hub, grpo_run, downloaded, tmp_path):
    root, server, commits = hub
    home, _ = downloaded
    out, args, _ = grpo_run
    moved = publish(root, MODEL, _model_files(tmp_path / "model_b", seed=4))
    log = finish(mrl(*args, "grpo.max_num_steps=3", env=client_env(server.url, home)), timeout=400)
    assert f"now points at commit {moved}; this run keeps the commit it recorded, {commits['model']}" in log
    assert json.loads((out / "hub.json").read_text())["policy.model_name"]["commit"] == commits["model"]
    assert "resum" in log.lower() and 3 in metrics(out / "logs")
    assert not (home / "hub" / f"models--{MODEL.replace('/', '--')}" / "snapshots" / moved).exists()
