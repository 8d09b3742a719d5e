"""Token-exact multi-turn episodes and endpoint conversations on trained byte-level BPE tokenizers, in each chat
format (ChatML, Llama 3, Gemma), with scripted engines. Each test samples a turn boundary or a token split that
re-tokenizing the episode's text would change, and checks that the naive path drifts and ours does not."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from asyncrl.envs.base import EnvContext, make_env
from asyncrl.envs.data import encode_messages
from asyncrl.envs.episode import ChatTurns
from asyncrl.models.bpe import CHAT_FORMATS, train_bpe
from asyncrl.rollout.engine import SamplingSpec
from asyncrl.rollout.episode_runner import EpisodeLimits, EpisodeRunner
from asyncrl.rollout.openai_capture import ChatRenderer, EpisodeCapture
from asyncrl.testing import make_answer, make_prompt, make_request
from asyncrl.types import Trajectory

from .test_openai_capture import call


@pytest.fixture(scope="module", params=CHAT_FORMATS)
def tok(request):
    return train_bpe(request.param)


def pieces(tok, *texts: str, eos: bool = False) -> list[int]:
    """Ids sampled piece by piece: each text is tokenized on its own, so "An", "swer" is two tokens even where
    the canonical tokenization of "Answer" is one (a split a model may sample)."""
    ids = [i for text in texts for i in tok.encode(text, add_special_tokens=False)]
    return ids + ([tok.eos_token_id] if eos else [])


def naive(tok, ids) -> list[int]:
    """Re-tokenizing the text of a token sequence: what a re-render of the conversation would feed the learner."""
    return tok.encode(tok.decode(ids), add_special_tokens=False)


class ScriptedBPEEngine:
    """Samples the scripted turns in order (ids as given); records each turn's prompt."""

    def __init__(self, tok, turns: list[list[int]]):
        self.tok, self.turns = tok, list(turns)
        self.version, self.name = 0, "rollout-0"
        self.contexts: list[list[int]] = []

    def encode(self, text):
        return self.tok.encode(text, add_special_tokens=False)

    def decode(self, ids):
        return self.tok.decode(list(ids), skip_special_tokens=True)

    async def generate(self, request, sampling: SamplingSpec):
        self.contexts.append(list(request.prompt.prompt_ids))
        ids = self.turns[len(self.contexts) - 1]
        logprobs = [-0.5] * len(ids)
        return make_answer(request, ids, rollout_logprobs=logprobs, versions=0, finish_reason="stop",
                           response_text=self.decode(ids), worker=self.name)


def run_calc(tok, prompt_ids, turns, chat):
    engine = ScriptedBPEEngine(tok, turns)
    runner = EpisodeRunner(engine, lambda: make_env("calc", {}, EnvContext()), EpisodeLimits(4, 512, 10.0), chat)
    request = make_request(make_prompt("p", prompt_ids, "3"))
    return asyncio.run(runner.run(request, SamplingSpec(max_tokens=64))), engine


def test_an_observation_merging_with_the_sampled_tool_call_stays_split():
    tok = train_bpe("chatml")
    assert len(tok.encode("]=", add_special_tokens=False)) == 1  # "]" and "=" merge in this vocabulary
    prompt = tok.encode("1+2=", add_special_tokens=False)
    call_ids, answer = pieces(tok, "[1+2]"), pieces(tok, "3", eos=True)
    t, engine = run_calc(tok, prompt, [call_ids, answer], chat=None)  # raw text task: observations as they are
    expected = call_ids + tok.encode("=3;", add_special_tokens=False) + answer
    assert t.response_ids.tolist() == expected and engine.contexts[1] == prompt + expected[: -len(answer)]
    assert t.reward == 1.0 and t.loss_mask.tolist() == [1] * len(call_ids) + [0] * 3 + [1, 1]
    # the naive path: "...]" + "=3;" re-tokenized merges across the turn boundary into "]="
    assert naive(tok, prompt + expected) != prompt + expected
    assert "]=" in tok.convert_ids_to_tokens(naive(tok, prompt + expected))


