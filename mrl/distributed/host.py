"""The object that lives inside each worker actor: it builds the caller's worker class and runs its methods.

The caller's class stays a plain Python class (no Ray decorator, testable without Ray). Wrapping it here lets the
group set the rendezvous variables before the class is built, report where the process runs, and move tensors
as numpy both ways (transport.py).
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

import ray

from mrl.distributed import faults, stacks
from mrl.distributed.env import BIND_GLOO_TO_NODE_IP, find_free_port, gloo_interface, take_thread_share
from mrl.distributed.transport import decode, encode
from mrl.logging.known_noise import silence_known_noise


class WorkerHost:
    """One per actor; holds one instance of the worker class."""

    def __init__(self) -> None:
        silence_known_noise()  # before the worker class imports Megatron or vLLM
        stacks.register()  # SIGUSR1 dumps this process's stacks: the controller asks when a call is late
        take_thread_share()  # threads "auto": this process's share of its node's cores (mrl/distributed/env.py)
        self._worker: Any = None

    def info(self) -> dict[str, Any]:
        """Where this worker runs, for error messages and the rendezvous address."""
        return {
            "pid": os.getpid(),
            "node_ip": ray.util.get_node_ip_address(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "hostname": socket.gethostname(),
        }

    def free_port(self) -> int:
        return find_free_port()

    def preload(self, worker_cls: type) -> None:
        """Import ahead what building the worker needs, so that a group that must wait before building its workers
        (`WorkerGroup(wait_before_init=...)`) imports meanwhile: Ray imports the class's module on the way in, and
        the class's own `preload()` (a static method, if it has one) the rest (Megatron, vLLM: seconds)."""
        faults.register(worker_cls.__name__)  # a fault campaign may kill it from here on
        hook = getattr(worker_cls, "preload", None)
        if callable(hook):
            hook()

    def start(self, worker_cls: type, env: dict[str, str], payload: tuple[tuple, dict[str, Any]]) -> float:
        """Export `env` (rendezvous address) and build the worker: its __init__ may already join process groups.
        Returns the wall time at which the build began."""
        began = time.time()
        os.environ.update(env)
        if os.environ.get(BIND_GLOO_TO_NODE_IP) and "GLOO_SOCKET_IFNAME" not in os.environ:
            interface = gloo_interface(ray.util.get_node_ip_address())
            if interface:
                os.environ["GLOO_SOCKET_IFNAME"] = interface
        args, kwargs = decode(payload)
        faults.register(worker_cls.__name__)
        self._worker = worker_cls(*args, **kwargs)
        return began

    def call(self, method: str, payload: tuple[tuple, dict[str, Any]]) -> Any:
        args, kwargs = decode(payload)
        return encode(getattr(self._worker, method)(*args, **kwargs))

    def call_with_shard(self, method: str, shard: Any, payload: tuple[tuple, dict[str, Any]]) -> Any:
        args, kwargs = decode(payload)
        return encode(getattr(self._worker, method)(decode(shard), *args, **kwargs))
