"""The records of one published policy version: what the learner exports and what the engines are handed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ExportedWeights", "PublishedWeights"]


@dataclass(frozen=True)
class ExportedWeights:
    """Buckets of one export, put in the Ray object store by learner rank 0."""

    refs: list[Any]  # ray.ObjectRef of safetensors bytes, one per bucket
    num_bytes: int
    num_tensors: int


@dataclass(frozen=True)
class PublishedWeights:
    """The weights of one published policy version, in the form the transport's engines load."""

    version: int
    refs: list[Any]
    """Bucket payloads: object refs of safetensors bytes, or the bytes (`asyncrl.weights.buckets`); or one
    record of a staged version (`segment.SharedWeights`, `group.CollectiveWeights`)."""
    num_bytes: int
    num_tensors: int

    @property
    def num_buckets(self) -> int:
        return len(self.refs)
