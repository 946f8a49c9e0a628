"""The Ray cluster seen by mrl: start or join Ray, reserve resources as placement groups, shut down cleanly.

A `Placement` is an ordered list of bundles (`{"CPU": n}` on CPU, `{"GPU": 1, "CPU": n}` on GPUs), `bundles_per_node`
on each of `num_nodes` nodes, in rank order (ranks 0..k-1 on the first node, so tensor-parallel neighbours share a
node). Worker groups put one actor per bundle. Several groups may use the same bundles (colocation: the policy and
the rollout engine share devices, each actor asking for a fraction of its bundle) or disjoint bundles (another
placement, or a subset of this one's bundle indices).

Each node's bundles form one STRICT_PACK placement group, so a node's bundles really are on one node; the groups of
different nodes land on different machines whenever a machine cannot hold two of them (always the case for
GPU bundles that fill a node). On one machine several "nodes" simply share it, which is how CPU tests run.
`one_group=True` reserves one PACK group of every bundle instead, for a vLLM engine whose workers span nodes (vLLM's
Ray executor places an engine's workers in one placement group, its actor's): bundles that fill nodes' GPUs pack
node by node, and the bundles are put in rank order node by node; a node holding other than `bundles_per_node` of
them is refused.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group

from mrl.distributed.errors import ClusterResourceError

if TYPE_CHECKING:
    from mrl.config.schema import ClusterConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Bundle:
    """One reserved slot: bundle `index` of placement group `group`, on node `node_ip`."""

    group: PlacementGroup
    index: int
    resources: dict[str, float]
    node_id: str
    node_ip: str


@dataclass
class Placement:
    """Bundles in rank order. Owned by the `RayCluster` that created it, which removes it on `remove_placement`
    or `shutdown`; removing it kills every actor placed on it."""

    name: str
    bundles: list[Bundle]
    groups: list[PlacementGroup] = field(repr=False)

    @property
    def num_bundles(self) -> int:
        return len(self.bundles)

    @property
    def on_gpus(self) -> bool:
        """Whether its bundles hold GPUs (then every actor placed on it asks for a share of one)."""
        return bool(self.bundles and self.bundles[0].resources.get("GPU", 0.0))


def _format_resources(resources: dict[str, float]) -> str:
    keys = [key for key in ("CPU", "GPU") if key in resources]
    return "{" + ", ".join(f"{key}: {resources[key]:g}" for key in keys) + "}"


def _node_addresses() -> dict[str, str]:
    """node id -> IP of every live node."""
    return {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes() if node["Alive"]}


#: Workaround, Ray 2.60: a new local node gets 30 s to register with its GCS, a constant of `Node.__init__`
#: (`raylet_start_wait_time_s`, ray/_private/node.py; no setting changes it), then `ray.init` raises a bare Exception
#: with this text. On 2 cores shared with another test's workers it happened once in CI (a staged run's first stage).
#: The processes the failed start left (its GCS server, raylet) are killed and the start is tried again.
NODE_START_TIMEOUT = "The current node timed out during startup"
LOCAL_START_TRIES = 3


def start_local_ray(**init_kwargs: Any) -> None:
    """`ray.init(**init_kwargs)` for a local instance, tried again up to `LOCAL_START_TRIES` times when its node
    did not register in time (`NODE_START_TIMEOUT`), each time after killing what the failed try started."""
    import psutil

    for attempt in range(1, LOCAL_START_TRIES + 1):
        before = {child.pid for child in psutil.Process().children(recursive=True)}
        try:
            ray.init(**init_kwargs)
            return
        except Exception as error:
            if NODE_START_TIMEOUT not in str(error):
                raise
            _kill_new_children(before)
            if attempt == LOCAL_START_TRIES:
                raise
            log.warning(
                "Ray's local node did not register within Ray's 30 s (try %d of %d); starting it again",
                attempt,
                LOCAL_START_TRIES,
            )


def ray_gcs_refuses() -> Optional[str]:
    """The GCS address of the Ray this process started or joined when nothing listens there any more (a refused
    connection: its GCS stopped serving, as it does on SIGTERM, while its process may linger); None while it answers,
    is out of reach for another reason, or Ray is not up. Reads Ray's private `_global_node.gcs_address`."""
    node = getattr(ray._private.worker, "_global_node", None)
    address = getattr(node, "gcs_address", None)
    if not address:
        return None
    host, _, port = str(address).rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
    except ConnectionRefusedError:
        return str(address)
    except (OSError, ValueError):
        return None
    return None


