"""Entry point of a run: resolve the model, build the pools, run the mode's loop, write summary.json."""

from __future__ import annotations

import contextlib
import faulthandler
import importlib
import json
import os
import signal
import threading

from asyncrl.config import Config
from asyncrl.telemetry.sinks import Telemetry

STOP_STACKS_AFTER_S = 180.0
"""After a stop request, a run still going this much later prints every thread's stack to stderr."""


def run(cfg: Config) -> dict:
    """Run one job end to end and return (and write) its summary.

    The telemetry sinks start first, so that every start-up phase (model build or warm start, Ray, queue,
    learner, engines) is shown as it happens; a run that fails closes them with `{"error": ...}`.

    SIGTERM or Ctrl-C (what a job scheduler and a user send) asks the loop to stop at the next step boundary
    (it checks at least every few seconds): it then writes a checkpoint to resume from and its summary, and
    the Ray processes this run started are stopped. A second signal stops at once (still cleaning up).
    """
    from asyncrl.controller.loop import build_telemetry

    out = cfg.run_dir()
    cfg.save(out)
    telemetry = build_telemetry(cfg)
    telemetry.phase(f"config: {cfg.mode} mode, {cfg.learner.max_steps} steps, output in {out}")
    try:
        summary = _run(cfg, telemetry)
    except BaseException as e:
        telemetry.close({"error": f"{type(e).__name__}: {e}"})
        cfg.seal_run_dir()
        raise
    telemetry.close(summary)
    cfg.seal_run_dir()  # the last files written (the event log's end) get `storage.mode` too
    return summary


def _run(cfg: Config, telemetry: Telemetry) -> dict:
    from asyncrl.controller.loop import Controller
    from asyncrl.envs.model_dir import ensure_model

    telemetry.phase("resolving the model")
    model_dir = ensure_model(cfg, report=telemetry.phase)
    telemetry.phase(
        f"connecting to Ray at {os.environ['RAY_ADDRESS']}" if os.environ.get("RAY_ADDRESS") else "starting a local Ray"
    )
    with _importing(Controller.START_IMPORTS):
        started_ray = _init_ray(cfg)
    controller = Controller(cfg, model_dir, telemetry)
    try:
        with _stop_requests(controller):
            try:
                controller.start()
                summary = controller.run()
                # Before the pools' shutdown: a part that fails to stop loses the run none of its results.
                (cfg.run_dir() / "summary.json").write_text(json.dumps(summary, indent=2))
            finally:
                controller.shutdown()
    finally:
        if started_ray:
            import ray

            ray.shutdown()
    return summary


@contextlib.contextmanager
def _stop_requests(controller):
    """First SIGTERM/SIGINT: `controller.request_stop`; the second raises KeyboardInterrupt."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread (e.g. a run inside a test thread)
        return

    def handler(signum, _frame):
        if controller.stop_requested:
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}")
        controller.request_stop(f"{signal.Signals(signum).name} received")
        # A stop takes a step, a checkpoint and the pools' shutdown: if the run is still here much later,
        # every thread's stack goes to stderr (the job's log), naming what it waits for.
        faulthandler.dump_traceback_later(STOP_STACKS_AFTER_S)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
        for sig, old in previous.items():
            signal.signal(sig, old)


@contextlib.contextmanager
def _importing(names: tuple[tuple[str, str], ...]):
    """Import each (module, name) in a thread while the body runs (transformers loads a name's module on first
    access). A name that fails to import here fails again, with its own error, where it is used."""

    def load() -> None:
        for module, name in names:
            with contextlib.suppress(Exception):
                getattr(importlib.import_module(module), name)

    thread = threading.Thread(target=load, name="asyncrl-imports", daemon=True)
    thread.start()
    try:
        yield
    finally:
        thread.join()


def _init_ray(cfg: Config) -> bool:
    """Connect to RAY_ADDRESS or start a local Ray; -> whether this call started (or joined) Ray itself."""
    import ray

    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=True)
        return True
    # Locally, Ray's CPU count is a scheduling label, not a thread limit: ask for what the pools need.
    need = (
        cfg.rollout.num_workers * cfg.rollout.num_cpus_per_worker
        + cfg.learner.num_ranks * cfg.learner.num_cpus_per_rank
    )
    ray.init(num_cpus=max(int(need) + 2, os.cpu_count() or 1), include_dashboard=False, log_to_driver=False)
    return True
