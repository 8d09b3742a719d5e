import pytest

from asyncrl.models.bpe import CHAT_FORMATS, chat_template, production_tokenizer, train_bpe
from asyncrl.models.templates import SHIPPED, load_chat_template

TEXTS = [" a\nb", "Hello, world!  12345\n\n\tdef f(x):\n    return x", "héllo 日本 🙂", "<|im_end|> is text", ""]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "2+3?"},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "4+4?"},
]


@pytest.fixture(scope="module", params=CHAT_FORMATS)
def bpe(request):
    return train_bpe(request.param, vocab_size=1024)


def test_training_is_deterministic_and_fills_the_vocabulary():
    a, b = train_bpe("chatml"), train_bpe("chatml")
    assert len(a) == 2048 and a.get_vocab() == b.get_vocab()
    # the format's special tokens come first; the end-of-turn token is the eos
    assert a.convert_ids_to_tokens([0, 1, 2]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert (a.eos_token, a.pad_token, a.bos_token) == ("<|im_end|>", "<|endoftext|>", None)


def test_extra_text_changes_the_merges():
    base = train_bpe("chatml", vocab_size=600)
    more = train_bpe("chatml", vocab_size=600, extra_text=["zyzzyva " * 50] * 200)
    assert len(base("zyzzyva").input_ids) > 1 and more("zyzzyva").input_ids == [more.convert_tokens_to_ids("zyzzyva")]


def test_text_round_trips_and_specials_in_text_are_one_token(bpe):
    for text in TEXTS:
        assert bpe.decode(bpe(text, add_special_tokens=False).input_ids) == text
    eos = bpe(bpe.eos_token, add_special_tokens=False).input_ids
    assert eos == [bpe.eos_token_id]


def test_save_pretrained_and_auto_tokenizer_give_the_same_tokenizer(bpe, tmp_path):
    from transformers import AutoTokenizer, Qwen2Config

    # beside a qwen2 config, AutoTokenizer rebuilds the tokenizer as Qwen2Tokenizer from the vocabulary and merges
    Qwen2Config(vocab_size=len(bpe), hidden_size=64, num_hidden_layers=1).save_pretrained(tmp_path)
    bpe.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        assert loaded(text, add_special_tokens=False).input_ids == bpe(text, add_special_tokens=False).input_ids
    assert type(loaded).__name__ == "Qwen2Tokenizer" and len(loaded) == len(bpe)
    assert (loaded.eos_token_id, loaded.chat_template) == (bpe.eos_token_id, bpe.chat_template)


EXPECTED = {
    "chatml": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+3?<|im_end|>\n"
    "<|im_start|>assistant\n5<|im_end|>\n<|im_start|>user\n4+4?<|im_end|>\n<|im_start|>assistant\n",
    "llama3": "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\n2+3?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n5"
    "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n4+4?<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "gemma": "<bos><start_of_turn>user\nBe brief.\n\n2+3?<end_of_turn>\n<start_of_turn>model\n5<end_of_turn>\n"
    "<start_of_turn>user\n4+4?<end_of_turn>\n<start_of_turn>model\n",
}


@pytest.mark.parametrize("name", CHAT_FORMATS)
def test_multi_turn_render_is_the_format_and_turns_end_with_the_eos(name):
    tok = train_bpe(name, vocab_size=512)
    assert tok.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=False) == EXPECTED[name]
    closed = tok.apply_chat_template(CONVERSATION[:3], tokenize=False)
    # the assistant turn's text is followed by the eos token: an engine that stops on eos ends the turn there
    assert closed.split("5", 1)[1].startswith(tok.eos_token)
    assert chat_template(name) == load_chat_template(name) and name in SHIPPED


@pytest.mark.parametrize("name", CHAT_FORMATS)
def test_tool_calls_and_results_render(name):
    tok = train_bpe(name, vocab_size=512)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "add", "arguments": '{"a": 2}'}}]},
        {"role": "tool", "content": "5"},
    ]
    text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>' in text
    assert '"name": "add", "parameters"' in text  # the tool list
    assert "5" in text.split("</tool_call>")[-1]


def test_unknown_format_is_rejected_by_name():
    with pytest.raises(ValueError, match="chatml, llama3, gemma"):
        train_bpe("vicuna")


def test_production_vocabulary_is_tekken_with_the_chat_format():
    tok = production_tokenizer("chatml")
    assert len(tok) == 131_072 + 3
    text = "Hello, world! The sum of 123 and 456 is 579.\n"
    ids = tok(text, add_special_tokens=False).input_ids
    assert tok.decode(ids) == text and len(ids) < len(text) / 2  # a real vocabulary: words are single tokens
    assert tok("<|im_end|>", add_special_tokens=False).input_ids == [tok.eos_token_id] == [131_074]
