"""Placement groups per pool: the rollout, learner and tools pools each reserve their own resources.

A pool's actors are scheduled into bundles reserved for that pool alone, so scaling one pool never takes what
another holds: the learner reserves its ranks' bundles first; each rollout worker gets a one-bundle group of
its own (a scale-up adds groups, a scale-down removes them); tool workers reserve theirs with `reserve`.
A reservation that cannot be placed within its timeout fails with a message naming the pool, what its
bundles ask for and what the cluster has free (`PlacementError`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

Bundle = dict[str, float]

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


class PlacementError(RuntimeError):
    """A pool's placement group was not placed in time; the message names the pool and what it is short of."""


def bundle(cpus: float, gpus: float, resources: Mapping[str, float] | None = None) -> Bundle:
    """One actor's reservation: CPU, GPU (left out when 0: Ray rejects zero entries) and custom resources."""
    out = {"CPU": float(cpus), "GPU": float(gpus), **{k: float(v) for k, v in (resources or {}).items()}}
    return {k: v for k, v in out.items() if v > 0}


@dataclass(frozen=True)
class Capacity:
    """What the cluster has of each resource: free now and in all (alive nodes)."""

    free: Mapping[str, float]
    total: Mapping[str, float]


def shortage(pool: str, bundles: Sequence[Bundle], timeout_s: float, capacity: Capacity) -> str:
    """The error text of a reservation that timed out, e.g. `rollout pool: 2 bundles of {CPU: 1, node2: 1}
    not placeable within 60 s; needs CPU 2, node2 2; cluster has CPU 3 free of 8, node2 0 free of 0`."""
    shapes = sorted({_shape(b) for b in bundles})
    what = "; ".join(f"{sum(_shape(b) == s for b in bundles)} bundles of {s}" for s in shapes)
    need = {k: sum(b.get(k, 0.0) for b in bundles) for k in sorted({k for b in bundles for k in b})}
    has = ", ".join(f"{k} {capacity.free.get(k, 0.0):g} free of {capacity.total.get(k, 0.0):g}" for k in need)
    short = [k for k, v in need.items() if v > capacity.total.get(k, 0.0)]
    hint = f" (no node has enough {', '.join(short)})" if short else " (held by other pools or jobs)"
    needs = ", ".join(f"{k} {v:g}" for k, v in need.items())
    return f"{pool} pool: {what} not placeable within {timeout_s:g} s; needs {needs}; cluster has {has}{hint}"


def _shape(b: Bundle) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in b.items()) + "}"


def capacity() -> Capacity:
    import ray

    return Capacity(ray.available_resources(), ray.cluster_resources())


def start(pool: str, bundles: Sequence[Bundle], strategy: str = "PACK") -> Any:
    """Ask Ray for the pool's placement group without waiting (`ready(pg)` says when it is placed)."""
    from ray.util.placement_group import placement_group

    if strategy not in STRATEGIES:
        raise ValueError(f"{pool} pool: unknown placement strategy {strategy!r}; valid: {', '.join(STRATEGIES)}")
    return placement_group(list(bundles), strategy=strategy)


def reserve(pool: str, bundles: Sequence[Bundle], strategy: str = "PACK", timeout_s: float = 300.0) -> Any:
    """Reserve `bundles` for `pool` and wait until they are placed -> the PlacementGroup. Raises
    PlacementError (naming the pool and the shortage) after `timeout_s`; nothing stays reserved then."""
    import ray

    pg = start(pool, bundles, strategy)
    if not ray.wait([pg.ready()], timeout=timeout_s)[0]:
        message = shortage(pool, bundles, timeout_s, capacity())
        release(pg)
        raise PlacementError(message)
    return pg


def release(pg: Any) -> None:
    """Give a pool's reservation back (its actors are gone or about to be killed)."""
    from ray.util.placement_group import remove_placement_group

    remove_placement_group(pg)


def in_bundle(pg: Any, index: int) -> Any:
    """The scheduling strategy that puts an actor into bundle `index` of `pg`."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index)


def request_capacity(bundles: Sequence[Bundle]) -> None:
    """Ask Ray's autoscaler to keep room for `bundles` (a floor it adds nodes for; replaces the last request)."""
    from ray.autoscaler.sdk import request_resources

    request_resources(bundles=[dict(b) for b in bundles])
