"""An engine's collective pull without vLLM or Ray: `Engine.update_weights` with a `CollectiveWeights` record asks
learner rank 0 to send over the engine's group key while its worker receives, serves the version the learner
actually sent, and opens a new group after a failure."""

import asyncio

import pytest

from asyncrl.rollout.engine import Engine
from asyncrl.rollout.vllm_compat import RECEIVE_COLLECTIVE_RPC
from asyncrl.weights.group import CollectiveWeights
from tests.unit.rollout.fakes import InProcessHandle


class FakeSender:
    """Learner rank 0's `send_collective`: records the keys it was asked to send to."""

    def __init__(self):
        self.keys = []

    def send_collective(self, key):
        self.keys.append(key)
        return 3


class FakeLLM:
    """The `AsyncLLM` calls `update_weights` makes; the worker's receive answers (tensors, version received)."""

    def __init__(self, received=(51, 3), fail=False):
        self.received, self.fail = received, fail
        self.calls = []

    async def pause_generation(self, mode, clear_cache):
        self.calls.append("pause")

    async def resume_generation(self):
        self.calls.append("resume")

    async def update_weight_version(self, version):
        self.calls.append(f"version {version}")

    async def collective_rpc(self, method, timeout=None, args=()):
        self.calls.append(method)
        if self.fail:
            raise RuntimeError("weight receive from learner 127.0.0.1:1 failed: timeout")
        return [self.received]


def _engine(llm):
    engine = Engine("unused", name="rollout-7", initial_version=1)
    engine._llm = llm
    return engine


def _record(sender, version=2):
    return CollectiveWeights(version, "127.0.0.1", "file:///nonexistent", "gloo", 72, 2, 1 << 20, 5.0, sender=InProcessHandle(sender))


def test_an_engine_pulls_over_its_group_and_serves_the_version_the_learner_sent():
    sender, llm = FakeSender(), FakeLLM(received=(51, 3))
    engine = _engine(llm)
    # asked for version 2; rank 0 had already staged 3 (a joining engine overtaken by the next export)
    assert asyncio.run(engine.update_weights([_record(sender, version=2)], 2)) == 51
    assert engine.version == 3
    assert llm.calls == ["pause", RECEIVE_COLLECTIVE_RPC, "version 3", "resume"]
    assert sender.keys == [engine._group_key] and engine._group_key.startswith("rollout-7-")


def test_a_failed_pull_raises_resumes_and_the_next_pull_uses_a_new_group():
    sender, llm = FakeSender(), FakeLLM(fail=True)
    engine = _engine(llm)
    with pytest.raises(RuntimeError, match="127.0.0.1:1 failed"):
        asyncio.run(engine.update_weights([_record(sender)], 2))
    assert engine.version == 1 and llm.calls[-1] == "resume"
    assert engine._group_key != sender.keys[0]  # the learner forgot that group too
