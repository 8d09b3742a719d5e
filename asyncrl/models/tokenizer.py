"""A character-level tokenizer that is a real `PreTrainedTokenizerFast`.

Every character of the alphabet is one token, so transformers, vLLM and our reward code see exactly
the same ids. It is saved next to the model with `save_pretrained` and reloaded with `AutoTokenizer`.
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
    """Return a PreTrainedTokenizerFast with one token per character of `alphabet` (plus 4 specials)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if len(set(alphabet)) != len(alphabet):
        raise ValueError("alphabet has repeated characters")
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({ch: len(SPECIAL_TOKENS) + i for i, ch in enumerate(alphabet)})
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
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
