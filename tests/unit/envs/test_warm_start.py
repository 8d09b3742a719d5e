import json
from pathlib import Path

import torch

from asyncrl.envs import add
from asyncrl.envs.data import add_prompt
from asyncrl.models import build_model
from asyncrl.models.tokenizer import build_char_tokenizer
from asyncrl.envs.warm_start import _examples, _validation_prompts, generate, left_pad, response_logits, warm_start


def _operands(tok, prompt_ids) -> tuple[int, int]:
    a, b = tok.decode(prompt_ids).rstrip("=").split("+")
    return int(a), int(b)


def test_validation_prompts_are_disjoint_from_heldout_and_warm_start_examples():
    tok = build_char_tokenizer()
    examples, pairs = _examples(tok, 2000, 999, seed=0)
    assert len(examples) == 2000 and len(pairs) > 1990
    validation = _validation_prompts(tok, 200, 999, pairs)
    operands = [_operands(tok, p.prompt_ids) for p in validation]
    assert len(set(operands)) == 200
    assert not set(operands) & pairs
    assert not set(operands) & set(add.heldout_pairs(max_operand=999))
    assert all(p.ground_truth == str(a + b) for p, (a, b) in zip(validation, operands))


def test_examples_supervise_answer_and_eos_only():
    tok = build_char_tokenizer()
    (ids, prompt_len), *_ = _examples(tok, 1, 999, seed=0)[0]
    a, b = _operands(tok, ids[:prompt_len])
    assert tok.decode(ids[prompt_len:-1]) == str(a + b) and ids[-1] == tok.eos_token_id


