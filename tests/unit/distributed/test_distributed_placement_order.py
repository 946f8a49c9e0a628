"""`nodes_in_order`: the bundles of one placement group across nodes (`RayCluster.create_placement(one_group=True)`,
for a vLLM engine whose pipeline stages sit on several nodes) put in rank order node by node, whatever order Ray
numbered them in; a node holding other than its share refused; one machine holding them all (a local cluster) kept
in index order."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from mrl.distributed.cluster import Bundle, nodes_in_order
from mrl.distributed.errors import ClusterResourceError


@dataclass(frozen=True)
class _Group:
    id: str = "one"


def _bundles(nodes: list[str]) -> list[Bundle]:
    """Bundle i of the group on node nodes[i], as Ray reports them (in index order)."""
    return [Bundle(_Group(), i, {"GPU": 1.0}, node, "") for i, node in enumerate(nodes)]


def test_bundles_go_node_by_node_nodes_in_the_order_of_their_first_bundle():
    ordered = nodes_in_order(_bundles(["b", "a", "b", "a", "c", "c"]), per_node=2)
    assert [(b.node_id, b.index) for b in ordered] == [("b", 0), ("b", 2), ("a", 1), ("a", 3), ("c", 4), ("c", 5)]
    assert nodes_in_order(_bundles(["a", "a", "b", "b"]), per_node=2) == _bundles(["a", "a", "b", "b"])


def test_a_node_with_more_or_fewer_bundles_than_its_share_is_refused():
    with pytest.raises(ClusterResourceError, match=r"landed as \[1, 3\] per node, not 2 on each"):
        nodes_in_order(_bundles(["a", "a", "a", "b"]), per_node=2)


def test_one_machine_holding_every_bundle_keeps_them_in_index_order():
    assert nodes_in_order(list(reversed(_bundles(["a"] * 4))), per_node=2) == _bundles(["a"] * 4)
