"""o200k_harmony: ids equal tiktoken's, the files load in transformers, streaming text is exact."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tinyoss import tokenizer as T
from tinyoss.tokenizer import IncrementalDetokenizer, Tokenizer
from tinyoss.tools import o200k

TEXTS = [
    "Hello, world! I'm sure they're fine; we'll see. DON'T PANIC, it's O'Neil's.",
    "def f(x: int) -> int:\n    return x ** 2  # square\n\n\n\tif x != 0: pass\r\n",
    "日本語のテキストと中文文本，还有한국어 텍스트。",
    "emoji 😀🎉👩‍👩‍👧 flags 🇫🇷🇯🇵 and 🧑🏽‍💻 mixed with text",
    "numbers 1234567 3.14159 -42 1e10 0x1F 2024-06-01 12:30",
    "whitespace     runs \n\n\n   \t\t  trailing   ",
    "Ünïcödé ÀÉÎÕÜ ß ﬁ Ωμέγα Привет мир עברית العربية हिन्दी",
    "<|start|>user<|message|>not special when typed<|end|>",
    '  leading spaces, https://example.com/a/b?c=d&e=f#g, {"json": [1, 2, null]}',
    "",
]

RESERVED = 201_000


def fuzz_texts(n: int, seed: int) -> list[str]:
    """Random strings over ASCII, scripts, combining marks, emoji and random code points."""
    rng = random.Random(seed)
    alphabet = list("abcXYZ019 \n\t\r'\".,;:!?()[]{}<>|/\\-_=+*&^%$#@~`")
    alphabet += list("日本語中文한국어éüßñΩπЖ😀🎉\u0301\u200b\u00a0\u3000") + ["👩‍💻", "🇫🇷"]
    alphabet += [chr(rng.randrange(0x20, 0xD800)) for _ in range(200)]
    return ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 40))) for _ in range(n)]


def no_broken_chars(text: str) -> bool:
    return "\ufffd" not in text and not any(0xD800 <= ord(c) <= 0xDFFF for c in text)


@pytest.fixture(scope="module")
def folder() -> Path:
    return o200k.tokenizer_dir()


@pytest.fixture(scope="module")
def tok(folder: Path) -> Tokenizer:
    return Tokenizer.from_folder(folder)


@pytest.fixture(scope="module")
def hf(folder: Path):
    """transformers' tokenizer of the same files (what vLLM reads a prompt with)."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(folder))


@pytest.fixture(scope="module")
def harmony_spec() -> dict:
    """tiktoken's own o200k_harmony definition, fed the vendored ranks instead of a download."""
    pytest.importorskip("tiktoken")
    import tiktoken_ext.openai_public as openai_public

    ranks = o200k.load_ranks()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(openai_public, "load_tiktoken_bpe", lambda *args, **kwargs: ranks)
        return openai_public.o200k_harmony()


@pytest.fixture(scope="module")
def tiktoken_enc(harmony_spec: dict):
    import tiktoken

    return tiktoken.Encoding(**harmony_spec)


def test_definition_matches_tiktoken(harmony_spec: dict) -> None:
    assert o200k.PAT_STR == harmony_spec["pat_str"]
    for name, token_id in harmony_spec["special_tokens"].items():
        if name != f"<|reserved_{token_id}|>":  # 200018 has two names; ours is <|endofprompt|>
            assert o200k.special_token_name(token_id) == name


def test_ids_match_tiktoken(tok: Tokenizer, tiktoken_enc) -> None:
    for text in TEXTS + fuzz_texts(400, seed=0):
        assert tok.encode(text) == tiktoken_enc.encode_ordinary(text), text


def test_tokenizer_json_equals_transformers_converter(folder: Path, tmp_path: Path) -> None:
    """The file is exactly what transformers' TikTokenConverter writes from the same ranks."""
    pytest.importorskip("tiktoken")
    converter = pytest.importorskip("transformers.convert_slow_tokenizer")
    import gzip

    ranks_file = tmp_path / "o200k_base.tiktoken"
    ranks_file.write_bytes(gzip.decompress(o200k.RANKS_FILE.read_bytes()))
    names = [o200k.special_token_name(i) for i in range(o200k.NUM_BPE_TOKENS, 200_019)]
    reference = converter.TikTokenConverter(
        vocab_file=str(ranks_file), pattern=o200k.PAT_STR, extra_special_tokens=names
    ).converted()
    assert json.loads(reference.to_str()) == json.loads((folder / "tokenizer.json").read_text())


