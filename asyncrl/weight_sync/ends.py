"""What a transport needs of its two ends: the learner that publishes and the rollout pool whose engines load.

Structural types (`typing.Protocol`): `LearnerPool` and `RolloutPool` satisfy them without importing this
module, and a transport's unit test passes small fakes. Keeping the transports typed against these rather
than the pool classes keeps `weight_sync` above both pools without importing either.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from asyncrl.weights.adapter import AdapterWeights
from asyncrl.weights.group import CollectiveWeights
from asyncrl.weights.published import ExportedWeights
from asyncrl.weights.segment import SharedWeights

__all__ = ["ExportCall", "WeightLoaders", "WeightPublisher"]


class ExportCall(Protocol):
    """An export started on every learner rank and not yet waited for (`LearnerPool.start_export_shared`)."""

    @property
    def refs(self) -> list[Any]:
        """One object ref per rank, in rank order; `refs[0]` resolves to rank 0's record."""
        ...


class WeightPublisher(Protocol):
    """The learner's side (`LearnerPool`): exports its current weights in each transport's form."""

    def export_weights(self, bucket_bytes: int) -> ExportedWeights:
        """Safetensors buckets of `bucket_bytes` at most, put in the object store."""
        ...

    def export_delta(self, version: int, bucket_bytes: int, full: bool = False) -> ExportedWeights:
        """What changed since the last `export_delta` (`weights.delta` payloads), in the object store."""
        ...

    def export_delta_base(self, version: int, bucket_bytes: int) -> ExportedWeights:
        """`version`, the last `export_delta`, in full (`weights.delta` payload), in the object store."""
        ...

    def export_shared(self, root: str, version: int) -> SharedWeights:
        """The weights copied into the shared-memory slot of `version` under `root`."""
        ...

    def start_export_shared(self, root: str, version: int) -> ExportCall:
        """`export_shared` without the wait."""
        ...

    def export_collective(self, version: int, loopback: bool, bucket_bytes: int, timeout_s: float) -> CollectiveWeights:
        """The weights staged on rank 0, for engines to pull over their own process group."""
        ...

    def start_export_collective(self, version: int, loopback: bool, bucket_bytes: int, timeout_s: float) -> ExportCall:
        """`export_collective` without the wait."""
        ...

    def export_adapter(self) -> AdapterWeights:
        """The policy's LoRA adapters (`learner.lora`), gathered on rank 0."""
        ...

    def finish_call(self, call: Any) -> list[Any]:
        """Every rank's result of a call this learner started without waiting (an `ExportCall`); raises naming
        a failed rank."""
        ...


class WeightLoaders(Protocol):
    """The rollout side (`RolloutPool`): starts every engine loading a version and waits for their word."""

    def start_update(self, buckets: Sequence[Any], version: int, in_flight: bool = True) -> dict[Any, str]:
        """Start every engine loading `buckets` as `version`; -> its load calls (object ref -> engine name)."""
        ...

    def finish_update(self, calls: dict[Any, str], version: int, timeout_s: float) -> float | None:
        """Wait until every engine of `calls` serves `version`; -> when the last began serving it (None: no
        engine took part). Raises naming each engine that failed or did not confirm within `timeout_s`."""
        ...
