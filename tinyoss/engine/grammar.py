"""Structured outputs: a request's grammar turned into each step's token mask, by llguidance.

llguidance rather than xgrammar, by measurement at gpt-oss's 201,088-id vocabulary
(`bench/grammar_mask.py`): a matcher is ready in 0.2-5 ms where xgrammar compiles a schema in
14-61 ms (time every constrained request would wait before its first token), masks then take
4-15 us a token for both, and its Lark grammars take special tokens and embedded JSON schemas,
which is how a chat request's schema is confined to harmony's final channel
(`tinyoss/harmony_grammar.py`).

A `Matcher` follows one sequence: `GrammarCompiler.fill` writes the allowed next tokens of a
step's matchers as bit rows (32 ids an int32), `Matcher.consume` advances past each sampled
token. Rows are filled one after another: llguidance's thread pool (`LLExecutor`) measured
+77% ms/step at batch 32 on the H100 against +5% for this loop (bench/results/). The host
does this while the GPU runs the forward pass; the sampler applies the rows (`sampler.py`).
"""

from __future__ import annotations

import functools
import json
import re
import threading
from collections.abc import Callable

import torch

from tinyoss.sampling_params import StructuredOutputs
from tinyoss.tokenizer import Tokenizer

# JSON is written compactly apart from one space after ',' and ':' (as json.dumps does): no
# freedom to pad with whitespace, which a weak model can fill without end.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _llguidance():
    try:
        import llguidance
        import llguidance.torch
    except ImportError as e:  # a dependency of tinyoss: only a broken install lacks it
        raise RuntimeError(
            "structured outputs need llguidance: pip install 'llguidance>=1.6'"
        ) from e
    return llguidance


def json_schema_grammar(schema: dict | None, lenient: bool = False) -> dict:
    """`schema` (None: any JSON object) with tinyoss's JSON layout, for a `%json` block or a
    grammar of its own; `lenient` drops keywords llguidance cannot enforce instead of
    refusing them."""
    schema = dict(schema) if schema is not None else {"type": "object"}
    schema["x-guidance"] = {**JSON_OPTIONS, **({"lenient": True} if lenient else {})}
    return schema


def to_grammar(spec: StructuredOutputs) -> str:
    """The llguidance grammar of `spec`; ValueError naming what is wrong."""
    ll = _llguidance().LLMatcher
    if spec.json is not None or spec.json_object:
        schema = spec.json if not isinstance(spec.json, str) else _schema_text(spec.json)
        return ll.grammar_from_json_schema(json_schema_grammar(schema))
    if spec.regex is not None:
        return ll.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        return ll.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
    return ll.grammar_from_lark(_lark(spec.grammar))


# GBNF's \uXXXX and \UXXXXXXXX escapes (and an escaped backslash, to step over it)
_UNICODE_ESCAPE = re.compile(r"\\(\\|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8})")


def _plain_escape(m: re.Match) -> str:
    """A GBNF \\u or \\U escape as llguidance's converter reads it right: it drops the leading
    zeros (\\u00e9 became \\ue9, which no regex or Lark string takes, so valid GBNF was a 400).
    ASCII becomes \\xHH, kept as it is (it may be a quote, a bracket or a control character);
    other characters are written as themselves, which GBNF and Lark take in strings and
    classes alike. A surrogate, no character, is left for the converter to refuse."""
    if m[1] == "\\":
        return m[0]
    code = int(m[1][1:], 16)
    if code < 0x80:
        return f"\\x{code:02x}"
    if 0xD800 <= code < 0xE000 or code > 0x10FFFF:
        return m[0]
    return chr(code)


