from asyncrl.envs import add
from asyncrl.models.tokenizer import build_char_tokenizer
from asyncrl.models.warm_start import _examples, _validation_prompts


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