def _model(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


def test_response_logits_are_the_logits_generate_sampled_from_for_left_padded_prompts(tiny_model_dir):
    # Prompts of 6, 8 and 4 characters ("12+34=", ...): two rows are left-padded; the logits recomputed in
    # one forward pass must be the ones generate chose from, step by step, for every response token.
    model, tok = _model(tiny_model_dir)
    prompts = [add_prompt(tok, a, b, str(i)) for i, (a, b) in enumerate([(12, 34), (123, 456), (1, 2)])]
    samples = generate(model, tok, prompts, sample=False, max_new_tokens=5)
    input_ids, attn = left_pad(tok, [p.prompt_ids for p in prompts])
    out = model.generate(input_ids=input_ids, attention_mask=attn, max_new_tokens=5, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=0, eos_token_id=2)
    mask = samples.response_mask.bool()
    assert samples.prompt_width == 8 and mask[:, 0].all()
    assert torch.equal(out.sequences, samples.sequences)
    expected = torch.stack(out.logits, dim=1)[mask]
    assert torch.allclose(response_logits(model, samples)[mask], expected, atol=1e-4)


def test_deterministic_warm_start_is_repeatable_and_restores_the_thread_count(tmp_path):
    threads = torch.get_num_threads()
    reports, weights = [], []
    for run in ("a", "b"):
        path = build_model("tiny-0.3m", tmp_path / run, seed=0)
        reports.append(warm_start(path, examples=64, epochs=1, lr=1e-3, max_operand=99))
        weights.append(_model(path)[0].model.embed_tokens.weight)
    assert torch.get_num_threads() == threads
    assert torch.equal(weights[0], weights[1])
    drop = ("train_seconds",)
    assert {k: v for k, v in reports[0].items() if k not in drop} == {k: v for k, v in reports[1].items() if k not in drop}
    assert reports[0]["steps"] == 2 and reports[0]["epochs"] == 1.0  # 64 examples, batch 32
    assert 0 <= reports[0]["sampled_reward_t1"] <= 1 and reports[0]["answer_entropy_nats"] > 0


def test_warm_start_dropout_acts_while_training_and_is_not_saved(tmp_path):
    """Dropout changes what the same seeded run learns, and the saved model (what the learner trains and the
    engines serve) has none."""
    from transformers import AutoConfig

    weights, reports = [], []
    for dropout in (0.0, 0.5):
        path = build_model("tiny-0.3m", tmp_path / str(dropout), seed=0)
        reports.append(warm_start(path, examples=64, epochs=1, lr=1e-3, max_operand=99, dropout=dropout))
        weights.append(_model(path)[0].model.embed_tokens.weight)
        assert AutoConfig.from_pretrained(path).attention_dropout == 0.0
    assert not torch.equal(weights[0], weights[1])
    assert [r["attention_dropout"] for r in reports] == [0.0, 0.5]
    assert [r["dropout_given_up_after"] for r in reports] == [None, None]  # no target: nothing to give up


def test_a_dropout_warm_start_that_misses_its_target_is_trained_again_without_dropout(tmp_path):
    """64 examples at batch 32: 2 steps an epoch. The target (1.0) is never met, so the epoch with dropout is
    given up and the start trained again from its initial weights without dropout: the same weights as a run
    that never had dropout."""
    runs = {}
    for dropout in (0.5, 0.0):
        path = build_model("tiny-0.3m", tmp_path / str(dropout), seed=0)
        runs[dropout] = warm_start(path, examples=64, epochs=1, lr=1e-3, max_operand=99, target=1.0, dropout=dropout)
        runs[dropout]["embedding"] = _model(path)[0].model.embed_tokens.weight
    assert runs[0.5]["steps"] == 4 and runs[0.5]["dropout_given_up_after"] == 2 and runs[0.5]["target_reached"] is False
    assert runs[0.0]["steps"] == 2 and runs[0.0]["dropout_given_up_after"] is None
    assert torch.equal(runs[0.5]["embedding"], runs[0.0]["embedding"])


def test_a_calc_example_supervises_the_model_turns_but_not_the_observation():
    from asyncrl.models.tokenizer import CALC_ALPHABET
    from asyncrl.envs.warm_start import calc_example

    tok = build_char_tokenizer(CALC_ALPHABET)
    ids, flags = calc_example(tok, "1+2=", "3", use_tool=True)
    assert tok.decode(ids[:-1]) == "1+2=[1+2]=3;3" and ids[-1] == tok.eos_token_id
    assert flags == [0] * 4 + [1] * 5 + [0] * 3 + [1] * 2
    ids, flags = calc_example(tok, "1+2=", "3", use_tool=False)
    assert tok.decode(ids[:-1]) == "1+2=3" and flags == [0] * 4 + [1] * 2


def test_a_word_problem_example_calls_the_tool_with_the_given_expression():
    from asyncrl.envs.warm_start import calc_example
    from asyncrl.models.tokenizer import ASCII_ALPHABET

    tok = build_char_tokenizer(ASCII_ALPHABET)
    ids, flags = calc_example(tok, "Ann has 2 and gets 3 more.\nAnswer: ", "5", use_tool=True, expression="2+3")
    assert tok.decode(ids[:-1]) == "Ann has 2 and gets 3 more.\nAnswer: [2+3]=5;5" and ids[-1] == tok.eos_token_id
    assert flags == [0] * 35 + [1] * 5 + [0] * 3 + [1] * 2


def test_the_agent_tasks_share_the_calc_warm_start_keyed_by_task(monkeypatch, tmp_path):
    from asyncrl.config import load_config
    from asyncrl.envs import model_dir, warm_start

    calls = []
    monkeypatch.setattr(model_dir, "cache_root", lambda: tmp_path)
    monkeypatch.setattr(model_dir, "build_model", lambda preset, out, seed: Path(out).mkdir(parents=True))
    monkeypatch.setattr(warm_start, "warm_start_calc", lambda *a, **kw: calls.append((a, kw)) or {"steps": 1})
    paths = {name: model_dir.ensure_model(load_config(name)) for name in ("sao_agent", "word_problems")}
    assert [kw["task"] for _, kw in calls] == ["calc", "word_problems"]
    assert paths["sao_agent"].name.startswith("calc-1m-") and paths["word_problems"].name.startswith("ascii-1m-")
    assert json.loads((paths["word_problems"] / "warm_start.json").read_text())["spec"]["task"] == "word_problems"
