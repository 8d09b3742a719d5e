"""The `calc` task as tool-calling chat: the conversations the chat warm start teaches and the built-in harness."""

import asyncio
import json

import pytest

from asyncrl.envs import chat_calc
from asyncrl.envs.warm_start import chat_example

TOOLS = [chat_calc.CALCULATOR_TOOL]


@pytest.fixture(scope="module")
def chatml():
    from asyncrl.models.bpe import train_bpe

    return train_bpe("chatml")


def test_run_tool_answers_the_calculator_and_names_what_is_wrong():
    assert chat_calc.run_tool("calculator", '{"expression": "123+456+789"}') == "1368"
    assert chat_calc.run_tool("search", "{}") == "error: unknown tool 'search'"
    assert chat_calc.run_tool("calculator", "{").startswith("error: ")
    assert chat_calc.run_tool("calculator", '{"expression": 5}') == "error: expression is not a string"
    assert chat_calc.run_tool("calculator", '{"expr": "1+1"}') == "error: 'expression'"
    assert "not allowed" in chat_calc.run_tool("calculator", '{"expression": "__import__(\'os\')"}')


def test_chat_example_is_the_rendered_conversation_with_only_the_assistant_turns_supervised(chatml):
    for use_tool, supervised in (
        (
            True,
            '<tool_call>\n{"name": "calculator", "arguments": {"expression": "123+456+789"}}\n</tool_call><|im_end|>1368<|im_end|>',
        ),
        (False, "1368<|im_end|>"),
    ):
        messages = chat_calc.conversation("123+456+789=", "1368", use_tool)
        ids, flags = chat_example(chatml, messages, TOOLS)
        rendered = chatml.apply_chat_template(messages, tools=TOOLS, tokenize=False)
        # the template's text through the last end-of-turn, token for token as one encoding of it
        assert ids == chatml(rendered.removesuffix("\n"), add_special_tokens=False).input_ids
        assert chatml.decode([i for i, f in zip(ids, flags, strict=True) if f]) == supervised
        assert flags[-1] == 1 and ids[-1] == chatml.eos_token_id


class _Client:
    """Scripted chat completions in the OpenAI client's own types; records what each call sent."""

    def __init__(self, replies):
        from openai.types.chat import ChatCompletion

        self.sent, self.chat = [], self
        self.completions = self
        self.replies = [
            ChatCompletion.model_validate(
                {
                    "id": f"c{i}",
                    "object": "chat.completion",
                    "created": 0,
                    "model": "m",
                    "choices": [{"index": 0, "message": {"role": "assistant", **m}, "finish_reason": f}],
                }
            )
            for i, (m, f) in enumerate(replies)
        ]

    async def create(self, **kwargs):
        self.sent.append(json.loads(json.dumps(kwargs)))
        return self.replies[len(self.sent) - 1]


class _Episode:
    model = "m"

    class prompt:
        ground_truth = "1368"


def test_the_harness_answers_each_tool_call_and_scores_the_final_answer():
    call = chat_calc.tool_call_message("123+456+789")
    client = _Client(
        [({"content": None, "tool_calls": call["tool_calls"]}, "tool_calls"), ({"content": "1368"}, "stop")]
    )
    reward, info = asyncio.run(chat_calc.agent(client, "123+456+789=", _Episode()))
    assert (reward, info) == (1.0, {"tool_calls": 1})
    second = client.sent[1]["messages"]
    assert second[2]["tool_calls"][0]["function"] == {
        "name": "calculator",
        "arguments": '{"expression": "123+456+789"}',
    }
    assert second[3] == {"role": "tool", "tool_call_id": "call_0", "content": "1368"}
    assert client.sent[0]["tools"] == TOOLS


def test_the_harness_scores_a_wrong_or_cut_answer_zero_and_a_run_out_of_calls_truncated():
    wrong = _Client([({"content": "1369"}, "stop")])
    cut = _Client([({"content": "1368"}, "length")])
    call = chat_calc.tool_call_message("1+1")
    looping = _Client([({"content": None, "tool_calls": call["tool_calls"]}, "tool_calls")] * chat_calc.MAX_MODEL_CALLS)
    assert asyncio.run(chat_calc.agent(wrong, "123+456+789=", _Episode())) == (0.0, {"tool_calls": 0})
    assert asyncio.run(chat_calc.agent(cut, "123+456+789=", _Episode())) == (0.0, {"tool_calls": 0})
    truncated = (0.0, {"truncated": True, "tool_calls": chat_calc.MAX_MODEL_CALLS})
    assert asyncio.run(chat_calc.agent(looping, "123+456+789=", _Episode())) == truncated
    assert len(looping.sent) == chat_calc.MAX_MODEL_CALLS


