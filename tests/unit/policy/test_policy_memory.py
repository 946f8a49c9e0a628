"""The memory hand-over's mechanism on the host (mrl/policy/memory.py): parked storages free their memory, every view
of them survives, the bytes come back bit for bit, the model's own storages are never optimizer state, and on a CPU
rank (`active=False`) nothing moves but the released flag."""

from __future__ import annotations

import torch

from mrl.config.schema import OffloadConfig
from mrl.policy.memory import HostOffload, Parking, optimizer_params, optimizer_states, storage_key


def test_parking_frees_storages_and_restores_every_view_bit_for_bit():
    base = torch.randn(6, 4)
    view, alias = base[2:4], base.view(-1)  # one storage seen three ways: parked once
    other = torch.randn(5, dtype=torch.float64)
    expected = (base.clone(), other.clone())
    parking = Parking(pin=False)
    moved = parking.park([base, view, alias, other], "cpu")
    assert moved == 6 * 4 * 4 + 5 * 8 and parking.parked
    assert base.untyped_storage().nbytes() == 0 and other.untyped_storage().nbytes() == 0
    assert parking.park([base, other], "cpu") == 0  # already parked: nothing changes
    parking.restore()
    assert not parking.parked
    assert torch.equal(base, expected[0]) and torch.equal(other, expected[1])
    assert torch.equal(view, expected[0][2:4]) and view.untyped_storage()._cdata == base.untyped_storage()._cdata
    base.add_(1)  # the views still share the memory after the round trip
    assert torch.equal(alias, expected[0].view(-1) + 1)
    assert Parking(pin=False).park([base], "cuda") == 0  # only storages on the named device type move


def _adam_model():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)

    class Wrapped:  # the shape of a Megatron optimizer: a torch optimizer inside
        pass

    wrapped = Wrapped()
    wrapped.optimizer = optimizer
    return model, wrapped


def _step(model, optimizer, x):
    optimizer.optimizer.zero_grad()
    model(x).square().sum().backward()
    optimizer.optimizer.step()


def test_optimizer_states_move_and_the_model_own_parameters_stay():
    """fp32 training: the optimizer's params are the model's own (weights: not optimizer state)."""
    x = torch.randn(3, 4)
    model, optimizer = _adam_model()
    twin, twin_opt = _adam_model()
    twin.load_state_dict(model.state_dict())
    _step(model, optimizer, x)
    _step(twin, twin_opt, x)
    assert {storage_key(p) for p in optimizer_params(optimizer)} == {storage_key(p) for p in model.parameters()}
    offload = HostOffload([model], optimizer, OffloadConfig(), active=True)
    report = offload.release()
    assert offload.released
    assert report["optimizer_states_gb"] > 0 and report["gradients_gb"] == 0 and report["weights_gb"] == 0
    assert all(p.untyped_storage().nbytes() > 0 for p in model.parameters())
    states = [s for s in optimizer_states(optimizer) if s.dim()]  # exp_avg, exp_avg_sq
    assert states and all(s.untyped_storage().nbytes() == 0 for s in states)
    offload.reclaim(("weights",))  # a partial reclaim leaves the states parked and the flag set
    assert offload.released and all(s.untyped_storage().nbytes() == 0 for s in states)
    offload.reclaim()
    assert not offload.released
    _step(model, optimizer, x)
    _step(twin, twin_opt, x)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))


def test_weights_move_when_configured_and_a_cpu_rank_only_keeps_the_flag():
    model, optimizer = _adam_model()
    before = [p.detach().clone() for p in model.parameters()]
    offload = HostOffload([model], optimizer, OffloadConfig(weights=True), active=True)
    assert offload.release()["weights_gb"] == sum(p.numel() * 4 for p in model.parameters()) / 1e9
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    offload.reclaim(("weights",))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    idle = HostOffload([model], optimizer, OffloadConfig(weights=True), active=False)
    assert set(idle.release().values()) == {0.0} and idle.released
    assert all(p.untyped_storage().nbytes() > 0 for p in model.parameters())
    idle.reclaim()
    assert not idle.released
