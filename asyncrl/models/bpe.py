"""Byte-level BPE tokenizers with the chat formats asyncrl writes: ChatML (Qwen), Llama 3's headers, Gemma's turns.

`train_bpe` trains a small vocabulary with the `tokenizers` library on a corpus generated here (English-like text,
numbers, code, the built-in tasks' prompts, chat markup; nothing is downloaded), with Qwen2's pre-tokenizer: its
split regex, then byte-level. `production_tokenizer` converts Mistral's 131k-token tekken vocabulary, which the
`mistral_common` package (a vLLM dependency) ships, to a fast tokenizer. Either gets the chat format's special
tokens and template (`asyncrl/models/templates/<format>.jinja`); the format's end-of-turn token is the eos, so an
engine stops a model turn on it.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

CHAT_FORMATS: tuple[str, ...] = ("chatml", "llama3", "gemma")

# Qwen2's pre-tokenizer split (tokenizer.json of Qwen2/2.5): contractions, letters, single digits, punctuation
# runs, newlines, spaces.
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class ChatFormat:
    """A chat format's special tokens (in id order for a trained vocabulary) and which of them play which role."""

    specials: tuple[str, ...]
    eos: str
    pad: str
    unk: str
    bos: str | None
    roles: tuple[str, ...]


FORMATS: dict[str, ChatFormat] = {
    "chatml": ChatFormat(
        specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        eos="<|im_end|>",
        pad="<|endoftext|>",
        unk="<|endoftext|>",
        bos=None,
        roles=("system", "user", "assistant"),
    ),
    "llama3": ChatFormat(
        specials=("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
        eos="<|eot_id|>",
        pad="<|end_of_text|>",
        unk="<|end_of_text|>",
        bos="<|begin_of_text|>",
        roles=("system", "user", "assistant", "ipython"),
    ),
    "gemma": ChatFormat(
        specials=("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"),
        eos="<end_of_turn>",
        pad="<pad>",
        unk="<unk>",
        bos="<bos>",
        roles=("user", "model"),
    ),
}


def format_spec(name: str) -> ChatFormat:
    """The special tokens of a chat format; ValueError lists the formats."""
    if name not in FORMATS:
        raise ValueError(f"unknown chat format {name!r}; valid: {', '.join(CHAT_FORMATS)}")
    return FORMATS[name]


def chat_template(chat_format: str) -> str:
    """The jinja text of a chat format (asyncrl/models/templates/<name>.jinja)."""
    from asyncrl.models.templates import load_chat_template

    format_spec(chat_format)
    return load_chat_template(chat_format)


def train_bpe(
    chat_format: str = "chatml", vocab_size: int = 2048, extra_text: Iterable[str] = ()
) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer of `vocab_size` tokens (the format's specials first, then the 256 bytes, then
    merges) trained on the built-in corpus plus `extra_text`. Deterministic: the same arguments give the same vocab."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from tokenizers import pre_tokenizers as pre

    fmt = format_spec(chat_format)
    core = Tokenizer(models.BPE())
    core.normalizer = normalizers.NFC()
    core.pre_tokenizer = qwen2_pre_tokenizer()
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(fmt.specials),
        initial_alphabet=pre.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(_corpus(fmt, extra_text), trainer=trainer)
    return _wrap(core, chat_format)


def production_tokenizer(chat_format: str = "chatml") -> PreTrainedTokenizerFast:
    """Mistral's tekken vocabulary (`mistral_common/data/tekken_240911.json`: 131,072 ids, byte-level BPE, its own
    split regex) as a fast tokenizer, with the chat format's specials added after it. Converted once and cached
    under `asyncrl.models.cache_root()`."""
    from tokenizers import Tokenizer

    from asyncrl.models import cache_root, file_lock

    format_spec(chat_format)
    cached = cache_root() / "tokenizers" / "tekken_240911.json"
    with file_lock(cached.with_suffix(".lock")):
        if not cached.is_file():
            _convert_tekken(cached)
    return _wrap(Tokenizer.from_file(str(cached)), chat_format)


def qwen2_pre_tokenizer():
    from tokenizers import Regex
    from tokenizers import pre_tokenizers as pre

    return pre.Sequence(
        [pre.Split(Regex(QWEN2_SPLIT), behavior="isolated"), pre.ByteLevel(add_prefix_space=False, use_regex=False)]
    )


def _convert_tekken(out: Path) -> None:
    import mistral_common
    from transformers.integrations.mistral.tokenizer import MistralConverter

    source = Path(mistral_common.__file__).parent / "data" / "tekken_240911.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    MistralConverter(str(source)).converted().save(str(tmp))
    tmp.replace(out)


def _wrap(core, chat_format: str) -> PreTrainedTokenizerFast:
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    fmt = FORMATS[chat_format]
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in fmt.specials])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=fmt.eos,
        pad_token=fmt.pad,
        # set, so that transformers' Qwen2Tokenizer (what AutoTokenizer rebuilds a qwen2 folder's tokenizer as)
        # does not add its default `<|endoftext|>` to a vocabulary without one
        unk_token=fmt.unk,
        bos_token=fmt.bos,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = chat_template(chat_format)
    return tokenizer


