"""`vllm_workarounds.mla_backend_for_dtype`: on a CPU with AMX tiles an fp32 engine asks for vLLM's reference CPU MLA
backend, which vLLM's own selection then returns (its AMX backend refuses fp32 weights); bf16 engines and CPUs without
AMX keep vLLM's choice."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from mrl.cpu import isa, vllm_workarounds

pytest.importorskip("vllm")


@pytest.mark.parametrize("amx", [True, False])
def test_fp32_asks_for_the_reference_mla_backend_only_where_amx_would_be_chosen(monkeypatch, amx):
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)  # what vLLM asks
    monkeypatch.setattr(vllm_workarounds.isa, "current", lambda: replace(isa.detect(), amx=amx))  # what mrl asks
    mla = SimpleNamespace(use_sparse=False, use_mla=True)

    def chosen(kwargs):
        asked = kwargs.get("attention_config", {}).get("backend")
        return CpuPlatform.get_attn_backend_cls(asked and AttentionBackendEnum[asked], mla)

    fp32, bf16 = vllm_workarounds.engine_kwargs(1 << 20, "float32"), vllm_workarounds.engine_kwargs(1 << 20, "bfloat16")
    assert "attention_config" not in bf16 and ("attention_config" in fp32) == amx
    assert chosen(fp32) == AttentionBackendEnum.CPU_MLA.get_path()  # the backend that runs fp32
    assert chosen(bf16) == (AttentionBackendEnum.AMX_MLA if amx else AttentionBackendEnum.CPU_MLA).get_path()
    assert fp32["kv_cache_memory_bytes"] == 1 << 20 and fp32["enable_chunked_prefill"] is False
