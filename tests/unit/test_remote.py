"""`asyncrl.remote` against a real S3-compatible server on 127.0.0.1 (`s3_server`: moto's standalone server in its
own process): uploads and downloads keep relative paths, an outage (the server stopped with SIGSTOP) is retried and
logged naming the operation and the URI, and one longer than `outage_timeout_s` fails loudly."""

import threading
import time

import pytest

from asyncrl.config import load_config
from asyncrl.remote import StorageError, Store, join, staging


@pytest.fixture()
def store(s3_server):
    return Store(s3_server.endpoint_url, request_timeout_s=0.5, outage_timeout_s=30)


def test_a_folder_goes_up_and_comes_back_with_its_relative_paths(s3_server, store, tmp_path):
    (tmp_path / "up" / "sub").mkdir(parents=True)
    (tmp_path / "up" / "a.txt").write_text("alpha")
    (tmp_path / "up" / "sub" / "b.bin").write_bytes(b"\0" * 1000)
    uri = s3_server.uri("round-trip")
    assert store.upload(tmp_path / "up", uri) == 1005
    assert store.listdir(uri) == ["a.txt", "sub"]
    assert store.read_text(join(uri, "a.txt")) == "alpha"
    back = store.download(uri, tmp_path / "down")
    assert sorted(str(p.relative_to(back)) for p in back.rglob("*") if p.is_file()) == ["a.txt", "sub/b.bin"]
    assert (back / "sub" / "b.bin").read_bytes() == b"\0" * 1000
    assert store.exists(join(uri, "a.txt")) and not store.exists(join(uri, "missing.txt"))
    store.remove(uri)
    assert store.listdir(uri) == []
    with pytest.raises(FileNotFoundError):
        store.read_text(join(uri, "a.txt"))  # not retried: a missing object is an answer


def test_an_outage_is_retried_with_backoff_logged_and_loses_nothing(s3_server, store, tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    uri = s3_server.uri("outage", "metrics.jsonl")
    tries: list[str] = []
    s3_server.pause()
    threading.Timer(3.0, s3_server.resume).start()
    began = time.monotonic()
    try:
        store.upload(tmp_path / "metrics.jsonl", uri, on_retry=tries.append)
    finally:
        s3_server.resume()
    assert time.monotonic() - began >= 3.0  # it waited for the server rather than giving up
    assert len(tries) >= 2 and all(t.startswith(f"storage: upload {uri} failed (") for t in tries), tries
    assert "retrying in 0.5 s" in tries[0] and "retrying in 1 s" in tries[1]  # the backoff doubles
    assert store.read_text(uri) == '{"step": 1}\n'


def test_an_outage_longer_than_the_timeout_fails_naming_the_operation_and_uri(s3_server, tmp_path):
    store = Store(s3_server.endpoint_url, request_timeout_s=0.5, outage_timeout_s=2)
    uri = s3_server.uri("too-long", "x.json")
    s3_server.pause()
    try:
        with pytest.raises(StorageError) as error:
            store.write_text(uri, "{}")
    finally:
        s3_server.resume()
    assert str(error.value).startswith(f"storage: write {uri} failed for ")
    assert "(storage.outage_timeout_s = 2)" in str(error.value)


def test_check_probes_writing_the_store_and_names_what_fails(s3_server, store):
    assert store.probe(s3_server.uri("probe")) is None
    assert store.listdir(s3_server.uri("probe")) == []  # the probe object was deleted
    assert store.probe("s3://no-such-bucket/run") is not None  # a bucket that does not exist cannot be written


def test_the_run_folder_on_an_object_store_is_staged_under_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("ASYNCRL_CACHE", str(tmp_path))
    cfg = load_config(None, ["storage.uri=s3://bucket/team", "output_dir=runs/a", "storage.endpoint_url=http://h:9"])
    assert cfg.run_uri() == "s3://bucket/team/runs/a"
    assert cfg.run_dir() == staging("s3://bucket/team/runs/a") == tmp_path / "storage" / "s3" / "bucket/team/runs/a"
    assert load_config(None, ["storage.uri=gs://bucket"]).run_uri() == "gs://bucket/runs/default"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("storage.uri=s3://KEY:SECRET@bucket/x", "storage.uri: no credentials in the URI"),
        ("storage.uri=hdfs://name/x", "a path, file://, s3:// or gs:// URI is supported, not hdfs://"),
        ("storage.endpoint_url=ftp://h", "storage.endpoint_url 'ftp://h': an http:// or https:// address"),
        ("storage.uri=s3://", "names no bucket"),
    ],
)
def test_bad_storage_settings_are_refused_naming_the_key(override, message):
    with pytest.raises(ValueError, match="invalid config") as error:
        load_config(None, [override])
    assert message in str(error.value)
