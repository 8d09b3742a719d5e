"""Placement bundles and the error of a pool that cannot be placed: numbers checkable by hand."""

from __future__ import annotations

from asyncrl.cluster.placement import Capacity, bundle, shortage


def test_a_bundle_leaves_out_zero_amounts_and_carries_custom_resources():
    assert bundle(1, 0) == {"CPU": 1.0}
    assert bundle(2, 1, {"node2": 1}) == {"CPU": 2.0, "GPU": 1.0, "node2": 1.0}


def test_a_resource_no_node_has_is_named_with_what_the_pool_needs():
    bundles = [bundle(1, 0, {"node2": 1})] * 2
    message = shortage("rollout", bundles, 60, Capacity(free={"CPU": 3.0}, total={"CPU": 8.0}))
    assert message == (
        "rollout pool: 2 bundles of {CPU: 1, node2: 1} not placeable within 60 s; needs CPU 2, node2 2; "
        "cluster has CPU 3 free of 8, node2 0 free of 0 (no node has enough node2)"
    )


def test_resources_held_by_others_are_told_apart_from_missing_ones():
    message = shortage("learner", [bundle(1, 1)] * 2, 5, Capacity(free={"CPU": 4.0, "GPU": 1.0}, total={"CPU": 4.0, "GPU": 2.0}))
    assert message.endswith("needs CPU 2, GPU 2; cluster has CPU 4 free of 4, GPU 1 free of 2 (held by other pools or jobs)")


def test_bundles_of_different_shapes_are_counted_apart():
    message = shortage("tools", [bundle(1, 0), bundle(2, 0), bundle(1, 0)], 1, Capacity({}, {}))
    assert message.startswith("tools pool: 2 bundles of {CPU: 1}; 1 bundles of {CPU: 2} not placeable within 1 s; needs CPU 4")
