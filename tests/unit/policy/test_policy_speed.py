"""What `policy.speed`'s auto becomes on each kind of rank, and the errors of an option forced on where it cannot run
(mrl/policy/speed.py); the options' effect on the steps is tested for real in
tests/functional/policy/test_policy_worker.py."""

import pytest

from mrl.config import ConfigError, validate_tree
from mrl.config.schema import SpeedConfig
from mrl.policy.speed import SpeedOptionError, resolve_speed


def resolve(cfg=None, *, cuda=True, fused_wgrad=True, data_parallel=2, distributed_optimizer=True, compiles=True):
    return resolve_speed(cfg or SpeedConfig(), cuda=cuda, fused_wgrad=fused_wgrad, data_parallel=data_parallel,
                         distributed_optimizer=distributed_optimizer, compiles=compiles)


def test_auto_turns_each_option_on_only_where_it_runs_and_pays():
    every = resolve()
    assert every.gradient_accumulation_fusion and every.overlap_grad_reduce and every.overlap_param_gather
    cpu = resolve(cuda=False)
    assert not (cpu.gradient_accumulation_fusion or cpu.overlap_grad_reduce or cpu.overlap_param_gather)
    assert not resolve(fused_wgrad=False).gradient_accumulation_fusion  # the output layer calls Apex's kernel
    alone = resolve(data_parallel=1)  # nothing to reduce or gather across ranks
    assert alone.gradient_accumulation_fusion and not alone.overlap_grad_reduce and not alone.overlap_param_gather
    replicated = resolve(distributed_optimizer=False)  # every rank holds all the weights
    assert replicated.overlap_grad_reduce and not replicated.overlap_param_gather


def test_explicit_values_win_over_auto():
    forced = resolve(SpeedConfig(overlap_grad_reduce=True, overlap_param_gather=True), cuda=False, fused_wgrad=False)
    assert forced.overlap_grad_reduce and forced.overlap_param_gather and not forced.gradient_accumulation_fusion
    off = resolve(SpeedConfig(gradient_accumulation_fusion=False, overlap_grad_reduce=False,
                              overlap_param_gather=False))
    assert not (off.gradient_accumulation_fusion or off.overlap_grad_reduce or off.overlap_param_gather)


def test_an_option_forced_on_where_it_cannot_run_says_what_is_missing():
    with pytest.raises(SpeedOptionError, match="CUDA absent, the kernel not installed.*install Apex"):
        resolve(SpeedConfig(gradient_accumulation_fusion=True), cuda=False, fused_wgrad=False)
    with pytest.raises(SpeedOptionError, match="kernel not installed"):
        resolve(SpeedConfig(gradient_accumulation_fusion=True), fused_wgrad=False)
    with pytest.raises(SpeedOptionError, match="use_distributed_optimizer=true"):
        resolve(SpeedConfig(overlap_param_gather=True), distributed_optimizer=False)


def test_a_value_that_is_not_a_switch_is_one_config_error():
    for value in ("yes", 1, None):
        with pytest.raises(ConfigError) as info:
            validate_tree({"policy": {"speed": {"overlap_grad_reduce": value}}})
        (p,) = info.value.problems or [info.value]
        assert p.key == "policy.speed.overlap_grad_reduce" and p.given == value and "auto" in p.allowed and p.fix
    tree = validate_tree({"policy": {"speed": {"overlap_param_gather": False}}})
    assert tree.policy.speed.overlap_param_gather is False and tree.policy.speed.overlap_grad_reduce == "auto"


def test_grouped_expert_gemms_are_on_with_cuda_and_forced_on_anywhere():
    assert resolve().grouped_expert_gemm and not resolve(cuda=False).grouped_expert_gemm
    assert resolve(SpeedConfig(grouped_expert_gemm=True), cuda=False).grouped_expert_gemm  # torch's CPU kernel
    assert not resolve(SpeedConfig(grouped_expert_gemm=False)).grouped_expert_gemm


def test_compiled_fusions_are_on_with_cuda_where_torch_compile_works_and_forced_on_anywhere():
    assert resolve().compiled_fusions and not resolve(cuda=False).compiled_fusions
    assert not resolve(compiles=False).compiled_fusions  # no Triton or C compiler: unfused, not a failed step
    assert resolve(SpeedConfig(compiled_fusions=True), cuda=False).compiled_fusions  # inductor's C++ backend
    assert not resolve(SpeedConfig(compiled_fusions=False)).compiled_fusions


def test_the_compile_probe_is_asked_only_where_auto_needs_it_and_a_failure_turns_auto_off(monkeypatch, caplog):
    """`speed_settings` asks torch.compile only for `auto` on CUDA; where the probe fails (here: no CUDA device to
    compile for), it says why in the log and answers no."""
    from mrl.config.schema import PolicyConfig
    from mrl.model import compiled_kernels
    from mrl.policy import construction

    asked = []
    monkeypatch.setattr(construction, "_inductor_works", lambda: asked.append(1) or True)
    monkeypatch.setattr(construction.torch.cuda, "is_available", lambda: True)
    assert construction.speed_settings(PolicyConfig(), data_parallel=1).compiled_fusions and asked == [1]
    forced = PolicyConfig(speed=SpeedConfig(compiled_fusions=False))
    assert not construction.speed_settings(forced, data_parallel=1).compiled_fusions and asked == [1]
    monkeypatch.undo()
    compiled_kernels.inductor_works.cache_clear()
    with caplog.at_level("WARNING", logger="mrl.model.compiled_kernels"):
        assert compiled_kernels.inductor_works() is False
    compiled_kernels.inductor_works.cache_clear()
    assert "torch.compile fails on this GPU" in caplog.text and "unfused" in caplog.text
