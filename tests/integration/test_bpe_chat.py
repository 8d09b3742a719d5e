"""Model folders with a trained byte-level BPE tokenizer and a chat format, on a real vLLM CPU engine: a multi-turn
environment episode and an OpenAI-endpoint episode through the real `openai` client, both token-exact.

One rollout worker (engine + endpoint) per format: a random-init 2-layer model (head size 32, untied head) saved
with `save_pretrained` beside `train_bpe(<format>)` — Qwen2 with ChatML (vLLM loads the tokenizer with
`AutoTokenizer`, which rebuilds a qwen2 folder's tokenizer as `Qwen2Tokenizer`), Llama with Llama 3's headers. The model is random, so the checks hold for any sample: the
chat markup between turns, the engine's own log-probs of the final sequence equal to the rollout log-probs of every
model token (each turn was sampled from exactly the tokens before it), and zero endpoint drift.
"""

from __future__ import annotations

import numpy as np
import pytest

from asyncrl.envs.base import Observation, StepResult
from asyncrl.envs.data import encode_messages
from asyncrl.envs.episode import ChatTurns
from asyncrl.rollout.engine import SamplingSpec
from asyncrl.rollout.episode_runner import EpisodeLimits, EpisodeRunner
from asyncrl.testing import make_prompt, make_request

pytestmark = pytest.mark.integration

QUESTION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]


FORMATS = {"chatml": "qwen2", "llama3": "llama"}  # chat format -> the family its model folder is
USER_TURN = {
    "chatml": "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n",
    "llama3": "<|start_header_id|>user<|end_header_id|>\n\n{}<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
}
TOOL_TURN = {
    "chatml": "<|im_start|>user\n<tool_response>\n=5;\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
    "llama3": "<|start_header_id|>ipython<|end_header_id|>\n\n=5;<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
}


@pytest.fixture(scope="module", params=list(FORMATS))
def chat_format(request):
    return request.param


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, chat_format):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from asyncrl.models.bpe import train_bpe

    tok = train_bpe(chat_format)
    config_class, model_class = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}[
        FORMATS[chat_format]
    ]
    config = config_class(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=1024, tie_word_embeddings=False,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
    )
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp(f"bpe-{chat_format}")
    model_class(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def worker(loop, model_dir):
    from asyncrl.config import RolloutConfig
    from asyncrl.rollout.worker import RolloutWorker, WorkerSpec

    rollout = RolloutConfig(openai_port=-1, max_tokens=6, max_model_len=1024, max_requests_in_flight=8)
    worker = RolloutWorker("rollout-0", WorkerSpec(str(model_dir), rollout=rollout, max_model_len=1024))
    loop.run_until_complete(worker.ready())
    yield worker
    loop.run_until_complete(worker.shutdown())


class ToolTurns:
    """A tool result `=5;` after each of the first two turns; done (reward 1) after the third."""

    stop: tuple[str, ...] = ()

    def __init__(self):
        self.steps = 0

    async def reset(self, prompt):
        return Observation()

    async def step(self, action_text, *, finish_reason="stop"):
        from asyncrl.envs.base import StepInfo

        self.steps += 1
        if self.steps >= 3:
            return StepResult(None, reward=1.0, done=True)
        return StepResult(Observation("=5;"), info=StepInfo(tool="calculator"))


def test_a_multi_turn_episode_is_written_in_the_chat_format_and_token_exact(loop, worker, model_dir, chat_format):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    engine, chat = worker.engine, ChatTurns.for_model(str(model_dir))
    assert chat is not None
    prompt = encode_messages(tok, QUESTION)
    runner = EpisodeRunner(engine, ToolTurns, EpisodeLimits(4, 512, 60.0), chat)
    sampling = SamplingSpec(max_tokens=5, temperature=1.0, seed=7)
    t = loop.run_until_complete(runner.run(make_request(make_prompt("bpe", prompt, "5")), sampling))
    assert (t.num_turns, t.reward, t.failure) == (3, 1.0, None)
    ends = [*t.turn_starts[1:], len(t.response_ids)]
    for k in range(2):  # each observation is the format's tool turn, after the turn's last sampled token
        model = t.response_ids[t.turn_starts[k] : ends[k]][t.loss_mask[t.turn_starts[k] : ends[k]] == 1]
        observation = t.response_ids[t.turn_starts[k] + len(model) : ends[k]].tolist()
        text = chat.observation_text("=5;", "tool", int(model[-1]))
        assert observation == tok.encode(text, add_special_tokens=False)
        assert text.endswith(TOOL_TURN[chat_format])
    scored = loop.run_until_complete(engine.score(prompt + t.response_ids.tolist(), len(prompt)))
    model = np.flatnonzero(t.loss_mask == 1)
    assert len(model) >= 3 and np.allclose(scored[model], t.rollout_logprobs[model], atol=1e-4)


def test_an_endpoint_episode_through_the_openai_client_has_zero_drift(loop, worker, chat_format):
    import openai

    url = worker.openai.url

    async def episode():
        c = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, default_headers={"X-Episode-Id": "bpe"})
        messages, replies = list(QUESTION), []
        for k in range(3):
            r = await c.chat.completions.create(model="m", messages=messages, logprobs=True, max_tokens=4 + k)
            replies.append(r)
            messages += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": f"and {k}?"}]
        return replies, await worker.finish_episode("bpe", reward=1.0)

    replies, t = loop.run_until_complete(episode())
    renderer = worker.openai.renderer
    assert t.prompt_ids.tolist() == replies[0].prompt_token_ids == encode_messages(renderer.tokenizer, QUESTION)
    for k, r in enumerate(replies):
        start, ids = t.turn_starts[k], r.choices[0].token_ids
        assert r.prompt_token_ids == t.prompt_ids.tolist() + t.response_ids[:start].tolist()
        assert t.response_ids[start : start + len(ids)].tolist() == ids
        logprobs = np.asarray([c.logprob for c in r.choices[0].logprobs.content], dtype=np.float32)
        assert np.array_equal(t.rollout_logprobs[start : start + len(ids)], logprobs)
    first_end = t.turn_starts[0] + len(replies[0].choices[0].token_ids)
    observation = renderer.decode(t.response_ids[first_end : t.turn_starts[1]], specials=True)
    assert observation.endswith(USER_TURN[chat_format].format("and 0?"))
    assert worker.openai.capture.drifts == 0 and worker.openai.stats()["openai_drift"] == 0
