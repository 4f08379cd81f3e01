"""The o200k_harmony tokenizer of gpt-oss, and streaming detokenization.

Encoding runs in the Rust `tokenizers` library. Decoding goes through bytes: every id maps to
its raw bytes (byte-level BPE is lossless), and bytes become text with Python's UTF-8 decoder.
That makes `decode` and the streaming `IncrementalDetokenizer` agree by construction, and lets
ids that a published tokenizer.json does not list (200019..201087, model embedding rows only)
decode as `<|reserved_N|>` instead of vanishing. `HFTokenizerFacade` is the Hugging Face
tokenizer's surface that `LLM.get_tokenizer()` returns, as vLLM's does.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders

# Places where o200k's pre-tokenizer always starts a new piece, whatever surrounds them: an
# ASCII space between two ASCII letters (the next word takes the space as its prefix), or a
# letter after a newline (a word's prefix cannot be a newline). BPE never merges across them.
_CUTS = re.compile(r"(?<=[A-Za-z])(?= [A-Za-z])|(?<=\n)(?=[A-Za-z])")

VOCAB_SIZE = 201_088  # the model's embedding rows; every id below decodes

STARTOFTEXT = 199_998
ENDOFTEXT = 199_999
RETURN = 200_002
CONSTRAIN = 200_003
CHANNEL = 200_005
START = 200_006
END = 200_007
MESSAGE = 200_008
CALL = 200_012
ENDOFPROMPT = 200_018

SPECIAL_NAMES = {
    STARTOFTEXT: "<|startoftext|>",
    ENDOFTEXT: "<|endoftext|>",
    RETURN: "<|return|>",
    CONSTRAIN: "<|constrain|>",
    CHANNEL: "<|channel|>",
    START: "<|start|>",
    END: "<|end|>",
    MESSAGE: "<|message|>",
    CALL: "<|call|>",
    ENDOFPROMPT: "<|endofprompt|>",
}


def byte_to_unicode() -> list[str]:
    """GPT-2's printable stand-in for each byte, so byte-level tokens are valid JSON strings."""
    printable = {
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    }
    table = []
    extra = 0
    for b in range(256):
        if b in printable:
            table.append(chr(b))
        else:
            table.append(chr(256 + extra))
            extra += 1
    return table