def test_a_multi_turn_episode_is_written_in_the_chat_format_and_keeps_the_sampled_split(tok):
    messages = [{"role": "user", "content": "What is 1+2?"}]
    prompt = encode_messages(tok, messages)
    assert len(tok.encode("Answer", add_special_tokens=False)) == 1
    call_ids, answer = pieces(tok, "[1+2]"), pieces(tok, "An", "swer: 3", eos=True)  # a non-canonical split
    t, engine = run_calc(tok, prompt, [call_ids, answer], chat=ChatTurns(tok))
    observation = ChatTurns(tok).observation_text("=3;", "tool")  # the call ended at "]", not at the eos
    expected = call_ids + tok.encode(observation, add_special_tokens=False) + answer
    assert t.response_ids.tolist() == expected
    assert engine.contexts[1] == prompt + call_ids + tok.encode(observation, add_special_tokens=False)
    # the episode's text is the chat template's rendering of the conversation
    conversation = messages + [
        {"role": "assistant", "content": "[1+2]"},
        {"role": "tool", "content": "=3;", "tool_call_id": "call_0"},
        {"role": "assistant", "content": "Answer: 3"},
    ]
    rendered = tok.apply_chat_template(conversation, tokenize=False)
    text = tok.decode(prompt + expected)
    assert rendered.startswith(text) and rendered[len(text) :] in ("", "\n")
    assert naive(tok, prompt + expected) != prompt + expected  # re-tokenized, "An" "swer" becomes "Answer"


def test_parquet_and_built_in_prompts_are_written_in_the_chat_format(tok, tmp_path):
    from asyncrl.envs.data import add_prompt, verl_prompts, write_verl_parquet

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]
    row = {"data_source": "d", "prompt": messages, "reward_model": {"style": "rule", "ground_truth": "5"}}
    write_verl_parquet([row], tmp_path / "train.parquet")
    (prompt,) = verl_prompts(tok, tmp_path / "train.parquet")
    assert tok.decode(prompt.prompt_ids) == tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert tok.eos_token_id in prompt.prompt_ids  # the template's markup is special tokens, one id each
    sum_prompt = add_prompt(tok, 12, 34, "a")
    user = [{"role": "user", "content": "12+34="}]
    assert tok.decode(sum_prompt.prompt_ids) == tok.apply_chat_template(user, add_generation_prompt=True, tokenize=False)


def test_an_observation_after_the_sampled_eos_does_not_repeat_it(tok):
    chat = ChatTurns(tok)
    closed = chat.observation_text("hi", "user")
    after_eos = chat.observation_text("hi", "user", last_sampled=tok.eos_token_id)
    assert closed == tok.eos_token + after_eos


def test_endpoint_conversation_reuses_the_sampled_tokens_with_zero_drift(tok):
    capture = EpisodeCapture(ChatRenderer(tok))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]
    assert len(tok.encode("Answer", add_special_tokens=False)) == 1
    first = pieces(tok, "An", "swer: 5", eos=True)  # non-canonical: "Answer" is one token
    plan1, reply = call(capture, messages, completion(first))
    assert reply["content"] == "Answer: 5"
    messages += [reply, {"role": "user", "content": "And 1+1?"}]
    second = pieces(tok, "Answer: 2", eos=True)
    plan2, _ = call(capture, messages, completion(second))
    rendered = capture.renderer.render(messages)
    assert not plan2.restart and capture.drifts == 0
    assert plan2.prompt_ids == plan1.prompt_ids + first + plan2.observation
    assert tok.decode(plan2.prompt_ids) == rendered  # the same text as the re-rendered conversation...
    assert capture.renderer.encode(rendered) != plan2.prompt_ids  # ...whose naive tokenization drifts
    t = capture.finish("e").trajectory(prompt_id="p", group_id="g", sample_index=0)
    assert t.response_ids.tolist() == first + plan2.observation + second
    assert t.loss_mask.tolist() == [1] * len(first) + [0] * len(plan2.observation) + [1] * len(second)


