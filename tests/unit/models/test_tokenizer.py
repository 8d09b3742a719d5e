import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.envs import add
from asyncrl.models.tokenizer import ADD_ALPHABET, ASCII_ALPHABET, build_char_tokenizer


@pytest.fixture(scope="module")
def saved_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tok")
    build_char_tokenizer().save_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


def test_vocabulary_is_sixteen_tokens_with_fixed_special_ids(saved_tokenizer):
    tok = saved_tokenizer
    assert len(tok) == 16
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    # one token per character: "12+3=" -> ids of '1','2','+','3','='
    assert tok("12+3=", add_special_tokens=False).input_ids == [5, 6, 14, 7, 15]


def test_every_task_string_round_trips(saved_tokenizer):
    tok = saved_tokenizer
    pairs = add.heldout_pairs(500) + [(0, 0), (999, 999), (1, 999)]
    for a, b in pairs:
        for text in (add.prompt_text(a, b), str(a + b), add.prompt_text(a, b) + str(a + b)):
            ids = tok(text, add_special_tokens=False).input_ids
            assert len(ids) == len(text)
            assert tok.decode(ids) == text


def test_special_token_strings_in_text_are_plain_characters(saved_tokenizer):
    tok = build_char_tokenizer(ASCII_ALPHABET)
    for t in (tok, saved_tokenizer):  # also after save_pretrained / AutoTokenizer
        ids = t("<eos>", add_special_tokens=False).input_ids
        assert len(ids) == 5 and t.eos_token_id not in ids


@settings(max_examples=50, deadline=None)
@given(st.text(alphabet=ASCII_ALPHABET, max_size=40) | st.sampled_from(["<pad>", "a<eos>b", "<bos><unk>"]))
def test_ascii_tokenizer_round_trips_any_printable_text(text):
    tok = build_char_tokenizer(ASCII_ALPHABET)
    ids = tok(text, add_special_tokens=False).input_ids
    assert len(ids) == len(text) and tok.decode(ids) == text


def test_eos_is_dropped_when_decoding_with_skip_special_tokens(saved_tokenizer):
    ids = saved_tokenizer("579", add_special_tokens=False).input_ids + [saved_tokenizer.eos_token_id]
    assert saved_tokenizer.decode(ids, skip_special_tokens=True) == "579"


def test_chat_template_concatenates_message_contents(saved_tokenizer):
    text = saved_tokenizer.apply_chat_template([{"role": "user", "content": "1+2="}], add_generation_prompt=True, tokenize=False)
    assert text == "1+2="


def test_alphabet_with_repeats_is_rejected():
    with pytest.raises(ValueError, match="repeated"):
        build_char_tokenizer(ADD_ALPHABET + "1")
