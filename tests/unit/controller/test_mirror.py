"""`RunMirror` (the driver's uploads of a run folder on an object store) and `check`'s probe of the store, against
a real S3-compatible server on 127.0.0.1 (`s3_server`)."""

import time

import pytest

from asyncrl.config import load_config
from asyncrl.controller.mirror import RunMirror
from asyncrl.controller.preflight import _storage, _usable, local_resources
from asyncrl.remote import Store


@pytest.fixture()
def cfg(s3_server, tmp_path, monkeypatch):
    monkeypatch.setenv("ASYNCRL_CACHE", str(tmp_path / "cache"))
    overrides = [f"storage.uri={s3_server.uri('mirror')}", f"storage.endpoint_url={s3_server.endpoint_url}",
                 f"output_dir=run-{tmp_path.name}", "storage.sync_every_s=0.2", "storage.request_timeout_s=5",
                 "storage.outage_timeout_s=60"]  # fmt: skip
    return load_config(None, overrides)


def _impatient(cfg):
    """`cfg` whose uploads give up after 1.5 s of outage (0.5 s per request)."""
    storage = cfg.storage.model_copy(update={"request_timeout_s": 0.5, "outage_timeout_s": 1.5})
    return cfg.model_copy(update={"storage": storage})


def test_the_mirror_uploads_what_changed_and_leaves_the_writers_files_to_them(cfg):
    out = cfg.run_dir()
    for name in ("metrics.jsonl", "bad_batches/step-000001.parquet", "checkpoints/step-000001/extra.json",
                 "final_model/config.json", "trajectories.parquet"):  # fmt: skip
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text("1\n")
    mirror = RunMirror(cfg, note=print, stop=print)
    assert mirror.upload_changed() == 2 and mirror.upload_changed() == 0
    (out / "metrics.jsonl").write_text("1\n2\n")
    assert mirror.upload_changed() == 1
    store = Store(cfg.storage.endpoint_url)
    assert store.listdir(cfg.run_uri()) == ["bad_batches", "metrics.jsonl"]
    assert store.read_text(cfg.run_uri() + "/metrics.jsonl") == "1\n2\n"


def test_an_outage_longer_than_the_timeout_asks_the_run_to_stop_and_the_end_uploads_what_waited(cfg, s3_server):
    out = cfg.run_dir()
    out.mkdir(parents=True)
    notes, stops = [], []
    mirror = RunMirror(_impatient(cfg), note=notes.append, stop=stops.append)
    s3_server.pause()
    try:
        (out / "metrics.jsonl").write_text('{"step": 1}\n')
        mirror.start()
        deadline = time.monotonic() + 20
        while not stops and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        s3_server.resume()
    assert len(stops) == 1 and stops[0].startswith(f"storage: upload {cfg.run_uri()}/metrics.jsonl failed for ")
    assert stops[0].endswith(f"the run's files are kept in {out}")
    assert notes and all(n.startswith(f"storage: upload {cfg.run_uri()}/metrics.jsonl failed (") for n in notes)
    mirror.store = cfg.storage.store()  # patient again, for a loaded machine
    mirror.finish()  # the store is back: what waited is uploaded
    assert Store(cfg.storage.endpoint_url).read_text(cfg.run_uri() + "/metrics.jsonl") == '{"step": 1}\n'


def test_check_probes_the_store_from_this_machine_and_names_why_it_cannot_write(s3_server, cfg):
    assert _storage(cfg, local_resources()) == []
    nobody = cfg.model_copy(update={"storage": cfg.storage.model_copy(update={"endpoint_url": "http://127.0.0.1:9"})})
    (problem,) = _storage(nobody, local_resources())
    assert problem.key == "storage.uri" and problem.reason.startswith(f"{cfg.run_uri()} cannot be written: ")


def test_each_node_answers_one_verdict_per_path(cfg, tmp_path):
    """What `check --address` runs on every node: a remote store probed, a local folder checked, in order."""
    store = cfg.storage.store()
    paths = {"model.path": str(tmp_path), "storage.uri": cfg.run_uri(), "learner.reference_path": str(tmp_path / "no")}
    assert _usable(paths, store) == [True, True, False]