def _lark(grammar: str) -> str:
    """`grammar` in Lark: GBNF (`root ::= ...`, the dialect of vLLM's examples, which its
    backends take too) is converted by llguidance; Lark, told by its `start:` rule, is kept."""
    from llguidance.gbnf_to_lark import gbnf_to_lark, is_lark_syntax

    if "::=" not in grammar or is_lark_syntax(grammar):
        return grammar
    try:
        return gbnf_to_lark(_UNICODE_ESCAPE.sub(_plain_escape, grammar))
    except Exception as e:  # llguidance's GbnfToLarkError, which names the place
        raise ValueError(f"it reads as GBNF (rules `name ::= ...`, no Lark `start:` rule) but "
                         f"does not parse: {e}") from None


# llguidance's parser holds at most 2,000 items in a row: a choice of more strings fails at its
# first token, after seconds of building (64,000 strings: ~5 s of a CPU)
MAX_CHOICES = 1999


def check(spec: StructuredOutputs) -> None:
    """Raises ValueError with llguidance's own words when `spec` cannot be enforced (a schema
    keyword it does not implement, a bad regex, an unsatisfiable bound), and for a choice of
    more than MAX_CHOICES strings. Special tokens in a Lark grammar are checked later, against
    the tokenizer, when the engine builds a matcher."""
    if spec.choice is not None and len(spec.choice) > MAX_CHOICES:
        raise ValueError(f"the choice holds {len(spec.choice)} strings: the grammar engine "
                         f"follows at most {MAX_CHOICES}; give fewer, or a regex that covers "
                         "them")
    try:
        grammar = to_grammar(spec)
    except ValueError as e:
        raise ValueError(f"the {spec.kind} cannot be enforced: {e}") from None
    error, messages = _llguidance().LLMatcher.validate_grammar_with_warnings(grammar)
    if error:
        raise ValueError(f"the {spec.kind} cannot be enforced: {_plain(messages[0])}")
    if _matches_nothing(grammar):
        raise ValueError(f"the {spec.kind} matches no text at all, so no answer can follow it")


def _plain(why: str) -> str:
    """llguidance's reason, except an internal assertion (its Rust source's words, e.g. a
    choice of 100,000 strings overflowing a 16-bit symbol table), said as what it means."""
    if why.startswith("panic"):
        return "it is beyond the grammar engine's limits: make it smaller or simpler"
    return why


class _ByteVocabulary:
    """A vocabulary of the 256 bytes and an end token, for checks that need no real tokenizer."""

    eos_token_id, bos_token_id, special_token_ids = 256, None, [256]
    tokens = [bytes([b]) for b in range(256)] + [b"<end>"]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


@functools.cache
def _byte_tokenizer():
    ll = _llguidance()
    return ll.LLTokenizer(ll.TokenizerWrapper(_ByteVocabulary()))


def _matches_nothing(grammar: str) -> bool:
    """Whether `grammar` admits no text: at its start it can neither end nor take any byte
    (llguidance reduces an empty language, e.g. the regex [^\\s\\S], to a dead state). A grammar
    that names special tokens is not judged here (the byte vocabulary has none)."""
    m = _llguidance().LLMatcher(_byte_tokenizer(), grammar)
    if m.is_error() or m.is_accepting():  # (an empty mask makes the matcher an error too)
        return False
    return not any(m.compute_bitmask()[:32])  # bits of tokens 0-255 (the end token: 256)


def _schema_text(text: str) -> dict:
    try:
        schema = json.loads(text)
    except ValueError as e:
        raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError("the JSON schema must be a JSON object")
    return schema