def test_endpoint_tool_call_round_trip_has_zero_drift(tok):
    from .test_openai_capture import CALL_TEXT, TOOLS

    capture = EpisodeCapture(ChatRenderer(tok))
    messages = [{"role": "user", "content": "What is 2+3?"}]
    plan1, reply = call(capture, messages, completion(pieces(tok, CALL_TEXT, eos=True)), tools=TOOLS)
    assert reply["tool_calls"][0]["function"] == {"name": "calc", "arguments": '{"expr": "2+3"}'}
    messages += [reply, {"role": "tool", "tool_call_id": "call_0", "content": "5"}]
    plan2, _ = call(capture, messages, completion(pieces(tok, "Answer: 5", eos=True)), tools=TOOLS)
    assert not plan2.restart and capture.drifts == 0
    assert tok.decode(plan2.observation) == ChatTurns(tok).observation_text("5", "tool", tok.eos_token_id)


def completion(ids: list[int]) -> Trajectory:
    n = len(ids)
    return Trajectory(
        prompt_id="p", group_id="g", sample_index=0, prompt_ids=np.zeros(1, np.int32),
        response_ids=np.asarray(ids, np.int32), rollout_logprobs=np.full(n, -0.5, np.float32),
        loss_mask=np.ones(n, np.int8), versions=np.zeros(n, np.int32), finish_reason="stop", dispatch_version=0,
    )


def test_a_template_that_cannot_write_an_observation_is_named_and_tool_falls_back_to_user():
    tok = train_bpe("chatml", vocab_size=512)
    no_tools = "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools') }}{% endif %}" \
               "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}" \
               "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    chat = ChatTurns(tok, no_tools)
    chat.check()
    assert chat.observation_text("5", "tool") == chat.observation_text("5", "user")
    rewrites = "{% for m in messages %}{% if loop.last %}{{ m.content }}{% endif %}{% endfor %}"  # last message only
    with pytest.raises(ValueError, match="does not write a 'user' message after an assistant turn"):
        ChatTurns(tok, rewrites).check()


def test_a_production_vocabulary_endpoint_conversation_has_zero_drift():
    from asyncrl.models.bpe import production_tokenizer

    tok = production_tokenizer("chatml")  # Mistral's 131k tekken vocabulary, ChatML added
    capture = EpisodeCapture(ChatRenderer(tok))
    messages = [{"role": "user", "content": "What is 2+3?"}]
    assert len(tok.encode(" answer", add_special_tokens=False)) == 1
    first = pieces(tok, "The", " ans", "wer is 5.", eos=True)  # non-canonical: " answer" is one token
    plan1, reply = call(capture, messages, completion(first))
    messages += [reply, {"role": "user", "content": "Sure?"}]
    plan2, _ = call(capture, messages, completion(pieces(tok, "Yes.", eos=True)))
    rendered = capture.renderer.render(messages)
    assert not plan2.restart and capture.drifts == 0 and plan2.prompt_ids == plan1.prompt_ids + first + plan2.observation
    assert tok.decode(plan2.prompt_ids) == rendered and capture.renderer.encode(rendered) != plan2.prompt_ids


def test_a_model_folder_without_a_chat_template_gets_observations_as_they_are(tmp_path):
    assert ChatTurns.for_model(str(tmp_path)) is None
    train_bpe("gemma", vocab_size=512).save_pretrained(tmp_path)
    chat = ChatTurns.for_model(str(tmp_path))
    assert chat is not None and chat.observation_text("ok") == "<end_of_turn>\n<start_of_turn>user\nok<end_of_turn>\n<start_of_turn>model\n"