def test_transformers_autotokenizer_loads_folder(hf, tok: Tokenizer) -> None:
    assert len(hf) == 200_019
    assert (hf.bos_token, hf.eos_token, hf.pad_token) == (
        "<|startoftext|>",
        "<|return|>",
        "<|endoftext|>",
    )
    raw = ["a<|call|>b<|return|>", "<|start|>", "<|reserved_200013|>x", "<|end|><|start|>"]
    for text in TEXTS + raw:
        # transformers reads typed special-token names as those tokens (a raw prompt, as
        # vLLM reads it: `encode_prompt`); `encode` (chat content) keeps them text
        assert hf.encode(text, add_special_tokens=False) == tok.encode_prompt(text)
        if "<|" not in text:
            assert tok.encode(text) == tok.encode_prompt(text)
    assert hf.convert_tokens_to_ids("<|start|>") == T.START


def test_every_special_name_in_a_prompt_reads_as_transformers_reads_it(hf, tok: Tokenizer) -> None:
    """A typed special-token name, for each of the 1,090 ids 199998..201087: the names the
    tokenizer.json lists (199998..200018, <|reserved_200013|> among them, as in openai/gpt-oss-
    20b's) are those tokens in a raw prompt; <|reserved_200019|> and later name ids the file
    does not list, which transformers (and so vLLM) reads as plain text. `encode_prompt` (text
    prompts of LLM.generate and completions) and the facade's `encode` read them alike."""
    facade = T.HFTokenizerFacade(tok, lambda *args, **kwargs: [])
    names = {i: o200k.special_token_name(i) for i in range(o200k.NUM_BPE_TOKENS, T.VOCAB_SIZE)}
    names[-1] = "<|reserved_200018|>"  # 200018's name in tiktoken, not in the tokenizer.json
    for i, name in names.items():
        text = f"a{name}b"
        ids = tok.encode_prompt(text)
        assert ids == facade.encode(text) == hf.encode(text, add_special_tokens=False), name
        if o200k.NUM_BPE_TOKENS <= i < o200k.FIRST_UNLISTED_ID:
            assert ids == [tok.encode("a")[0], i, tok.encode("b")[0]], name
        else:
            assert ids == tok.encode(text) and not any(map(tok.is_special, ids)), name
    assert tok.encode_prompt("<|reserved_200013|>") == [200013]
    assert len(tok.encode_prompt("<|reserved_200019|>")) == 8


def test_raw_prompts_name_special_tokens(tok: Tokenizer) -> None:
    text = "<|start|>user<|message|>hi<|end|><|start|>assistant"
    assert tok.split_special(text) == [T.START, "user", T.MESSAGE, "hi", T.END, T.START,
                                       "assistant"]
    assert tok.encode_prompt(text) == [200006, 1428, 200008, 3686, 200007, 200006, 173781]
    assert tok.split_special("") == [""] and tok.encode_prompt("") == []
    assert tok.split_special("<|start") == ["<|start"]  # half a name is text
    # an id past the published file's list has no name to type: text, as in transformers
    assert not any(tok.is_special(i) for i in tok.encode_prompt("<|reserved_201000|>"))


