"""Per-rank environment, rendezvous port choice and the data-parallel layout (no Ray instance)."""

import math
import os
import socket

import pytest

from mrl.distributed.env import (BIND_GLOO_TO_NODE_IP, CORES_SHARED_BY, find_free_port, gloo_interface, local_ranks,
                                 node_cores, rank_environment, thread_share, worker_threads)
from mrl.testing.runs import RECIPE
from mrl.distributed.worker_group import DataParallelLayout
from mrl.parallel import ports


def test_free_port_can_be_bound_and_is_not_a_privileged_port():
    port = find_free_port()
    assert 1024 < port < 65536
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", port))  # raises if the port were in use


@pytest.mark.skipif(len(ports._ports_to_pick_from()) < 1000, reason="the ephemeral range leaves no ports to pick")
def test_free_port_is_never_one_the_os_hands_out_itself(monkeypatch):
    """Below the ephemeral range (where bind(0) and outgoing connections take theirs), and a port in use is skipped."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_start = int(f.read().split()[0])
    assert all(ports.PICKED_PORTS[0] <= find_free_port() < ephemeral_start for _ in range(50))

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("", find_free_port()))
        taken.listen()
        busy = taken.getsockname()[1]
        picks = iter([busy, busy, busy + 1 if busy + 1 < ephemeral_start else busy - 1])

        class Picker:
            def choice(self, candidates):
                return next(picks)

        monkeypatch.setattr(ports.random, "SystemRandom", Picker)
        assert find_free_port() not in (busy, None)


def test_local_ranks_count_positions_per_node_in_rank_order():
    assert local_ranks(["a", "a", "b", "a", "b"]) == [(0, 3), (1, 3), (0, 2), (2, 3), (1, 2)]


def test_rank_environment_sets_torch_variables_and_threads():
    envs = rank_environment(["n0", "n0", "n1", "n1"], omp_num_threads=2)
    assert [env["RANK"] for env in envs] == ["0", "1", "2", "3"]
    assert {env["WORLD_SIZE"] for env in envs} == {"4"} and {env["OMP_NUM_THREADS"] for env in envs} == {"2"}
    assert [env["LOCAL_RANK"] for env in envs] == ["0", "1", "0", "1"]
    assert all(env["MALLOC_MMAP_THRESHOLD_"] == str(32 * 1024 * 1024) for env in envs)
    with pytest.raises(ValueError, match="omp_num_threads"):
        rank_environment(["n0"], omp_num_threads=0)
    assert all(env[BIND_GLOO_TO_NODE_IP] == "1" for env in envs)  # several nodes: gloo binds the node's IP
    assert BIND_GLOO_TO_NODE_IP not in rank_environment(["n0", "n0"], omp_num_threads=1)[0]


def test_gloo_interface_is_the_one_holding_the_node_ip():
    from collections import namedtuple

    Address = namedtuple("Address", "family address")
    addresses = {"lo": [Address(socket.AF_INET, "127.0.0.1")],
                 "veth0": [Address(socket.AF_INET6, "fe80::1"), Address(socket.AF_INET, "10.211.0.2")]}
    assert gloo_interface("10.211.0.2", addresses) == "veth0"
    assert gloo_interface("10.9.9.9", addresses) is None


def test_layout_leaders_in_data_parallel_order():
    # 4 ranks, TP=2 inner, DP=2 outer; the leader is TP rank 1 (e.g. the rank that holds the outputs).
    layout = DataParallelLayout.from_reports([(0, False), (0, True), (1, False), (1, True)])
    assert layout.dp_size == 2 and layout.leaders == [1, 3]
    assert DataParallelLayout.pure(3).leaders == [0, 1, 2]


def test_layout_rejects_missing_dp_ranks_and_bad_leader_counts():
    with pytest.raises(ValueError, match=r"0\.\.2 with none missing, got \[0, 2\]"):
        DataParallelLayout((0, 2), (True, True))
    with pytest.raises(ValueError, match="rank 0 must have exactly one leader, got ranks \\[0, 1\\]"):
        DataParallelLayout((0, 0), (True, True))
    with pytest.raises(ValueError, match="exactly one leader, got ranks \\[\\]"):
        DataParallelLayout((0, 0), (False, False))


def test_auto_threads_send_the_divisor_not_a_count():
    """"auto": each rank learns how many processes share its node's cores (its group's ranks there, or a given
    number), and sets no OMP_NUM_THREADS of its own (the worker computes it from its node's cores)."""
    envs = rank_environment(["n0", "n0", "n0", "n1"], omp_num_threads="auto")
    assert [env[CORES_SHARED_BY] for env in envs] == ["3", "3", "3", "1"]
    assert not any("OMP_NUM_THREADS" in env for env in envs)
    assert {env[CORES_SHARED_BY] for env in rank_environment(["n0", "n1"], "auto", busy_per_node=4)} == {"4"}
    assert CORES_SHARED_BY not in rank_environment(["n0"], omp_num_threads=3)[0]
    with pytest.raises(ValueError, match="busy_per_node"):
        rank_environment(["n0"], "auto", busy_per_node=0)


def test_a_process_share_of_the_cores_is_at_least_one_thread():
    assert [thread_share(16, k) for k in (1, 2, 3, 4, 16, 32)] == [16, 8, 5, 4, 1, 1]


@pytest.mark.parametrize("files, expected", [
    ({"cpu.max": "max 100000\n"}, None),  # cgroup v2, no quota
    ({"cpu.max": "150000 100000\n"}, 1.5),  # 1.5 CPUs
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),  # v1, no quota
    ({"cpu/cpu.cfs_quota_us": "400000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 4.0),
    ({}, None),  # no cgroup files at all
])
def test_node_cores_are_capped_by_a_cgroup_quota_rounded_up(tmp_path, files, expected):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    affinity = len(os.sched_getaffinity(0))
    want = affinity if expected is None else min(affinity, math.ceil(expected))
    assert node_cores(tmp_path) == want


def test_worker_threads_take_a_number_then_the_launching_environment_then_the_cores():
    from mrl.config import load_config

    def threads(*overrides, env=None):
        return worker_threads(load_config(RECIPE, list(overrides)), env or {})

    assert threads("cluster.omp_num_threads=3", env={"OMP_NUM_THREADS": "1"}) == (3, None)  # the config wins
    assert threads(env={"OMP_NUM_THREADS": "2"}) == (2, None)  # auto: the shell's setting (the test suite's 1)
    assert threads() == ("auto", None)  # phases take turns: each group divides the cores among its own ranks
    assert threads("grpo.max_off_policy_steps=1", "loss.importance_sampling=tis", "generation.colocated=false",
                   "generation.num_devices=1", "cluster.devices_per_node=2") == ("auto", 2)  # all the node's workers
    with pytest.raises(ValueError, match="OMP_NUM_THREADS='four'"):
        threads(env={"OMP_NUM_THREADS": "four"})