def _kill_new_children(before: set[int]) -> None:
    """Kill this process's descendants that are not in `before` (what a failed `ray.init` started)."""
    import psutil

    left = [child for child in psutil.Process().children(recursive=True) if child.pid not in before]
    for child in left:
        try:
            child.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(left, timeout=10)


def nodes_in_order(bundles: list[Bundle], per_node: int) -> list[Bundle]:
    """The bundles of one placement group in rank order: node by node (the nodes ordered by their lowest bundle
    index), by index within a node; all on one node (a local cluster: its "nodes" share one machine), by index.
    Raises ClusterResourceError when a node holds other than `per_node` of them (Ray packed them onto nodes partly
    taken by something else)."""
    nodes: dict[str, list[Bundle]] = {}
    for bundle in sorted(bundles, key=lambda b: b.index):
        nodes.setdefault(bundle.node_id, []).append(bundle)
    counts = {node: len(held) for node, held in nodes.items()}
    if len(nodes) > 1 and any(count != per_node for count in counts.values()):
        raise ClusterResourceError(
            f"a placement group of {len(bundles)} bundles landed as {sorted(counts.values())} "
            f"per node, not {per_node} on each: free whole nodes for it"
        )
    return [bundle for held in nodes.values() for bundle in held]


#: What a local Ray instance is started with (read by Ray from the environment of the process that starts it):
#: - usage statistics off, token authentication off (a local single-user instance needs none);
#: - RAY_worker_niceness=0: Ray's raylet starts its worker processes at nice 15 by default (ray_config_def.h
#:   `worker_niceness`), below its own daemons and mrl's controller. mrl's workers are the run's compute; at nice 15
#:   every wake-up of a nice-0 process preempts them, and an OpenMP thread so preempted stalls its whole parallel
#:   region. Measured on 2 cores, `benchmarks/grpo_step.py --modes sync`, runs taking turns: a step of 0.283-0.291 s
#:   at nice 0 against 0.323-0.340 s at nice 15 (docs/measurements.md).
LOCAL_RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", "RAY_worker_niceness": "0"}


