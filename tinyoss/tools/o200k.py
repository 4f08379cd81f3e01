"""Build the o200k_harmony tokenizer files of the gpt-oss repos offline, from the vendored ranks.

    python -m tinyoss.tools.o200k OUT_FOLDER

The conversion is the standard tiktoken -> Hugging Face one (what transformers'
`TikTokenConverter` does): byte-level BPE whose merges are every split of a token into two
tokens, ordered by the rank of the result; the o200k regex splits words first. Only
`tokenizers` is needed. The result is built once (a few seconds) and cached.

Like the published tokenizer.json, ours holds 199,998 BPE tokens plus the 21 special tokens
199998..200018 (200,019 entries). Ids 200019..201087 exist only as embedding rows: they are
never produced by encoding, and `tinyoss.tokenizer.Tokenizer` decodes them as
`<|reserved_N|>` itself, so a folder written here and a real checkpoint behave the same.
"""

from __future__ import annotations

import argparse
import base64
import gzip
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

from tinyoss.tokenizer import SPECIAL_NAMES, VOCAB_SIZE, byte_to_unicode

log = logging.getLogger("tinyoss")

RANKS_FILE = Path(__file__).resolve().parent.parent / "data" / "o200k_base.tiktoken.gz"
RANKS_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
NUM_BPE_TOKENS = 199_998
CACHE_NAME = "o200k_harmony-v1"
FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

# tiktoken's o200k_base `pat_str`, verbatim (the alternatives are joined with "|").
PAT_STR = "|".join(
    [
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"""
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"""
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

FIRST_UNLISTED_ID = 200_019  # the published tokenizer.json stops here

SPECIAL_TOKENS_MAP = {
    "bos_token": "<|startoftext|>",
    "eos_token": "<|return|>",
    "pad_token": "<|endoftext|>",
}


def special_token_name(token_id: int) -> str:
    """The harmony name of a special id (199998..201087)."""
    if not NUM_BPE_TOKENS <= token_id < VOCAB_SIZE:
        raise ValueError(f"{token_id} is not a special id of o200k_harmony")
    return SPECIAL_NAMES.get(token_id, f"<|reserved_{token_id}|>")


def load_ranks(path: Path = RANKS_FILE) -> dict[bytes, int]:
    """The o200k_base mergeable ranks; the checksum guards against a damaged vendored file."""
    raw = gzip.decompress(path.read_bytes())
    digest = hashlib.sha256(raw).hexdigest()
    if digest != RANKS_SHA256:
        raise ValueError(f"{path}: sha256 {digest}, expected {RANKS_SHA256}")
    ranks = {}
    for line in raw.splitlines():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    if sorted(ranks.values()) != list(range(NUM_BPE_TOKENS)):
        raise ValueError(f"{path}: ranks are not 0..{NUM_BPE_TOKENS - 1}")
    return ranks


def bpe_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Every split of a token into two tokens, in tiktoken's merge order.

    tiktoken merges the adjacent pair whose concatenation has the lowest rank, so a merge's
    priority is the rank of its result; splits of one token are ordered by their parts' ranks.
    """
    merges: list[tuple[bytes, bytes]] = []
    for token in sorted(ranks, key=ranks.__getitem__):
        splits = [
            (ranks[token[:i]], ranks[token[i:]], i)
            for i in range(1, len(token))
            if token[:i] in ranks and token[i:] in ranks
        ]
        merges.extend((token[:i], token[i:]) for _, _, i in sorted(splits))
    return merges


def build_tokenizer(ranks: dict[bytes, int]) -> HFTokenizer:
    """The o200k_harmony `tokenizers.Tokenizer` (BPE + the 21 published special tokens)."""
    table = byte_to_unicode()

    def text(token: bytes) -> str:
        return "".join([table[b] for b in token])

    vocab = {text(token): rank for token, rank in ranks.items()}
    merges = [(text(a), text(b)) for a, b in bpe_merges(ranks)]
    tok = HFTokenizer(BPE(vocab, merges, fuse_unk=False, ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PAT_STR), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens(
        [
            AddedToken(special_token_name(i), normalized=False, special=True)
            for i in range(NUM_BPE_TOKENS, FIRST_UNLISTED_ID)
        ]
    )
    return tok


def tokenizer_config() -> dict[str, object]:
    """tokenizer_config.json as published in the gpt-oss repos (GPTOSS.md 4b)."""
    added = {
        str(i): {
            "content": special_token_name(i),
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i in range(NUM_BPE_TOKENS, FIRST_UNLISTED_ID)
    }
    return {
        "added_tokens_decoder": added,
        "bos_token": SPECIAL_TOKENS_MAP["bos_token"],
        "clean_up_tokenization_spaces": False,
        "eos_token": SPECIAL_TOKENS_MAP["eos_token"],
        "extra_special_tokens": {},
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": int(1e30),
        "pad_token": SPECIAL_TOKENS_MAP["pad_token"],
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def _write_fresh(folder: Path) -> None:
    build_tokenizer(load_ranks()).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    (folder / "special_tokens_map.json").write_text(json.dumps(SPECIAL_TOKENS_MAP, indent=2) + "\n")


def cache_root() -> Path:
    return Path(os.environ.get("TINYOSS_CACHE", Path.home() / ".cache" / "tinyoss"))


def tokenizer_dir() -> Path:
    """The cached folder of tokenizer files, built on first use.

    Racing processes each build into a temp folder and rename it; the loser's copy is dropped,
    so readers never see a half-written folder.
    """
    target = cache_root() / CACHE_NAME
    if _complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("building the o200k tokenizer files into %s: first use only", target)
    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{CACHE_NAME}-"))
    try:
        _write_fresh(tmp)
        log.info("built the tokenizer in %.1f s", time.perf_counter() - t0)
        tmp.rename(target)
    except OSError:
        if not _complete(target):
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in FILES)


def write_tokenizer_files(folder: Path) -> None:
    """Copy tokenizer.json, tokenizer_config.json and special_tokens_map.json into `folder`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    source = tokenizer_dir()
    for name in FILES:
        shutil.copyfile(source / name, folder / name)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m tinyoss.tools.o200k",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("out", type=Path, help="folder to write the tokenizer files into")
    write_tokenizer_files(p.parse_args(argv).out)


if __name__ == "__main__":
    main()