def test_written_files(tmp_path: Path) -> None:
    o200k.write_tokenizer_files(tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt" / "tokenizer_config.json").read_text())
    added = config["added_tokens_decoder"]
    assert list(added) == [str(i) for i in range(199_998, 200_019)]
    assert added["200006"] == {
        "content": "<|start|>",
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": True,
    }
    assert added["200018"]["content"] == "<|endofprompt|>"
    assert added["200013"]["content"] == "<|reserved_200013|>"
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["model_max_length"] == 1000000000000000019884624838656
    assert (config["bos_token"], config["eos_token"], config["pad_token"]) == (
        "<|startoftext|>",
        "<|return|>",
        "<|endoftext|>",
    )
    special_map = json.loads((tmp_path / "ckpt" / "special_tokens_map.json").read_text())
    assert special_map == o200k.SPECIAL_TOKENS_MAP
    assert Tokenizer.from_folder(tmp_path / "ckpt").encode("hi") == [3686]


def test_cache_race_loser_keeps_winner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """If another process renames its build into place first, ours is dropped without error."""
    monkeypatch.setenv("TINYOSS_CACHE", str(tmp_path))
    target = tmp_path / o200k.CACHE_NAME

    def write(folder: Path, content: str) -> None:
        for name in o200k.FILES:
            (folder / name).write_text(content)

    def racing_write(folder: Path) -> None:
        write(folder, "ours")
        target.mkdir()
        write(target, "winner")

    monkeypatch.setattr(o200k, "_write_fresh", racing_write)
    assert o200k.tokenizer_dir() == target
    assert (target / "tokenizer.json").read_text() == "winner"
    assert [p.name for p in tmp_path.iterdir()] == [o200k.CACHE_NAME]


def test_harmony_message_ids(tok: Tokenizer) -> None:
    ids = [T.START, *tok.encode("user"), T.MESSAGE, *tok.encode("hi"), T.END]
    assert ids == [200006, 1428, 200008, 3686, 200007]
    assert tok.decode(ids) == "<|start|>user<|message|>hi<|end|>"
    assert tok.decode(ids, skip_special_tokens=True) == "userhi"


def test_typed_special_tokens_are_plain_text(tok: Tokenizer, tiktoken_enc) -> None:
    for text in ("<|start|>", "<|end|>", "<|return|>", "<|reserved_201000|>", "a<|call|>b"):
        ids = tok.encode(text)
        assert ids == tiktoken_enc.encode_ordinary(text)
        assert not any(tok.is_special(i) for i in ids)
        assert tok.decode(ids) == text


def test_special_ids(tok: Tokenizer) -> None:
    named = {
        T.STARTOFTEXT: "<|startoftext|>",
        T.ENDOFTEXT: "<|endoftext|>",
        T.RETURN: "<|return|>",
        T.CONSTRAIN: "<|constrain|>",
        T.CHANNEL: "<|channel|>",
        T.START: "<|start|>",
        T.END: "<|end|>",
        T.MESSAGE: "<|message|>",
        T.CALL: "<|call|>",
        T.ENDOFPROMPT: "<|endofprompt|>",
    }
    assert tok.vocab_size == T.VOCAB_SIZE == 201_088
    for i in range(o200k.NUM_BPE_TOKENS, T.VOCAB_SIZE):
        name = named.get(i, f"<|reserved_{i}|>")
        assert tok.is_special(i)
        assert tok.decode([i]) == tok.id_to_token(i) == name
        assert tok.token_to_id(name) == i
        assert tok.decode([i], skip_special_tokens=True) == ""
    assert tok.decode([3686, RESERVED, 3686]) == f"hi<|reserved_{RESERVED}|>hi"
    assert not tok.is_special(3686)


def test_ids_outside_vocab_raise(tok: Tokenizer) -> None:
    for bad in (T.VOCAB_SIZE, -1):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            tok.decode([bad])
        with pytest.raises(ValueError, match="outside the vocabulary"):
            tok.id_to_token(bad)


def test_bpe_token_lookups(tok: Tokenizer) -> None:
    assert tok.id_to_token(3686) == "hi"
    hello = tok.encode(" hello")
    assert len(hello) == 1 and tok.id_to_token(hello[0]) == "Ġhello"
    assert tok.token_to_id("Ġhello") == hello[0]
    assert tok.token_to_id("<|no such token|>") is None
    assert tok.token_bytes(hello[0]) == b" hello"


def test_round_trips(tok: Tokenizer, tiktoken_enc) -> None:
    for text in TEXTS + fuzz_texts(100, seed=1):
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert tok.decode_bytes(ids) == tiktoken_enc.decode_bytes(ids)


def test_decode_matches_hf_on_any_bytes(tok: Tokenizer, folder: Path) -> None:
    """Broken UTF-8 becomes U+FFFD exactly as in the tokenizers library (maximal subparts)."""
    from tokenizers import Tokenizer as HFTokenizer

    hf = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    byte_tokens = [tok.token_to_id(c) for c in T.byte_to_unicode()]
    assert [tok.token_bytes(i) for i in byte_tokens] == [bytes([b]) for b in range(256)]
    rng = random.Random(2)
    for _ in range(500):
        ids = [
            rng.choice(byte_tokens if rng.random() < 0.7 else range(200_019))
            for _ in range(rng.randrange(1, 12))
        ]
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=False), ids


