import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.envs import add
from asyncrl.models.tokenizer import ADD_ALPHABET, ASCII_ALPHABET, build_char_tokenizer


def save_beside_qwen2_config(tokenizer, path):
    """A preset folder's tokenizer files and config.json (model_type qwen2: `AutoTokenizer` picks its class by it)."""
    from transformers import Qwen2Config

    Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=1).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def saved_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(save_beside_qwen2_config(build_char_tokenizer(), tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def saved_ascii_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    path = save_beside_qwen2_config(build_char_tokenizer(ASCII_ALPHABET), tmp_path_factory.mktemp("ascii"))
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


def test_special_token_strings_in_text_are_plain_characters(saved_ascii_tokenizer):
    tok = build_char_tokenizer(ASCII_ALPHABET)
    for t in (tok, saved_ascii_tokenizer):  # also after save_pretrained / AutoTokenizer
        ids = t("<eos>", add_special_tokens=False).input_ids
        assert len(ids) == 5 and t.eos_token_id not in ids


@settings(max_examples=50, deadline=None)
@given(st.text(alphabet=ASCII_ALPHABET, max_size=40) | st.sampled_from(["<pad>", "a<eos>b", "<bos><unk>", " a\nb"]))
def test_ascii_tokenizer_round_trips_any_printable_text(saved_ascii_tokenizer, text):
    built = build_char_tokenizer(ASCII_ALPHABET)
    ids = built(text, add_special_tokens=False).input_ids
    assert len(ids) == len(text) and built.decode(ids) == text
    # reloaded from a qwen2 model folder (as the learner, the controller and vLLM load it): the same ids and text
    assert saved_ascii_tokenizer(text, add_special_tokens=False).input_ids == ids
    assert saved_ascii_tokenizer.decode(ids) == text


def test_spaces_and_newlines_survive_a_reload_from_a_qwen2_folder(saved_ascii_tokenizer):
    # transformers 5.19 rebuilds a qwen2 folder's tokenizer as Qwen2Tokenizer from the vocabulary alone; a
    # character-level pipeline rebuilt that way encoded " a\nb" as "ab".
    tok = build_char_tokenizer(ASCII_ALPHABET)
    ids = saved_ascii_tokenizer(" a\nb", add_special_tokens=False).input_ids
    assert ids == [tok.convert_tokens_to_ids(c) for c in ("Ġ", "a", "Ċ", "b")] == [4, 69, 99, 70]
    assert saved_ascii_tokenizer.decode(ids) == " a\nb"


def test_text_outside_the_alphabet_encodes_to_nothing(saved_tokenizer):
    assert saved_tokenizer("1a2", add_special_tokens=False).input_ids == saved_tokenizer("12", add_special_tokens=False).input_ids


def test_a_folder_saved_by_the_character_level_build_is_re_saved(tmp_path):
    import json

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from asyncrl.models.tokenizer import SPECIAL_TOKENS, refresh_saved_tokenizer

    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS + tuple(ASCII_ALPHABET))}
    old = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    old.pre_tokenizer, old.decoder = pre_tokenizers.Split(Regex("."), behavior="isolated"), decoders.Fuse()
    save_beside_qwen2_config(PreTrainedTokenizerFast(tokenizer_object=old, unk_token="<unk>"), tmp_path)
    assert AutoTokenizer.from_pretrained(tmp_path)(" a\nb").input_ids == [69, 70]  # the quirk
    assert refresh_saved_tokenizer(tmp_path, ASCII_ALPHABET) and not refresh_saved_tokenizer(tmp_path, ASCII_ALPHABET)
    assert json.loads((tmp_path / "tokenizer.json").read_text())["model"]["type"] == "BPE"
    assert AutoTokenizer.from_pretrained(tmp_path)(" a\nb").input_ids == [4, 69, 99, 70]


def test_eos_is_dropped_when_decoding_with_skip_special_tokens(saved_tokenizer):
    ids = saved_tokenizer("579", add_special_tokens=False).input_ids + [saved_tokenizer.eos_token_id]
    assert saved_tokenizer.decode(ids, skip_special_tokens=True) == "579"


def test_chat_template_concatenates_message_contents(saved_tokenizer):
    text = saved_tokenizer.apply_chat_template([{"role": "user", "content": "1+2="}], add_generation_prompt=True, tokenize=False)
    assert text == "1+2="


def test_alphabet_with_repeats_or_non_ascii_is_rejected():
    with pytest.raises(ValueError, match="repeated"):
        build_char_tokenizer(ADD_ALPHABET + "1")
    with pytest.raises(ValueError, match="non-ASCII"):
        build_char_tokenizer(ADD_ALPHABET + "é")