# ---------------------------------------------------------------------------------------------------
# The built-in training corpus


_WORDS = (
    "the of and to in is that it for was on are as with his they at be this from have or by one had not but what "
    "all were when we there can an your which their said if do will each about how up out them then she many some "
    "so these would other into has more her two like him see time could no make than first been its who now people "
    "my made over did down only way find use may water long little very after words called just where most know "
    "answer question number sum total result tool call function value error model user assistant system think step "
    "compute add subtract multiply apples books coins train hours each more less left gave bought sold price cost"
).split()
_CODE = (
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
    "import json\n\ndata = json.loads(text)\nif data['ok']:\n    result = data.get('value', 0)\n",
    "class Point:\n    def __init__(self, x: int, y: int) -> None:\n        self.x = x\n        self.y = y\n",
    '{"name": "calculator", "arguments": {"expression": "12+34"}}',
    "while n > 0:\n    n -= 1  # count down\n\treturn [x for x in xs if x % 2 == 0]\n",
)


_SYLLABLES = tuple(
    c + v
    for c in (
        "",
        "b",
        "c",
        "d",
        "f",
        "g",
        "h",
        "k",
        "l",
        "m",
        "n",
        "p",
        "r",
        "s",
        "t",
        "v",
        "w",
        "st",
        "tr",
        "ch",
        "sh",
        "th",
    )
    for v in ("a", "e", "i", "o", "u", "ai", "ou", "ee")
)


def _lexicon(rng: random.Random, n: int = 4000) -> list[str]:
    """The English word list and `n` made-up words of 1-4 syllables (some with a consonant ending)."""
    made = [
        "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))) + rng.choice(("", "", "n", "s", "t", "ng"))
        for _ in range(n)
    ]
    return list(_WORDS) + made


def _sentence(rng: random.Random, lexicon: list[str]) -> str:
    # squaring the uniform draw favours the front of the lexicon (the real words): a skewed, Zipf-like frequency
    words = [lexicon[int(rng.random() ** 2 * len(lexicon))] for _ in range(rng.randint(4, 14))]
    if rng.random() < 0.3:
        words.insert(rng.randrange(len(words)), str(rng.randint(0, 10_000)))
    text = " ".join(words)
    return text[0].upper() + text[1:] + rng.choice((".", ".", "?", "!", ",", ":"))


def _task_text(rng: random.Random) -> str:
    """Text shaped like the built-in tasks (asyncrl.envs.add / calc; models sits below envs, so it is written here):
    `a+b=` sums, calculator calls `[a+b+c]` with observations `=n;`, templated word problems."""
    a, b, c = (rng.randint(0, 999) for _ in range(3))
    kind = rng.randrange(3)
    if kind == 0:
        return f"{a}+{b}={a + b}"
    if kind == 1:
        return f"{a}+{b}+{c}=[{a}+{b}+{c}]={a + b + c};{a + b + c}"
    name, item = rng.choice(("Ann", "Ben", "Cara", "Dan", "Eva", "Finn")), rng.choice(("apple", "book", "coin"))
    return f"{name} has {a} {item}s and gets {b} more. How many {item}s does {name} have now?\nAnswer: {a + b}"


def _corpus(fmt: ChatFormat, extra_text: Iterable[str]) -> Iterator[str]:
    rng = random.Random(0)
    lexicon = _lexicon(rng)
    for _ in range(3000):
        yield " ".join(_sentence(rng, lexicon) for _ in range(rng.randint(1, 4))) + rng.choice(("\n", "\n\n", " ", ""))
    for _ in range(1000):
        yield _task_text(rng)
    for i in range(60):
        yield _CODE[i % len(_CODE)]
    for _ in range(300):  # chat markup between the special tokens: role lines, newlines, tool blocks
        role = rng.choice(fmt.roles)
        yield (
            f"{role}\n\n{_sentence(rng, lexicon)}\n{role}\n<tool_call>\n"
            + '{"name": "f", "arguments": {}}\n</tool_call>\n'
        )
    yield from extra_text
