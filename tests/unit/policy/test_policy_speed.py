"""What `policy.speed`'s auto becomes on each kind of rank, and the errors of an option forced on where it cannot run
(mrl/policy/speed.py); the options' effect on the steps is tested for real in
tests/functional/policy/test_policy_worker.py."""

import pytest

from mrl.config import ConfigError, validate_tree
from mrl.config.schema import SpeedConfig
from mrl.policy.speed import SpeedOptionError, resolve_speed


def resolve(cfg=None, *, cuda=True, fused_wgrad=True, data_parallel=2, distributed_optimizer=True):
    return resolve_speed(cfg or SpeedConfig(), cuda=cuda, fused_wgrad=fused_wgrad, data_parallel=data_parallel,
                         distributed_optimizer=distributed_optimizer)


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
