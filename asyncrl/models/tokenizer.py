"""A character-level tokenizer that is a real `PreTrainedTokenizerFast`.

Every character of the alphabet is one token, so transformers, vLLM and our reward code see exactly
the same ids. It is saved next to the model with `save_pretrained` and reloaded with `AutoTokenizer`.

It is built as Qwen2's tokenizer with no merges: Qwen2's normalizer, split regex and byte-level pre-tokenizer and
decoder, over a vocabulary of the alphabet's characters in byte-level form (space is `Ġ`, newline `Ċ`). For a
`qwen2` model folder `AutoTokenizer` ignores the saved pipeline and rebuilds the tokenizer as `Qwen2Tokenizer`
from the vocabulary and merges alone (transformers 5.19 lists `qwen2` in `MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS`),
and so does vLLM, which loads tokenizers with `AutoTokenizer`; this build is what that rebuild gives, so every
loader encodes and decodes alike. (A character-level pipeline rebuilt that way dropped every space and newline.)
"""

from __future__ import annotations

ADD_ALPHABET = "0123456789+="
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")  # ids 0..3
# The `calc` agent task: sums, tool calls `[...]`, observations `=1368;` and `=?;` for a failed call
# (`;`, not a newline: the character pre-tokenizer's `.` does not match one).
CALC_ALPHABET = ADD_ALPHABET + "-*[]?;"
# A wider alphabet for user prompts in chat form (printable ASCII and newline).
ASCII_ALPHABET = "".join(chr(c) for c in range(32, 127)) + "\n"

CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def build_char_tokenizer(alphabet: str = ADD_ALPHABET):
    """Return a PreTrainedTokenizerFast with one token per character of `alphabet` (plus 4 specials); the
    alphabet is ASCII (one byte per character). Text outside the alphabet encodes to nothing."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    from asyncrl.models.bpe import qwen2_pre_tokenizer

    if len(set(alphabet)) != len(alphabet):
        raise ValueError("alphabet has repeated characters")
    if not alphabet.isascii():
        raise ValueError(f"alphabet has non-ASCII characters: {sorted(set(alphabet) - set(map(chr, range(128))))}")
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({byte_level(ch): len(SPECIAL_TOKENS) + i for i, ch in enumerate(alphabet)})
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    core.normalizer = normalizers.NFC()
    core.pre_tokenizer = qwen2_pre_tokenizer()
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
        # Text is only ever characters: a prompt that contains "<eos>" gets 5 tokens, not the EOS id
        # (no special-token injection from data). Specials are added as ids by the code that needs them.
        split_special_tokens=True,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def byte_level(char: str) -> str:
    """The byte-level (GPT-2) form of an ASCII character: itself when printable, else a stand-in (" " is "Ġ")."""
    from tokenizers import pre_tokenizers

    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str(char)[0][0]


def refresh_saved_tokenizer(model_dir, alphabet: str) -> bool:
    """Re-save the char tokenizer of a preset folder saved by an older build (a character-level `WordLevel`
    vocabulary, which `AutoTokenizer` reloads as a `Qwen2Tokenizer` that drops spaces and newlines). The ids do not
    change, so the weights stay valid. True when it rewrote the files."""
    import json
    from pathlib import Path

    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file() or json.loads(path.read_text())["model"]["type"] != "WordLevel":
        return False
    build_char_tokenizer(alphabet).save_pretrained(model_dir)
    return True
