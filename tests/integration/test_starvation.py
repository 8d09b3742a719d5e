"""A run whose reward is always 0 under the default zero-variance filter: a real replay-queue actor, the controller's
batch wait, and a producer standing in for the rollout pool. The learner is told live that it is starved and
why, and the wait ends in a `StarvedError` naming the filter, not in the queue's timeout."""

import itertools
import json
import threading

import pytest

from asyncrl.buffer import StarvedError, start_replay_queue
from asyncrl.config import load_config
from asyncrl.testing import make_answer, make_prompt
from tests.sinks import RecordingSink

pytestmark = pytest.mark.integration


def never_solved(*_: object) -> float:
    """The reward of a model that never solves a prompt."""
    return 0.0


def _produce(handle, stop: threading.Event) -> None:
    """Answer every request at once, each with reward 0, until `stop`."""
    import ray

    while not stop.is_set():
        requests = ray.get(handle.acquire.remote("w0", 32, timeout_s=0.2))
        if requests:
            answers = [make_answer(r, 3, worker="w0", reward=never_solved(r)) for r in requests]
            ray.get(handle.put.remote(answers))


def test_a_reward_that_is_always_zero_stops_the_run_naming_the_zero_variance_filter(ray_cluster, tmp_path):
    from asyncrl.controller.loop import Controller

    overrides = {
        "output_dir": str(tmp_path), "telemetry.progress": False, "telemetry.dashboard_port": 0,
        "learner.prompts_per_step": 2, "rollout.samples_per_prompt": 2, "rollout.request_timeout_s": 3.0,
    }  # fmt: skip
    cfg = load_config(None, [f"{k}={json.dumps(v)}" for k, v in overrides.items()])
    assert cfg.buffer.filter_zero_variance  # the default
    controller = Controller(cfg, tmp_path)
    queue = controller.fleet.queue = start_replay_queue(cfg.buffer, batch_groups=2, name="rq-starved")
    controller.fleet.upkeep = lambda: None  # no engines to look after
    controller.prompts = (make_prompt(f"p{k}") for k in itertools.count())
    seen = RecordingSink()
    controller.telemetry.sinks.append(seen)
    stop = threading.Event()
    producer = threading.Thread(target=_produce, args=(queue.handle, stop), daemon=True)
    producer.start()
    try:
        with pytest.raises(StarvedError) as raised:
            controller._next_batch()
        # The queue's own timeout, asked directly, names the filtered groups too.
        with pytest.raises(TimeoutError, match=r"were all filtered or failed \(zero_variance \d+; every reward was 0\)"):
            queue.get_batch(2, 0, timeout_s=0.5)
    finally:
        stop.set()
        producer.join(timeout=10)
        queue.close()
    message = str(raised.value)
    print(message, *seen.notes, sep="\n")
    assert message.startswith("no batch in 6 s: the last ") and "(zero_variance " in message
    assert "the model never solves these prompts" in message and "buffer.filter_zero_variance=false" in message
    assert "were prompts added" not in message
    assert seen.notes and seen.notes[0].startswith("learner starved: the last ")
    assert [(a.name, a.active) for a in seen.alarms] == [("starved", True)]