def test_called_expression_reads_one_well_formed_calculator_call_only():
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+2"}}\n</tool_call>'
    assert chat_calc.called_expression(call) == "1+2"
    assert chat_calc.called_expression(call.replace("calculator", "search")) is None
    assert chat_calc.called_expression(call.replace('"1+2"', "3")) is None
    assert chat_calc.called_expression(call[:-1]) is None and chat_calc.called_expression("3") is None


def test_the_config_family_names_are_the_families_asyncrl_builds():
    import typing

    from asyncrl.config.model import FamilyName
    from asyncrl.models.families import FAMILIES

    assert set(typing.get_args(FamilyName)) == set(FAMILIES)


def test_the_agents_sdk_harness_sends_the_calculator_tool_key_for_key_and_answers_its_calls():
    pytest.importorskip("agents")
    import httpx
    import openai

    from asyncrl.envs import agents_sdk

    call = chat_calc.tool_call_message("123+456+789")
    replies = _Client([({"content": None, "tool_calls": call["tool_calls"]}, "tool_calls"), ({"content": "1368"}, "stop")])
    sent = []

    def answer(request):  # the OpenAI client's HTTP, answered in process
        sent.append(json.loads(request.content))
        return httpx.Response(200, json=replies.replies[len(sent) - 1].model_dump())

    transport = httpx.AsyncClient(transport=httpx.MockTransport(answer))
    client = openai.AsyncOpenAI(base_url="http://endpoint/v1", api_key="k", http_client=transport, max_retries=0)
    assert asyncio.run(agents_sdk.agent(client, "123+456+789=", _Episode())) == (1.0, {"tool_calls": 1})
    first, second = sent
    assert first["tools"] == TOOLS and first["messages"] == chat_calc.question("123+456+789=")
    assert second["messages"][2]["tool_calls"] == call["tool_calls"]
    assert second["messages"][3] == {"role": "tool", "tool_call_id": "call_0", "content": "1368"}


def test_an_sdk_episode_whose_model_calls_a_tool_the_agent_lacks_is_scored_wrong_not_failed():
    pytest.importorskip("agents")
    import httpx
    import openai

    from asyncrl.envs import agents_sdk

    call = chat_calc.tool_call_message("123+456")
    call["tool_calls"][0]["function"]["name"] = "calculater"  # a misspelt tool: the SDK raises ModelBehaviorError
    replies = _Client([({"content": None, "tool_calls": call["tool_calls"]}, "tool_calls")])

    def answer(request):
        return httpx.Response(200, json=replies.replies[0].model_dump())

    transport = httpx.AsyncClient(transport=httpx.MockTransport(answer))
    client = openai.AsyncOpenAI(base_url="http://endpoint/v1", api_key="k", http_client=transport, max_retries=0)
    assert asyncio.run(agents_sdk.agent(client, "123+456=", _Episode())) == (0.0, {"truncated": False, "tool_calls": 0})


