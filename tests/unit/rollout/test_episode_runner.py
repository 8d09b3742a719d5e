"""Multi-turn episodes on a scripted engine: token-exact sequences, limits and failures, by hand."""

import asyncio
import time
from collections.abc import Callable

import pytest

from asyncrl.buffer import ReplayQueue
from asyncrl.buffer.filters import failed_state
from asyncrl.config import BufferConfig, EnvConfig, RolloutConfig
from asyncrl.envs.base import EnvContext, make_env
from asyncrl.envs.tools.base import InProcessTools, RewardError, ToolInfraError
from asyncrl.rollout.engine import SamplingSpec
from asyncrl.rollout.episode_runner import EpisodeLimits, EpisodeRunner
from asyncrl.rollout.worker import RolloutWorker, WorkerSpec
from asyncrl.testing import make_answer, make_prompt, make_request

from .fakes import InProcessHandle

EOS = 2
VOCAB = {c: i + 4 for i, c in enumerate("0123456789+=-*[]?;")}
CHARS = {i: c for c, i in VOCAB.items()}


def enc(text: str) -> list[int]:
    return [VOCAB[c] for c in text]


class ScriptedEngine:
    """A character-level engine whose next turn is `policy(context text)`; `$` at the end stands for EOS.
    Turn k's token j gets log-prob -(k + 1) - j / 10; every token carries `version` (tests bump it between
    turns, as an in-flight weight update would). `delay_s` per turn, honouring the sampling timeout."""

    def __init__(self, policy: Callable[[str], str], delay_s: float = 0.0):
        self.policy, self.delay_s = policy, delay_s
        self.version, self.name, self.weight_load = 0, "rollout-0", "in_place"
        self.started, self.num_requests_done, self.num_tokens_generated, self.num_vllm_requests = True, 0, 0, 0
        self.contexts: list[list[int]] = []
        self.samplings: list[SamplingSpec] = []
        self.on_turn: Callable[[int], None] = lambda k: None

    def encode(self, text):
        return enc(text)

    def decode(self, ids):
        return "".join(CHARS.get(i, "") for i in ids)

    async def start(self):
        pass

    async def generate(self, request, sampling: SamplingSpec):
        k = len(self.contexts)
        self.on_turn(k)
        self.contexts.append(list(request.prompt.prompt_ids))
        self.samplings.append(sampling)
        if sampling.timeout_s is not None and self.delay_s > sampling.timeout_s:
            await asyncio.sleep(sampling.timeout_s)
            return make_answer(request, [], failure="timeout: request ran too long", finish_reason="abort", versions=self.version)
        await asyncio.sleep(self.delay_s)
        text = self.policy(self.decode(request.prompt.prompt_ids))
        ids = enc(text.rstrip("$")) + ([EOS] if text.endswith("$") else [])
        finish = "stop" if len(ids) <= sampling.max_tokens else "length"
        ids = ids[: sampling.max_tokens]
        logprobs = [-(k + 1) - j / 10 for j in range(len(ids))]
        return make_answer(request, ids, rollout_logprobs=logprobs, versions=self.version, finish_reason=finish,
                           response_text=self.decode(ids), worker=self.name)


def calculator_user(context: str) -> str:
    """Calls the calculator once, then copies its result."""
    if "]" not in context:
        return "[" + context.rstrip("=") + "]"
    return context.rsplit("=", 1)[1].rstrip(";") + "$"


def _run(engine, tools=None, limits=EpisodeLimits(4, 64, 10.0), prompt="1+2=", truth="3", sampling=SamplingSpec(max_tokens=8)):
    runner = EpisodeRunner(engine, lambda: make_env("calc", {}, EnvContext(tools or InProcessTools())), limits)
    request = make_request(make_prompt("p", enc(prompt), truth))
    return asyncio.run(runner.run(request, sampling))


def test_a_tool_episode_is_one_token_exact_sequence_with_masks_log_probs_and_versions():
    engine = ScriptedEngine(calculator_user)
    engine.on_turn = lambda k: setattr(engine, "version", k)  # an in-flight update lands between the turns
    t = _run(engine)
    call, observation, answer = enc("[1+2]"), enc("=3;"), enc("3") + [EOS]
    assert t.prompt_ids.tolist() == enc("1+2=")
    assert t.response_ids.tolist() == call + observation + answer
    assert engine.contexts == [enc("1+2="), enc("1+2=") + call + observation]  # each turn's prompt: exact tokens
    assert engine.samplings[0].stop == ("]",)
    assert t.loss_mask.tolist() == [1, 1, 1, 1, 1, 0, 0, 0, 1, 1]
    assert t.rollout_logprobs.tolist() == pytest.approx([-1, -1.1, -1.2, -1.3, -1.4, 0, 0, 0, -2, -2.1])
    assert t.versions.tolist() == [0, 0, 0, 0, 0, 0, 0, 0, 1, 1]  # observations keep the previous token's version
    assert (t.turn_starts, t.turn_versions, t.num_turns) == ([0, 8], [0, 1], 2)
    assert (t.finish_reason, t.truncated, t.failure, t.reward, t.tool_calls) == ("stop", False, None, 1.0, 1)
    assert t.response_text == "[1+2]=3;3"


