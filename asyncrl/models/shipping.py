"""Shipping a preset model from the driver's cache to actors on other nodes.

A preset is built in the driver's `~/.cache/asyncrl`; an actor on another node (or with another HOME) cannot
read that path. The driver packs the folder once into a small tar in the object store (`ship`); an actor
whose node-local cache lacks it unpacks it there, keyed by the archive's content hash (`materialise`), so a
node unpacks each model once however many actors it hosts. A user's `model.path` folder is not shipped: it must
be readable on every node (`asyncrl check --address` verifies it). A `model.path` on an object store (`s3://`,
`gs://`) is fetched once per node into `<cache>/shipped/<name>-<digest of the URI>` (`fetch`): by the driver,
then by an actor on a node whose cache lacks it.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.cluster.calls import named_get
from asyncrl.models import cache_root, file_lock
from asyncrl.remote import Store, join

SOURCE_FILE = ".asyncrl_source.json"
"""In a fetched model's folder: the URI it came from and the store's endpoint (no credentials)."""


@dataclass(frozen=True)
class ShippedModel:
    """A preset model in transit: where the driver has it, its content hash and the archive's object ref."""

    source: str
    """The driver's folder (used as is on a node that shares the driver's cache)."""
    digest: str
    """sha256 of the archive (hex, 16 characters): the node-local folder's key."""
    archive: Any
    """ray.ObjectRef of the tar bytes (None for a model fetched from `uri`)."""
    uri: str | None = None
    """The object-store folder each node fetches the model from (`fetch`), instead of the archive."""
    store: Store | None = None

    @property
    def folder_name(self) -> str:
        return Path(self.source).name if self.uri else f"{Path(self.source).name}-{self.digest}"


def fetched_folder(uri: str) -> Path:
    """Where `fetch` keeps the model folder `uri` on this node."""
    digest = hashlib.sha256(uri.rstrip("/").encode()).hexdigest()[:16]
    return cache_root() / "shipped" / f"{uri.rstrip('/').rsplit('/', 1)[-1]}-{digest}"


def fetch(uri: str, store: Store) -> Path:
    """The model folder `uri` (on an object store) in this node's cache, downloaded the first time (one process
    per node downloads; the others wait for it)."""
    target = fetched_folder(uri)
    with file_lock(target.with_name(target.name + ".lock")):
        if not (target / SOURCE_FILE).is_file():
            if not store.exists(join(uri, "config.json")):
                raise FileNotFoundError(f"model.path {uri} has no config.json (not a Hugging Face model folder)")
            store.download(uri, target)
            (target / SOURCE_FILE).write_text(json.dumps({"uri": uri, "endpoint_url": store.endpoint_url}))
    return target


_shipped: dict[tuple[str, str, str], ShippedModel] = {}
"""One archive per model folder, Ray session and job (both pools ship the same model). Job ids restart in each
session, so a process that starts a second Ray session must not get the first one's (dead) object ref."""
_FETCH_TIMEOUT_S = 300.0
"""Longest wait for the archive from the object store (a few MB; it is only slow if its owner, the driver, is gone)."""


def pack(folder: str | Path) -> bytes:
    """A tar of `folder`'s files with fixed names, order, times and owners: equal folders give equal bytes."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for path in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
            info = tarfile.TarInfo(str(path.relative_to(folder)))
            info.size, info.mode = path.stat().st_size, 0o644
            tar.addfile(info, io.BytesIO(path.read_bytes()))
    return buffer.getvalue()


def ship(model_dir: str | os.PathLike[str]) -> ShippedModel | None:
    """Put a preset from the driver's cache into the object store (once per Ray job); None for any other
    folder (the user's `model.path`, read in place on every node)."""
    import ray

    folder = Path(model_dir).resolve()
    if cache_root().resolve() not in folder.parents:
        return None
    if (folder / SOURCE_FILE).is_file():  # fetched from an object store: each node fetches it there too
        source = json.loads((folder / SOURCE_FILE).read_text())
        return ShippedModel(str(folder), folder.name, None, source["uri"], Store(source["endpoint_url"]))
    context = ray.get_runtime_context()
    key = (str(folder), context.get_session_name(), context.get_job_id())
    if key not in _shipped:
        data = pack(folder)
        _shipped[key] = ShippedModel(str(folder), hashlib.sha256(data).hexdigest()[:16], ray.put(data))
    return _shipped[key]


def materialise(model: ShippedModel) -> Path:
    """The model's folder on this node: the driver's own when this node shares its cache, else
    `<this node's cache>/shipped/<name>-<digest>`, unpacked from the archive the first time."""
    if Path(cache_root()).resolve() in Path(model.source).parents and (Path(model.source) / "config.json").is_file():
        return Path(model.source)
    if model.uri is not None:
        return fetch(model.uri, model.store or Store())
    target = cache_root() / "shipped" / model.folder_name
    with file_lock(target.with_name(target.name + ".lock")):
        if not (target / "config.json").is_file():
            unpack(
                named_get(
                    model.archive, _FETCH_TIMEOUT_S, f"model archive {model.folder_name} from the driver's object store"
                ),
                target,
            )
    return target


def unpack(data: bytes, target: Path) -> Path:
    """Unpack a `pack` archive into `target`, which appears whole or not at all (renamed into place)."""
    tmp = target.with_name(target.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)  # left by an actor killed mid-unpack
    with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
        tar.extractall(tmp, filter="data")
    tmp.rename(target)
    return target