class RayCluster:
    """Starts a local Ray instance (or joins a running cluster) and hands out placements.

    Locally: `ray.init(address="local")` with the given CPUs/GPUs, no dashboard, usage stats off, token auth off
    (on by default since Ray 2.60; a local single-user instance needs none) and the workers at the scheduler
    priority of the rest (`LOCAL_RAY_ENV`). With `address`, joins that cluster and leaves its settings alone. If Ray is
    already initialised in this process, reuses it and does not shut it down.
    """

    def __init__(
        self,
        *,
        address: Optional[str] = None,
        num_cpus: Optional[int] = None,
        num_gpus: Optional[int] = None,
        namespace: Optional[str] = None,
        log_to_driver: bool = True,
    ):
        self._placements: list[Placement] = []
        self._owns_ray = not ray.is_initialized()
        if not self._owns_ray:
            log.info("reusing the Ray instance already initialised in this process")
            return
        if address is None:
            for key, value in LOCAL_RAY_ENV.items():
                os.environ.setdefault(key, value)  # the shell's own value wins
            start_local_ray(
                address="local",
                num_cpus=num_cpus,
                num_gpus=num_gpus,
                include_dashboard=False,
                namespace=namespace,
                log_to_driver=log_to_driver,
                logging_level=logging.WARNING,  # not "Started a local Ray instance" on every command
            )
        else:
            ray.init(address=address, namespace=namespace, log_to_driver=log_to_driver, logging_level=logging.WARNING)

    @classmethod
    def from_config(cls, config: "ClusterConfig") -> "RayCluster":
        """Join `config.ray_address` (or $RAY_ADDRESS, which the Slurm launcher sets), or start a local instance
        sized for the configured workers."""
        address = config.ray_address or os.environ.get("RAY_ADDRESS")
        if address:
            return cls(address=address)
        workers = config.num_nodes * config.devices_per_node
        return cls(num_cpus=max(1, int(round(workers * config.cpus_per_worker))))

    # ------------------------------------------------------------------------------------------------ resources
    def total_resources(self) -> dict[str, float]:
        return {key: value for key, value in ray.cluster_resources().items() if key in ("CPU", "GPU")}

    def has_gpus(self) -> bool:
        """Whether the cluster's nodes report GPUs (Ray counts them at start, or is told `num_gpus`)."""
        return self.total_resources().get("GPU", 0.0) >= 1.0

    def available_resources(self) -> dict[str, float]:
        """Resources not reserved by placement groups or held by running actors/tasks."""
        return {key: value for key, value in ray.available_resources().items() if key in ("CPU", "GPU")}

    def _check_fits(self, name: str, bundle: dict[str, float], num_nodes: int, bundles_per_node: int) -> None:
        """Refuse requests the cluster can never satisfy, before Ray would wait on them forever."""
        per_node = {key: value * bundles_per_node for key, value in bundle.items()}
        nodes = [node["Resources"] for node in ray.nodes() if node["Alive"]]
        fitting = sum(all(res.get(key, 0.0) >= need for key, need in per_node.items()) for res in nodes)
        total = self.total_resources()
        wanted = {key: value * num_nodes for key, value in per_node.items()}
        short = any(total.get(key, 0.0) < need for key, need in wanted.items())
        if short or fitting < num_nodes:
            raise ClusterResourceError(
                f"placement '{name}' asks for {num_nodes} node(s) x {bundles_per_node} bundle(s) of "
                f"{_format_resources(bundle)} = {_format_resources(wanted)}, but the Ray cluster has "
                f"{_format_resources(total)} in total over {len(nodes)} node(s), of which {fitting} can hold "
                f"{_format_resources(per_node)}; lower the bundle count or size, or start Ray with more resources"
            )

    # ----------------------------------------------------------------------------------------------- placements
    def create_placement(
        self,
        name: str,
        *,
        bundles_per_node: int,
        num_nodes: int = 1,
        cpus_per_bundle: float = 1.0,
        gpus_per_bundle: float = 0.0,
        timeout_s: float = 60.0,
        one_group: bool = False,
    ) -> Placement:
        """Reserve `num_nodes` x `bundles_per_node` bundles and wait until Ray has placed them (a placement group per
        node, or with `one_group` a single one: module docstring).

        Raises ClusterResourceError, naming what is available, when the request can never fit or is still not
        placed after `timeout_s` (resources held by other placements or actors).
        """
        if bundles_per_node < 1 or num_nodes < 1:
            raise ValueError(f"placement '{name}': bundles_per_node and num_nodes must be >= 1")
        bundle: dict[str, float] = {"CPU": float(cpus_per_bundle)}
        if gpus_per_bundle:
            bundle["GPU"] = float(gpus_per_bundle)
        self._check_fits(name, bundle, num_nodes, bundles_per_node)
        if one_group:
            groups = [placement_group([dict(bundle)] * (bundles_per_node * num_nodes), strategy="PACK", name=name)]
        else:
            groups = [
                placement_group([dict(bundle)] * bundles_per_node, strategy="STRICT_PACK", name=f"{name}-node{node}")
                for node in range(num_nodes)
            ]
        ready, _ = ray.wait([group.ready() for group in groups], num_returns=len(groups), timeout=timeout_s)
        if len(ready) < len(groups):
            available = self.available_resources()
            for group in groups:
                remove_placement_group(group)
            raise ClusterResourceError(
                f"placement '{name}' ({num_nodes} node(s) x {bundles_per_node} x {_format_resources(bundle)}) was "
                f"not placed within {timeout_s:g} s; free now: {_format_resources(available)} of "
                f"{_format_resources(self.total_resources())}. Other placements or actors hold the rest: remove "
                "them or ask for less"
            )
        bundles = self._bundles_in_rank_order(groups, bundle)
        if one_group:
            try:
                bundles = nodes_in_order(bundles, bundles_per_node)
            except ClusterResourceError:
                remove_placement_group(groups[0])
                raise
        placement = Placement(name=name, bundles=bundles, groups=groups)
        self._placements.append(placement)
        return placement

    @staticmethod
    def _bundles_in_rank_order(groups: list[PlacementGroup], resources: dict[str, float]) -> list[Bundle]:
        addresses = _node_addresses()
        bundles = []
        for group in groups:
            node_of_bundle: dict[Any, str] = placement_group_table(group)["bundles_to_node_id"]
            for index in range(len(node_of_bundle)):
                node_id = node_of_bundle[index]
                bundles.append(Bundle(group, index, dict(resources), node_id, addresses.get(node_id, "")))
        return bundles

    def remove_placement(self, placement: Placement) -> None:
        """Release the placement's resources; Ray kills every actor still placed on it."""
        for group in placement.groups:
            try:
                remove_placement_group(group)
            except Exception as error:  # noqa: BLE001 already removed, or Ray is going down: nothing left to release
                log.debug("removing placement group of '%s': %s", placement.name, error)
        if placement in self._placements:
            self._placements.remove(placement)

    def shutdown(self) -> None:
        """Remove every placement this cluster created, then stop Ray if this object started it."""
        for placement in list(self._placements):
            self.remove_placement(placement)
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()

    def __enter__(self) -> "RayCluster":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()
