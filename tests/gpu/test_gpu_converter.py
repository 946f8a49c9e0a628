"""The HF <-> Megatron converter on device tensors: the round trip is bit-exact on CUDA, as on CPU, at TP1 and TP2."""

from __future__ import annotations

import pytest
import torch

import converters as C
from converters.hf_io import load_hf_config, load_hf_state
from mrl.testing.tiny_models import build_tiny_hf_model


@pytest.mark.parametrize("tp", [1, 2])
def test_round_trip_on_cuda_is_bit_exact(tmp_path, tp):
    folder = build_tiny_hf_model(tmp_path, hidden=128, layers=2, heads=4, intermediate=256)
    config = load_hf_config(folder)
    hf = {name: t.cuda() for name, t in load_hf_state(folder).items()}
    shards = [C.hf_to_megatron(hf, config, rank, tp) for rank in range(tp)]
    assert all(t.is_cuda for shard in shards for t in shard.values())
    rules = {name: C.rule_for(name, config) for name in shards[0]}
    full = {name: C.tp_unshard([s[name] for s in shards], rule.tp_dim, gated=rule.gated)
            for name, rule in rules.items()}
    back = dict(C.megatron_to_hf(full, config))
    assert back.keys() == hf.keys()
    assert all(torch.equal(back[name], hf[name]) for name in hf)
