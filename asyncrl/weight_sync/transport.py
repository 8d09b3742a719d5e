"""Which weight-sync transport a run uses (`weight_sync.transport`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from asyncrl.config import Mode, WeightSyncConfig
    from asyncrl.weight_sync.base import WeightSync
    from asyncrl.weight_sync.ends import WeightLoaders, WeightPublisher

__all__ = ["make_weight_sync", "resolve_transport"]

Transport = Literal["object_store", "shared_memory", "collective"]


def resolve_transport(choice: str, num_nodes: int) -> Transport:
    """`auto` is shared memory on a single-node cluster: there every engine, a replacement included, runs on
    the learner's node; with more nodes an engine may land on another one, which cannot map the segment.
    `collective` is only ever chosen explicitly (docs/operations.md, "Weight sync")."""
    if choice == "auto":
        return "shared_memory" if num_nodes == 1 else "object_store"
    if choice not in ("object_store", "shared_memory", "collective"):
        raise ValueError(f"unknown weight_sync.transport {choice!r}")
    return choice  # type: ignore[return-value]


def make_weight_sync(
    learner: WeightPublisher, rollout: WeightLoaders, config: WeightSyncConfig, mode: Mode, adapter: bool = False
) -> WeightSync:
    """The run's transport; `adapter` (`learner.lora`): only the adapters travel (`AdapterSync`), whatever
    `config.transport`."""
    import ray

    from asyncrl.weight_sync.adapter import AdapterSync
    from asyncrl.weight_sync.collective import CollectiveSync
    from asyncrl.weight_sync.delta import DeltaSync
    from asyncrl.weight_sync.object_store import ObjectStoreSync
    from asyncrl.weight_sync.shared_memory import SharedMemorySync

    if adapter:
        return AdapterSync(learner, rollout, config, mode)
    if config.delta:  # through the object store (`WeightSyncConfig` refuses another transport)
        return DeltaSync(learner, rollout, config, mode)
    num_nodes = sum(1 for node in ray.nodes() if node.get("Alive"))
    transport = resolve_transport(config.transport, num_nodes)
    if transport == "collective":
        return CollectiveSync(learner, rollout, config, mode, loopback=num_nodes == 1)
    return (SharedMemorySync if transport == "shared_memory" else ObjectStoreSync)(learner, rollout, config, mode)