def test_an_episode_still_calling_tools_after_max_turns_is_truncated():
    t = _run(ScriptedEngine(lambda ctx: "[1+1]"), limits=EpisodeLimits(2, 64, 10.0))
    assert (t.finish_reason, t.truncated, t.num_turns, t.tool_calls, t.reward) == ("max_turns", True, 2, 2, 0.0)
    assert t.loss_mask.tolist() == [1] * 5 + [0] * 3 + [1] * 5 + [0] * 3


def test_an_observation_that_does_not_fit_ends_the_episode_at_the_context_limit():
    # Prompt 4 + call 5 = 9 tokens; the observation's 3 would make 12 > 11: not appended.
    engine = ScriptedEngine(calculator_user)
    t = _run(engine, limits=EpisodeLimits(4, 11, 10.0))
    assert (t.finish_reason, t.truncated, t.response_ids.tolist()) == ("context", True, enc("[1+2]"))
    assert engine.samplings[0].max_tokens == 7  # a turn never asks for more than the room left


def test_a_turn_cut_by_the_room_left_ends_the_episode_at_the_context_limit():
    engine = ScriptedEngine(lambda ctx: "1234567$")
    t = _run(engine, limits=EpisodeLimits(4, 8, 10.0))
    assert (t.finish_reason, t.truncated, len(t.response_ids)) == ("context", True, 4)


def test_an_episode_past_its_wall_time_is_truncated_not_failed():
    t = _run(ScriptedEngine(calculator_user, delay_s=0.5), limits=EpisodeLimits(4, 64, 0.1), sampling=SamplingSpec(max_tokens=8, timeout_s=30))
    assert (t.finish_reason, t.truncated, t.failure) == ("timeout", True, None)


def test_a_request_timeout_within_the_episode_still_fails_the_trajectory():
    t = _run(ScriptedEngine(calculator_user, delay_s=0.5), sampling=SamplingSpec(max_tokens=8, timeout_s=0.1))
    assert t.failure.startswith("timeout") and not t.truncated


class BrokenTools(InProcessTools):
    """The calculator's worker is gone (`ToolInfraError`) for expressions with a 9; rewards may raise."""

    def __init__(self, reward_error: bool = False):
        self.reward_error = reward_error

    async def call(self, call, timeout_s):
        if "9" in call.arguments:
            raise ToolInfraError("tool_worker_died", "tool-0 exited with signal 9")
        return await super().call(call, timeout_s)

    async def reward(self, *args, **kwargs):
        if self.reward_error:
            raise RewardError("ValueError: bad")
        return await super().reward(*args, **kwargs)


def test_a_tool_infrastructure_error_fails_the_episode_with_its_reason():
    t = _run(ScriptedEngine(calculator_user), tools=BrokenTools(), prompt="9+1=", truth="10")
    assert t.failure == "tool_worker_died: tool-0 exited with signal 9" and t.reward == 0.0
    assert failed_state(t.failure) == "failed:tool_worker_died"


def test_a_reward_error_fails_the_episode_as_reward_error():
    t = _run(ScriptedEngine(calculator_user), tools=BrokenTools(reward_error=True))
    assert t.failure == "reward_error: ValueError: bad"


def test_the_worker_hands_back_every_episode_and_the_queue_conserves_a_tool_failure():
    actor = ReplayQueue(BufferConfig(filter_zero_variance=False), batch_groups=1, name="rq-episodes")  # the facade the worker calls
    queue = actor.core
    queue.add_prompts([make_prompt(f"p{i}", enc(p), a) for i, (p, a) in enumerate([("1+2=", "3"), ("9+1=", "10"), ("4+4=", "8")])], 1)
    spec = WorkerSpec("unused", RolloutConfig(max_tokens=8, max_model_len=64), EnvConfig(name="calc", max_turns=3), tools=BrokenTools())
    worker = RolloutWorker("rollout-0", spec, InProcessHandle(actor), engine=ScriptedEngine(calculator_user))

    async def serve():
        run = asyncio.ensure_future(worker.run())
        deadline = time.monotonic() + 10
        while queue.counters()["put"] < 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await worker.stop(drain=True)
        await run

    asyncio.run(serve())
    counts = queue.check_conservation()  # dispatched == trained + failed + ... + in flight
    assert (counts["dispatched"], counts["failed:tool_worker_died"], counts["in_flight"]) == (3, 1, 2)
    batch = queue.get_batch(2, 0)  # the two good episodes are ready and trainable
    assert [t.reward for g in batch.groups for t in g.trajectories] == [1.0, 1.0]
    assert queue.check_conservation()["trained"] == 2