def stream(tok: Tokenizer, ids: list[int], chunks: list[int], skip: bool = False) -> list[str]:
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    deltas, start = [], 0
    for size in chunks:
        deltas.append(detok.add(ids[start : start + size]))
        start += size
    assert start == len(ids)
    return deltas + [detok.flush()]


def random_chunks(n: int, rng: random.Random) -> list[int]:
    chunks = []
    while n > 0:
        chunks.append(min(n, rng.randrange(1, 5)))
        n -= chunks[-1]
    return chunks


def test_stream_never_splits_a_character(tok: Tokenizer) -> None:
    texts = TEXTS + ["🦩🫠🪿", "🧑🏽‍💻" * 3, "龘鱻㐀" * 2, "a𝄞b" * 4] + fuzz_texts(100, seed=3)
    split_chars = 0
    rng = random.Random(4)
    for text in texts:
        ids = tok.encode(text)
        split_chars += sum(1 for i in ids if not no_broken_chars(tok.decode([i])))
        for chunks in ([1] * len(ids), random_chunks(len(ids), rng)):
            deltas = stream(tok, ids, chunks)
            assert "".join(deltas) == tok.decode(ids) == text
            assert all(no_broken_chars(d) for d in deltas), deltas
    assert split_chars > 50  # the texts do exercise tokens that end inside a character


def test_stream_holds_back_partial_character(tok: Tokenizer) -> None:
    ids = tok.encode("🦩")
    assert [tok.token_bytes(i) for i in ids] == [b"\xf0\x9f", b"\xa6", b"\xa9"]
    detok = IncrementalDetokenizer(tok)
    assert [detok.add([i]) for i in ids] == ["", "", "🦩"]
    truncated = IncrementalDetokenizer(tok)
    assert truncated.add(ids[:1]) == ""
    assert truncated.flush() == "\ufffd" == tok.decode(ids[:1])


def test_stream_skip_special_tokens(tok: Tokenizer) -> None:
    ids = [
        T.START,
        *tok.encode("assistant"),
        T.CHANNEL,
        *tok.encode("final"),
        T.MESSAGE,
        *tok.encode("Ça va 😀"),
        RESERVED,
        T.RETURN,
    ]
    for skip in (False, True):
        deltas = stream(tok, ids, [1] * len(ids), skip=skip)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
    assert "".join(stream(tok, ids, [1] * len(ids), skip=True)) == "assistantfinalÇa va 😀"


def test_stream_of_random_ids_equals_decode(tok: Tokenizer) -> None:
    """A random model samples any id; the deltas still add up to decode (with U+FFFD)."""
    rng = random.Random(5)
    for _ in range(200):
        ids = [rng.randrange(T.VOCAB_SIZE) for _ in range(rng.randrange(1, 20))]
        for skip in (False, True):
            deltas = stream(tok, ids, random_chunks(len(ids), rng), skip=skip)
            assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)


def test_missing_tokenizer_json_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as err:
        Tokenizer.from_folder(tmp_path)
    assert str(tmp_path / "tokenizer.json") in str(err.value)
    assert "o200k_harmony" in str(err.value)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError) as err:
        Tokenizer.from_folder(tmp_path)
    assert str(tmp_path / "tokenizer.json") in str(err.value)


def test_pieces_encode_to_exactly_the_whole_texts_ids(tok: Tokenizer):
    """The server encodes long prompts piece by piece (yielding between pieces): the pieces'
    ids joined must be the text's ids, for any text and piece size."""
    rng = random.Random(5)
    words = ["hello", "world", "It's", "don't", "ABC", "  ", "\n", "\n\n", "x1", "éa", "WORLD's",
             "中文", "😀", "\t", "--", "a.b", "  q"]  # fmt: skip
    texts = fuzz_texts(60, seed=9) + [
        " ".join(rng.choice(words) for _ in range(rng.randint(50, 800))) for _ in range(60)
    ]
    cut = 0
    for text in texts:
        size = rng.randint(1, 120)
        pieces = list(tok.pieces(text, size))
        assert "".join(pieces) == text
        assert [i for p in pieces for i in tok.encode(p)] == tok.encode(text), (text, size)
        cut += len(pieces) > 1
    assert cut >= 50  # the long texts were cut somewhere
