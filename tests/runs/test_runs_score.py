"""`mrl score` through the command line: per-token logprobs equal HF transformers at TP1 and TP2, bad rows are
reported and skipped, perplexity is exp(-mean logprob); a Megatron checkpoint folder of the same weights, written at
the other TP size (`mrl convert hf-to-megatron`'s function on 2 ranks for TP2), scores bit for bit what the HF
folder scores, and so does its hub id from a hub cache holding the same files."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from mrl.testing.distributed import run_on_ranks
from mrl.testing.hub_cache import folder_files, place
from mrl.testing.hub_server import client_env
from mrl.testing.runs import finish, mrl
from mrl.testing.tiny_models import build_tiny_hf_model, hf_token_logprobs

ROWS = [{"text": "The quick brown fox jumps over the lazy dog number 7."},
        {"prompt": "Question: what is 3 plus 10?", "completion": " Answer: 13"},
        {"input_ids": [5, 17, 42, 8, 9], "num_prompt_tokens": 3},
        {"nothing": "here"}]
HUB_ID = "tiny-org/score-model"
LAYOUTS = {"tp1": [], "tp2": ["cluster.devices_per_node=2", "policy.parallel.tensor_parallel_size=2"]}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_hf_model(tmp_path_factory.mktemp("score"), seed=2, family="qwen3", hidden=64, heads=4,
                               num_kv_heads=2, intermediate=128, layers=2)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    source = tmp_path_factory.mktemp("rows") / "in.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return source


def _score_concurrently(runs: dict[str, tuple[Path | str, Path]], inputs: Path,
                        env: dict[str, str] | None = None) -> dict[str, Path]:
    """`mrl score` of {layout: (model, out)}, the runs started together (most of one is Ray and the ranks
    starting); their outputs by layout (a layout not in LAYOUTS runs at TP1)."""
    started = [mrl("score", "--model", str(model), "--input", str(inputs), "--out", str(out),
                   *LAYOUTS.get(layout, []), env=env)
               for layout, (model, out) in runs.items()]
    for proc in started:
        finish(proc)
    return {layout: out for layout, (_, out) in runs.items()}


@pytest.fixture(scope="module")
def hf_scores(model_dir, inputs, tmp_path_factory) -> dict[str, Path]:
    """The HF folder's scores at every layout, and (as "hub") those of the same files placed in a hub cache as
    `hf download` leaves them, scored by their id with HF_HUB_OFFLINE=1."""
    root = tmp_path_factory.mktemp("hf")
    home = root / "hf_home"
    place(home / "hub", HUB_ID, folder_files(model_dir))
    runs: dict[str, tuple[Path | str, Path]] = {layout: (model_dir, root / f"{layout}.jsonl") for layout in LAYOUTS}
    runs["hub"] = (HUB_ID, root / "hub.jsonl")
    return _score_concurrently(runs, inputs, env=client_env(None, home, offline=True))


def test_a_hub_id_scores_what_the_same_files_as_a_folder_score(hf_scores):
    assert hf_scores["hub"].read_text() == hf_scores["tp1"].read_text()  # every logprob bit for bit


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_score_matches_hf_transformers(model_dir, hf_scores, layout):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    result = [json.loads(line) for line in hf_scores[layout].read_text().splitlines()]
    assert [r["index"] for r in result] == [0, 1, 2, 3] and "error" in result[3]

    text_ids = tokenizer(ROWS[0]["text"])["input_ids"]
    expected = hf_token_logprobs(model_dir, text_ids)
    assert result[0]["num_scored_tokens"] == len(text_ids) - 1
    assert (torch.tensor(result[0]["logprobs"]) - expected).abs().max() <= 1e-5
    assert result[0]["perplexity"] == pytest.approx(math.exp(-expected.double().mean().item()), rel=1e-5)

    prompt = tokenizer(ROWS[1]["prompt"])["input_ids"]
    full = prompt + tokenizer(ROWS[1]["completion"], add_special_tokens=False)["input_ids"]
    expected = hf_token_logprobs(model_dir, full)[len(prompt) - 1:]  # completion tokens only
    assert result[1]["token_ids"] == full[len(prompt):]
    assert (torch.tensor(result[1]["logprobs"]) - expected).abs().max() <= 1e-5

    expected = hf_token_logprobs(model_dir, ROWS[2]["input_ids"])[2:]
    assert (torch.tensor(result[2]["logprobs"]) - expected).abs().max() <= 1e-5


def convert_on_rank(hf_dir: str, outs: dict[int, str]) -> None:
    """Rank side: `mrl convert hf-to-megatron` at each TP size (TP1 on 2 ranks: two data-parallel replicas)."""
    from mrl.app import convert

    for tp, out in outs.items():
        convert.hf_to_megatron(hf_dir, out, tp=tp)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def megatron_scores(model_dir, inputs, tmp_path_factory) -> dict[str, Path]:
    """The HF model converted to Megatron checkpoint folders at TP1 and TP2, each scored at the other layout (loaded
    resharded); the scores by the layout they were computed at."""
    root = tmp_path_factory.mktemp("megatron")
    written = {"tp1": root / "tp1", "tp2": root / "tp2"}
    outs = {1: str(written["tp1"]), 2: str(written["tp2"])}
    run_on_ranks(convert_on_rank, world_size=2, args=(str(model_dir), outs), timeout_s=240,
                 env={"TOKENIZERS_PARALLELISM": "false"})
    return _score_concurrently({"tp1": (written["tp2"], root / "tp1.jsonl"), "tp2": (written["tp1"], root / "tp2.jsonl")},
                               inputs)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_megatron_folder_written_at_another_tp_scores_what_the_hf_folder_scores(hf_scores, megatron_scores, layout):
    assert megatron_scores[layout].read_text() == hf_scores[layout].read_text()  # every logprob bit for bit


def test_score_prints_where_an_engine_s_routing_and_the_trainer_s_part_per_layer(tmp_path):
    """Rows of a mixture-of-experts model carrying an engine's routed_experts: `mrl score` counts per MoE layer the
    tokens the trainer routes elsewhere. Random expert sets (what no trainer would choose) differ on ~27/28 of the
    tokens in every layer; replaying them (policy.moe.router_replay=replay) moves the logprobs, and a row without
    routing scores as before."""
    moe_dir = build_tiny_hf_model(tmp_path / "moe", "qwen3_moe", layers=2, seed=4)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 200, (2, 24), generator=g).tolist()
    routing = torch.rand(24, 2, 8, generator=g).argsort(dim=-1)[..., :2].tolist()  # [tokens, layers, k]
    rows = [{"input_ids": ids[0], "num_prompt_tokens": 1, "routed_experts": routing}, {"input_ids": ids[1]}]
    inputs = tmp_path / "in.jsonl"
    inputs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    outs = {mode: tmp_path / f"{mode}.jsonl" for mode in ("measure", "replay")}
    started = {mode: mrl("score", "--model", str(moe_dir), "--input", str(inputs), "--out", str(out),
                         f"policy.moe.router_replay={mode}") for mode, out in outs.items()}
    printed = {mode: finish(proc) for mode, proc in started.items()}
    for mode in outs:
        layers = [float(line.rsplit(":", 1)[1]) for line in printed[mode].splitlines()
                  if "[mrl score] moe_routing_differs/layer_" in line]
        assert len(layers) == 2 and all(0.75 < f <= 1.0 for f in layers), printed[mode][-2000:]
    scored = {mode: [json.loads(line) for line in out.read_text().splitlines()] for mode, out in outs.items()}
    moved = torch.tensor(scored["replay"][0]["logprobs"]) - torch.tensor(scored["measure"][0]["logprobs"])
    assert moved.abs().max() > 0.05
    assert scored["replay"][1]["logprobs"] == scored["measure"][1]["logprobs"]
    expected = hf_token_logprobs(moe_dir, ids[0])
    assert (torch.tensor(scored["measure"][0]["logprobs"]) - expected).abs().max() <= 1e-5  # measuring moves nothing