def test_model_family_builds_that_family_with_its_chat_template_once(tmp_path, monkeypatch):
    import json as _json

    from asyncrl.config import load_config
    from asyncrl.envs.model_dir import ensure_model

    monkeypatch.setenv("ASYNCRL_CACHE", str(tmp_path))
    cfg = load_config("calc_chat", ["model.warm_start_examples=0"])  # the family alone: no warm start
    said: list[str] = []
    first, again = ensure_model(cfg, said.append), ensure_model(cfg, said.append)
    assert first == again and first.parent == tmp_path / "models" and first.name.startswith("qwen2-")
    assert _json.loads((first / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    assert "<|im_start|>" in (first / "chat_template.jinja").read_text()
    assert said[0].startswith("building model family qwen2") and said[1].endswith("(cached)") and len(said) == 2


def test_a_family_shape_builds_that_shape_under_its_own_cache_key(tmp_path, monkeypatch):
    import json as _json

    from asyncrl.config import load_config
    from asyncrl.envs.model_dir import ensure_model

    monkeypatch.setenv("ASYNCRL_CACHE", str(tmp_path))
    wide = ["model.family_shape.hidden_size=128", "model.family_shape.num_attention_heads=4"]
    plain = ensure_model(load_config("calc_chat", ["model.warm_start_examples=0"]))
    wider = ensure_model(load_config("calc_chat", ["model.warm_start_examples=0", *wide]))
    assert plain != wider
    config = _json.loads((wider / "config.json").read_text())
    assert (config["hidden_size"], config["num_attention_heads"], config["head_dim"]) == (128, 4, 32)
    assert (config["num_hidden_layers"], config["num_key_value_heads"]) == (2, 1)  # unset keys keep the shared size
    assert _json.loads((plain / "config.json").read_text())["hidden_size"] == 64
    assert _json.loads((wider / "warm_start.json").read_text())["spec"]["shape"] == {"hidden_size": 128, "num_attention_heads": 4}


def test_the_chat_profile_scores_first_turns_and_whole_episodes_by_hand(monkeypatch):
    from asyncrl.envs import warm_start

    problems = [("100+200=", "300"), ("111+222=", "333"), ("400+500=", "900"), ("123+321=", "444")]

    def replies(_model, _tokenizer, conversations, _max_new_tokens):
        out = []
        for c in conversations:
            if c[-1]["role"] == "tool":  # the answer after the calculator: echo its result
                out.append(c[-1]["content"])
            else:  # first turns: an exact call, a call on the wrong sum, a right and a wrong direct answer
                text = c[-1]["content"]
                first = {"100+200=": "100+200", "111+222=": "111+223"}
                if text in first:
                    out.append(f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{first[text]}"}}}}\n</tool_call>')
                else:
                    out.append("900" if text == "400+500=" else "445")
        return out

    monkeypatch.setattr(warm_start, "_greedy_replies", replies)
    profile = warm_start.chat_calc_profile(None, None, problems)
    # two calls (one exact), two direct answers (one right); episodes right: the exact call and the right answer
    assert profile == {"tool_call_rate": 0.5, "exact_call_rate": 0.25, "direct_accuracy": 0.5, "success": 0.5}


def test_the_chat_warm_start_stops_at_its_target_on_validation_problems_it_never_trains_on(tmp_path, monkeypatch):
    from asyncrl.envs import calc, warm_start
    from asyncrl.models.families import build_family

    model_dir = build_family("qwen2", tmp_path / "m")
    monkeypatch.setattr(warm_start, "EVAL_EVERY_STEPS", 2)
    monkeypatch.setattr(warm_start, "CHAT_EVAL_EVERY_STEPS", 2)
    heldout = {t for t, _ in calc.heldout_problems("calc", 500, 2)}
    seen: list[list[tuple[str, str]]] = []

    def profile(_model, _tokenizer, problems, _max_new_tokens=48, task="calc"):
        seen.append(problems)
        success = [0.0, 0.1, 0.3, 0.9][len(seen) - 1] if problems[0][0] not in heldout else 0.25
        return {"tool_call_rate": 1.0, "exact_call_rate": 1.0, "direct_accuracy": 0.0, "success": success}

    monkeypatch.setattr(warm_start, "chat_calc_profile", profile)
    record = warm_start.warm_start_chat_calc(model_dir, 16 * 20, 1, 1e-3, operands=2, target=0.2)
    assert record["steps"] == 6 and record["target_reached"]  # checks at steps 2, 4, 6: 0.0, 0.1, 0.3 >= 0.2
    assert record["validation_success"] == [(2, 0.0), (4, 0.1), (6, 0.3)] and record["success"] == 0.25
    validation = seen[0]
    assert len(validation) == warm_start.CHAT_VALIDATION_PROBLEMS and not {t for t, _ in validation} & heldout
    trained = calc.train_problems("calc", warm_start.add.WARM_START_SEED, 2)
    assert not {t for t, _ in validation} & {next(trained)[0] for _ in range(16 * 20)}
    assert seen[-1] == calc.heldout_problems("calc", 50, 2)  # the start is measured on the held-out problems


def test_a_chat_target_reaches_the_warm_start_and_is_part_of_the_cached_models_key(tmp_path, monkeypatch):
    from asyncrl.config import load_config
    from asyncrl.envs import warm_start
    from asyncrl.envs.model_dir import ensure_model

    monkeypatch.setenv("ASYNCRL_CACHE", str(tmp_path))
    targets: list[tuple[float | None, str]] = []

    def trained(model_dir, *args, target=None, report=None, task="calc"):  # the start itself: tests above
        targets.append((target, task))
        return {"steps": 0}

    monkeypatch.setattr(warm_start, "warm_start_chat_calc", trained)
    plain = ensure_model(load_config("calc_chat", []))
    aimed = ensure_model(load_config("calc_chat", ["model.warm_start_chat_target=0.3"]))
    stories = ensure_model(load_config("calc_chat", ["data.task=word_problems"]))
    assert [t for t, _ in targets] == [None, 0.3, None] and [task for _, task in targets] == ["calc", "calc", "word_problems"]
    assert len({plain, aimed, stories}) == 3
    assert "target" not in json.loads((plain / "warm_start.json").read_text())["spec"]  # older starts keep their names


def test_a_word_problem_conversation_calls_the_expression_that_solves_it(chatml):
    from asyncrl.envs import calc

    text, answer = calc.heldout_problems("word_problems", 1)[0]
    messages = chat_calc.conversation(text, answer, True, "word_problems")
    arguments = json.loads(messages[2]["tool_calls"][0]["function"]["arguments"])
    assert arguments == {"expression": calc.tool_expression("word_problems", text)}
    assert chat_calc.run_tool("calculator", json.dumps(arguments)) == answer == messages[3]["content"] == messages[4]["content"]
    ids, flags = chat_example(chatml, messages, TOOLS)  # rendered in the chat format, the call and answer supervised
    assert chatml.decode([i for i, f in zip(ids, flags, strict=True) if f]).count(arguments["expression"]) == 1