class Tokenizer:
    """o200k_harmony: encode text, decode any id below the model's vocab size."""

    def __init__(self, hf: HFTokenizer) -> None:
        if not isinstance(hf.decoder, decoders.ByteLevel):
            raise ValueError(
                "expected a byte-level BPE tokenizer (o200k_harmony), "
                f"got decoder {type(hf.decoder).__name__}"
            )
        self._hf = hf
        self._hf.encode_special_tokens = True  # "<|start|>" typed by a user stays plain text
        listed = hf.get_vocab_size(with_added_tokens=True)
        self.vocab_size = max(listed, VOCAB_SIZE)
        self._special = {
            i: t.content for i, t in hf.get_added_tokens_decoder().items() if t.special
        }
        self._special.update((i, f"<|reserved_{i}|>") for i in range(listed, self.vocab_size))
        self._special_ids = {name: i for i, name in self._special.items()}
        # the names a raw prompt may spell its special tokens with: every token the
        # tokenizer.json adds, longest first, as transformers (and so vLLM) split them out
        added = {t.content: i for i, t in hf.get_added_tokens_decoder().items()}
        self._added = added
        self._added_re = re.compile("|".join(map(re.escape, sorted(added, key=len, reverse=True))))
        self._byte_of = {c: b for b, c in enumerate(byte_to_unicode())}
        self._bytes: dict[int, bytes] = {}

    @classmethod
    def from_folder(cls, folder: str | Path) -> Tokenizer:
        """Load `folder`/tokenizer.json, as found in a gpt-oss checkpoint."""
        path = Path(folder) / "tokenizer.json"
        hint = (
            "expected the o200k_harmony tokenizer.json of a gpt-oss checkpoint "
            "(`python -m tinyoss.tools.o200k FOLDER` writes one)"
        )
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: {hint}")
        try:
            hf = HFTokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises a bare Exception
            raise ValueError(f"{path} is not a readable tokenizer.json ({e}): {hint}") from e
        return cls(hf)

    def to_json(self) -> str:
        """The tokenizer.json text (what grammar libraries build their token tables from)."""
        return self._hf.to_str()

    def encode(self, text: str) -> list[int]:
        """BPE ids of `text`; special-token look-alikes in it are encoded as ordinary text."""
        return self._hf.encode(text, add_special_tokens=False).ids

    def split_special(self, text: str) -> list[str | int]:
        """`text` as plain-text runs and the ids of the special-token names in it
        ("a<|end|>b" -> ["a", 200007, "b"]): how a raw prompt (completions, `LLM.generate`) is
        read, as vLLM reads one. Chat content never goes through here: typed there, "<|end|>"
        stays text."""
        out: list[str | int] = []
        start = 0
        for m in self._added_re.finditer(text) if self._added else ():
            if m.start() > start:
                out.append(text[start : m.start()])
            out.append(self._added[m.group()])
            start = m.end()
        if start < len(text) or not out:
            out.append(text[start:])
        return out

    def encode_prompt(self, text: str) -> list[int]:
        """Ids of a raw prompt: `encode` of its text runs, its special-token names as those
        tokens (`split_special`)."""
        return [i for part in self.split_special(text)
                for i in ([part] if isinstance(part, int) else self.encode(part))]

    def encode_released(self, text: str) -> list[int]:
        """`encode`, releasing the GIL meanwhile (tokenizers' batch call does, its single call
        does not), so that another thread runs while a long text is encoded."""
        return self._hf.encode_batch([text], add_special_tokens=False)[0].ids

    @staticmethod
    def pieces(text: str, size: int) -> Iterator[str]:
        """`text` cut into pieces of about `size` characters that encode to exactly its ids
        when their ids are joined (cut only where `_CUTS` says); a run with no such place stays
        whole."""
        start = 0
        while len(text) - start > size:
            cut = _CUTS.search(text, start + size)
            if cut is None:
                break
            yield text[start : cut.start()]
            start = cut.start()
        yield text[start:]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`; bytes that are not valid UTF-8 become U+FFFD."""
        return self.decode_bytes(ids, skip_special_tokens).decode("utf-8", errors="replace")

    def decode_bytes(self, ids: Iterable[int], skip_special_tokens: bool = False) -> bytes:
        """Raw bytes of `ids` (a token may end inside a UTF-8 character)."""
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._special]
        return b"".join([self.token_bytes(i) for i in ids])

    def token_bytes(self, token_id: int) -> bytes:
        """Raw bytes of one token; a special token's bytes are its name."""
        cached = self._bytes.get(token_id)
        if cached is None:
            cached = self._bytes[token_id] = self._lookup_bytes(token_id)
        return cached

    def fill_byte_cache(self) -> None:
        """Looks up every token's bytes now (under a second) rather than on first use: a server
        does it at start-up, so its first burst of traffic detokenizes as fast as later ones.
        Nothing to do when a server before filled it (the tokenizer is shared, `load_tokenizer`)."""
        if len(self._bytes) == self.vocab_size:
            return
        for token_id in range(self.vocab_size):
            self.token_bytes(token_id)

    def _lookup_bytes(self, token_id: int) -> bytes:
        token = self.id_to_token(token_id)
        if token_id in self._special:
            return token.encode()
        try:
            return bytes([self._byte_of[c] for c in token])
        except KeyError:  # an added non-special token is stored as plain text
            return token.encode()

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special

    def token_to_id(self, token: str) -> int | None:
        """Id of a special token name or a byte-level BPE token string ("Ġhello"); else None."""
        special = self._special_ids.get(token)
        return special if special is not None else self._hf.token_to_id(token)

    def id_to_token(self, token_id: int) -> str:
        """Special token name or byte-level BPE token string of `token_id`."""
        token = self._special.get(token_id)
        if token is None and token_id >= 0:
            token = self._hf.id_to_token(token_id)
        if token is None:
            raise ValueError(
                f"token id {token_id} is outside the vocabulary (0..{self.vocab_size - 1})"
            )
        return token


class IncrementalDetokenizer:
    """Streams text for token ids as they come, O(new tokens) a call.

    Bytes go through an incremental UTF-8 decoder, so a character split across tokens (emoji,
    CJK) is held back until complete, and the deltas add up to `Tokenizer.decode` exactly.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, ids: Iterable[int]) -> str:
        """The new text that `ids` complete."""
        return self._utf8.decode(self._tokenizer.decode_bytes(ids, self._skip_special_tokens))

    def flush(self) -> str:
        """What is left at the end of the stream (U+FFFD for an unfinished character)."""
        return self._utf8.decode(b"", final=True)


# Hugging Face's tokenization options, taken at the values that ask for nothing (None, False,
# empty): a prompt is never padded or cut here, and ids come as lists, not tensors
_HF_INERT = ("documents", "padding", "truncation", "max_length", "return_tensors",
             "return_assistant_tokens_mask", "sanitize_control_tokens", "tokenizer_kwargs")


class Encoding(dict):
    """Hugging Face's BatchEncoding, as far as code reads it: `enc.input_ids` or
    `enc["input_ids"]`, and `attention_mask`."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class HFTokenizerFacade:
    """What `LLM.get_tokenizer()` returns: the surface of the Hugging Face tokenizer that
    vLLM's `get_tokenizer()` gives (`encode`, `decode`, calling it, `apply_chat_template`,
    `eos_token_id`, `convert_ids_to_tokens`, `len`), so code written for vLLM runs unchanged.

    Why not transformers' own tokenizer: its `apply_chat_template` renders gpt-oss's Jinja
    template, which is not the harmony prompt `LLM.chat` runs (tests/test_harmony.py pins
    where they differ). Chats are rendered here by `render_chats`, `LLM.chat`'s own renderer,
    so `generate` of a prompt made here runs what `chat` runs. Text is read as `generate` reads
    a prompt: special-token names ("<|start|>") are those tokens. gpt-oss has no BOS:
    `add_special_tokens` adds nothing. A custom `chat_template` is refused."""

    # as every gpt-oss checkpoint's tokenizer_config.json names them
    bos_token, eos_token, pad_token = "<|startoftext|>", "<|return|>", "<|endoftext|>"
    bos_token_id, eos_token_id, pad_token_id = STARTOFTEXT, RETURN, ENDOFTEXT

    def __init__(self, tokenizer: Tokenizer,
                 render_chats: Callable[..., list[list[int]]]) -> None:
        """`render_chats(conversation or list of them, **options)`: each one's prompt ids."""
        self.tokenizer, self._render_chats = tokenizer, render_chats

    @property
    def vocab_size(self) -> int:
        """The BPE vocabulary, without the added (special) tokens, as Hugging Face counts it."""
        return self.tokenizer._hf.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        """Every token the tokenizer lists, the special ones too (the model's embedding has
        rows up to `Tokenizer.vocab_size`, which decode as `<|reserved_N|>`)."""
        return self.tokenizer._hf.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self.tokenizer._hf.get_vocab(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True, **options: Any) -> list[int]:
        _inert("encode", options)
        return self.tokenizer.encode_prompt(text)

    def __call__(self, text: str | list[str], add_special_tokens: bool = True,
                 **options: Any) -> Encoding:
        _inert("the tokenizer's call", options)
        ids = ([self.encode(t) for t in text] if isinstance(text, (list, tuple))
               else self.encode(text))
        return _encoding(ids)

    def decode(self, token_ids: int | Sequence[int] | Sequence[Sequence[int]],
               skip_special_tokens: bool = False) -> str | list[str]:
        if hasattr(token_ids, "tolist"):  # a tensor or an array
            token_ids = token_ids.tolist()
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        if token_ids and not isinstance(token_ids[0], int):  # a batch, as transformers 5's
            return self.batch_decode(token_ids, skip_special_tokens)
        return self.tokenizer.decode(token_ids, skip_special_tokens)

    def batch_decode(self, sequences: Sequence[Sequence[int]],
                     skip_special_tokens: bool = False) -> list[str]:
        return [self.tokenizer.decode(ids, skip_special_tokens) for ids in sequences]

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | list[str]:
        if isinstance(ids, int):
            return self.tokenizer.id_to_token(ids)
        return [self.tokenizer.id_to_token(i) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            return self.tokenizer.token_to_id(tokens)
        return [self.tokenizer.token_to_id(t) for t in tokens]

    def apply_chat_template(
        self,
        conversation: list[dict] | list[list[dict]],
        tools: list[dict] | None = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        tokenize: bool = True,
        return_dict: bool = False,
        **kwargs: Any,
    ) -> str | list[int] | Encoding | list:
        """A conversation (or a list of them) as `LLM.chat` renders it: its prompt ids, or
        with `tokenize=False` its text (which reads as the same ids, unless a message's content
        spells a special-token name: the ids keep that text, the text makes it the token).
        Defaults as Hugging Face's: no generation prompt unless `add_generation_prompt=True`,
        ids as a list (`return_dict=True`: an Encoding). Other keywords are the template's, as
        `LLM.chat`'s `chat_template_kwargs` (`reasoning_effort`, `model_identity`);
        `chat_template_kwargs` itself is taken too, as vLLM spells them."""
        if chat_template is not None:
            raise ValueError("chat_template is not supported: tinyoss renders gpt-oss's harmony "
                             "format itself, not a Jinja template; render the prompt your own "
                             "way and give its text or ids to generate")
        _inert("apply_chat_template", {k: kwargs.pop(k) for k in _HF_INERT if k in kwargs})
        options = {**(kwargs.pop("chat_template_kwargs", None) or {}), **kwargs}
        prompts = self._render_chats(
            conversation, tools=tools, chat_template_kwargs=options,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message)
        out = prompts if tokenize else [self.decode(ids) for ids in prompts]
        if isinstance(conversation[0], dict):  # one conversation, not a batch
            out = out[0]
        return _encoding(out) if tokenize and return_dict else out


def _encoding(ids: list[int] | list[list[int]]) -> Encoding:
    mask = [[1] * len(i) for i in ids] if ids and isinstance(ids[0], list) else [1] * len(ids)
    return Encoding(input_ids=ids, attention_mask=mask)


def _inert(where: str, options: dict[str, Any]) -> None:
    """Raises where an option asks for what the facade does not do."""
    for name, value in options.items():
        if name not in _HF_INERT:
            raise TypeError(f"{where} got an unexpected keyword argument {name!r}")
        if not (value is None or value is False or value in ([], {})):
            raise ValueError(f"{where}: {name}={value!r} is not supported: tinyoss tokenizes a "
                             "prompt as it is (no padding, truncation, tensors or documents); "
                             "leave it out")