class Matcher:
    """One sequence's position in its grammar."""

    def __init__(self, matcher) -> None:
        self._m = matcher
        self.allowed: torch.Tensor | None = None  # the last mask `fill` gave it (bit row)

    def copy(self) -> Matcher:
        """A matcher at the same position, for another sequence (n > 1)."""
        return Matcher(self._m.deep_copy())

    def consume(self, token: int) -> tuple[str, str] | None:
        """Advances past `token`; else (error code, reason). A token its last mask allowed
        that the parser still cannot take means the grammar is beyond llguidance's limits (a
        row of 50,000 alternatives; a regex of a million states), which only the sampled text
        reveals: the request's fault, "invalid_grammar". A token outside the mask is the
        engine's: "structured_output"."""
        if self._m.is_stopped() or self._m.consume_token(token):
            return None
        why = self._m.get_error() or f"token {token} is not allowed by the grammar"
        word = int(self.allowed[token >> 5]) if self.allowed is not None else 0
        if (word >> (token & 31)) & 1:  # (the first line: the rest dumps the whole grammar)
            return ("invalid_grammar", "the structured-output grammar is beyond what the "
                    f"grammar engine can follow ({why.splitlines()[0]}): make it smaller or "
                    "simpler")
        return ("structured_output", f"the output left its structured-output grammar: {why}")


class _Vocabulary:
    """tinyoss's tokenizer as llguidance's `TokenizerWrapper` sees one: every id's bytes, the
    special ids, and an encoder that keeps special-token look-alikes as text. llguidance writes
    a grammar's forced text ('<|end|>' inside a JSON string) with this encoder; built from the
    tokenizer.json instead, it wrote such text as the special token, which its parser then
    refused, so the schema's text could never be generated."""

    bos_token_id = None

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_id: int) -> None:
        tokenizer.fill_byte_cache()
        self.tokens = [tokenizer.token_bytes(i) for i in range(vocab_size)]
        self.special_token_ids = [i for i in range(vocab_size) if tokenizer.is_special(i)]
        self.eos_token_id, self._encode = eos_token_id, tokenizer.encode
        special = set(self.special_token_ids)
        self._byte_ids = {t: i for i, t in reversed(list(enumerate(self.tokens)))
                          if len(t) == 1 and i not in special}

    def __call__(self, text: bytes) -> list[int]:
        """Ids of `text`; a byte that is not UTF-8 (a character cut short) as its own token."""
        ids: list[int] = []
        while text:
            try:
                return ids + self._encode(text.decode("utf-8"))
            except UnicodeDecodeError as e:
                ids += self._encode(text[: e.start].decode("utf-8")) if e.start else []
                ids.append(self._byte_ids[text[e.start : e.start + 1]])
                text = text[e.start + 1 :]
        return ids


class GrammarCompiler:
    """Builds matchers for one tokenizer. The llguidance tokenizer takes ~1 s to build at this
    vocabulary: it is built on first use (the engine's warm-up uses it on the GPU)."""

    def __init__(
        self, tokenizer: Callable[[], Tokenizer], vocab_size: int, eos_token_ids: list[int]
    ) -> None:
        """`tokenizer`: gives the model's tokenizer when the first grammar needs it."""
        self._load, self.vocab_size, self._eos = tokenizer, vocab_size, eos_token_ids
        self._tokenizer = None
        self._lock = threading.Lock()

    @property
    def tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                ll = _llguidance()
                # one end token: where a grammar that is complete lets the output stop
                vocabulary = _Vocabulary(self._load(), self.vocab_size, self._eos[0])
                self._tokenizer = ll.LLTokenizer(
                    ll.TokenizerWrapper(vocabulary), n_vocab=self.vocab_size,
                    eos_token=self._eos[0],
                )
            return self._tokenizer

    def matcher(self, spec: StructuredOutputs) -> Matcher:
        """A matcher at the start of `spec`'s grammar; ValueError when it cannot be built."""
        m = _llguidance().LLMatcher(self.tokenizer, to_grammar(spec))
        if m.is_error():
            raise ValueError(f"the {spec.kind} cannot be enforced: {_plain(m.get_error())}")
        return Matcher(m)

    def fill(self, matchers: list[Matcher]) -> torch.Tensor:
        """The allowed next tokens of each matcher, a row of bits each (int32, on the host)."""
        fill = _llguidance().torch.fill_next_token_bitmask
        bits = torch.full((len(matchers), (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        for row, m in enumerate(matchers):
            fill(m._m, bits, row)
            m.allowed = bits[row]
        return bits
