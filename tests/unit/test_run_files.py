"""A run's files are private by default (`storage.mode`) and hold no secret (`asyncrl.redaction`): config.yaml,
config.json and events.jsonl redact secret-named keys and the environment's secret values."""

from __future__ import annotations

import json
import os
import stat

import pytest
import yaml

from asyncrl.config import load_config
from asyncrl.redaction import REDACTED, is_secret_name, redact, scrub
from asyncrl.telemetry.record import EventLog, Record


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.parametrize(
    "name, secret",
    [
        ("openai_api_key", True), ("dashboard_token", True), ("WANDB_API_KEY", True), ("HF_TOKEN", True),
        ("password", True), ("client-secret", True), ("apiKey", True), ("max_tokens", False),
        ("tokenizer", False), ("keep_last", False), ("monkey", False), ("token_budget", True),
    ],
)  # fmt: skip
def test_secret_names_are_told_by_their_words(name, secret):
    assert is_secret_name(name) is secret


def test_redact_replaces_secret_strings_at_any_depth_and_keeps_unset_ones():
    value = {"rollout": {"openai_api_key": "sk-123", "max_tokens": 8}, "x": [{"token": "t0ps3cret"}], "api_key": None}
    assert redact(value) == {"rollout": {"openai_api_key": REDACTED, "max_tokens": 8}, "x": [{"token": REDACTED}], "api_key": None}


def test_scrub_removes_the_environments_secret_values_from_text(monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "w4ndb-s3cret-value")
    monkeypatch.setenv("ASYNCRL_SHORT_TOKEN", "abc")  # too short to search for in text
    assert scrub("login w4ndb-s3cret-value ok abc") == f"login {REDACTED} ok abc"


def _config(tmp_path, *overrides):
    return load_config(None, [f"output_dir={json.dumps(str(tmp_path / 'runs' / 'r1'))}", *overrides])


def test_the_run_folder_is_private_from_its_creation_and_its_files_after_sealing(tmp_path):
    previous = os.umask(0o022)  # a usual umask: world-readable unless the run says otherwise
    try:
        cfg = _config(tmp_path)
        cfg.save(cfg.run_dir())
        log = EventLog(cfg.make_run_dir())
        log.record(Record("phase", {"text": "started"}))
        (cfg.run_dir() / "checkpoints" / "step-1").mkdir(parents=True)  # as another process (a learner rank) writes it
        (cfg.run_dir() / "checkpoints" / "step-1" / "model.safetensors").write_bytes(b"w")
        (cfg.run_dir() / "trajectories.parquet").write_bytes(b"PAR1")
        assert _mode(cfg.run_dir()) == 0o700  # before anything else: nothing inside is reachable by others
        assert _mode(cfg.run_dir() / "config.yaml") == 0o600
        cfg.seal_run_dir()
    finally:
        os.umask(previous)
    modes = {str(p.relative_to(cfg.run_dir())): _mode(p) for p in cfg.run_dir().rglob("*")}
    assert modes == {
        "config.yaml": 0o600, "config.json": 0o600, "events.jsonl": 0o600, "trajectories.parquet": 0o600,
        "checkpoints": 0o700, "checkpoints/step-1": 0o700, "checkpoints/step-1/model.safetensors": 0o600,
    }  # fmt: skip


def test_storage_mode_relaxes_to_group_or_world_and_refuses_others(tmp_path):
    cfg = _config(tmp_path, "storage.mode=group")
    cfg.save(cfg.run_dir())
    cfg.seal_run_dir()
    assert (_mode(cfg.run_dir()), _mode(cfg.run_dir() / "config.yaml")) == (0o750, 0o640)
    with pytest.raises(Exception, match="storage.mode"):
        _config(tmp_path, "storage.mode=everyone")


def test_config_files_and_events_hold_no_secret(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_s3cret_from_the_environment")
    cfg = _config(tmp_path)
    full = cfg.dump()
    full["rollout"]["openai_api_key"] = "sk-live-9876543210"  # a secret-named key, as another section may add
    monkeypatch.setattr(type(cfg), "dump", lambda self: full)
    cfg.save(cfg.run_dir())
    assert yaml.safe_load((cfg.run_dir() / "config.yaml").read_text())["rollout"]["openai_api_key"] == REDACTED
    log = EventLog(cfg.run_dir())
    log.record(Record("note", {"text": "using token hf_s3cret_from_the_environment", "api_key": "sk-live-0123456789"}))
    written = "".join(p.read_text() for p in cfg.run_dir().iterdir())
    assert "hf_s3cret" not in written and "sk-live" not in written
    event = json.loads((cfg.run_dir() / "events.jsonl").read_text())
    assert event["data"] == {"text": f"using token {REDACTED}", "api_key": REDACTED}
    assert yaml.safe_load((cfg.run_dir() / "config.yaml").read_text())["storage"]["mode"] == "private"


def test_the_progress_log_holds_no_secret_value_of_the_environment(monkeypatch):
    import io

    from asyncrl.telemetry.progress import Progress

    monkeypatch.setenv("OPENAI_API_KEY", "sk-proj-abcdef123456")
    stream = io.StringIO()
    Progress(enabled=True, stream=stream, live=False).phase("connecting with sk-proj-abcdef123456")
    assert "sk-proj" not in stream.getvalue() and f"connecting with {REDACTED}" in stream.getvalue()
