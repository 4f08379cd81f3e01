"""Write a complete synthetic gpt-oss checkpoint folder in the Hugging Face layout.

    python -m tinyoss.tools.make_checkpoint tiny /tmp/tiny
    python -m tinyoss.tools.make_checkpoint gpt-oss-20b /tmp/20b --data sparse

Tensors stream to disk one at a time (a full-size model never sits in memory). Shards follow the
published convention: filled in index order up to 4.8 GB, named model-0000i-of-000(n-1).
`--data sparse` writes the real headers and leaves the data as holes in the file: a full-size
checkpoint then costs no disk and no time, for tests of the tensor inventory.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Iterable

import torch

from tinyoss.config import ModelConfig
from tinyoss.model.layout import TensorSpec, checkpoint_tensors
from tinyoss.model.presets import GENERATION_CONFIG, preset_config
from tinyoss.model.synthetic import synthetic_tensors
from tinyoss.progress import tensor_progress

log = logging.getLogger("tinyoss")

SHARD_BYTES = 4_800_000_000


def shard_plan(specs: list[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Sequential fill: a new shard starts when the next tensor would pass the cap."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


def _header(specs: list[TensorSpec]) -> bytes:
    entries: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in specs:
        entries[spec.name] = {
            "dtype": spec.dtype,
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    raw = json.dumps(entries, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)


def write_safetensors(
    path: Path, specs: list[TensorSpec], tensors: Iterable[tuple[TensorSpec, torch.Tensor]] | None
) -> None:
    """Stream `tensors` (in `specs` order) into a safetensors file; None leaves data as holes."""
    header = _header(specs)
    total = 8 + len(header) + sum(s.nbytes for s in specs)
    with open(path, "wb") as f:
        f.write(len(header).to_bytes(8, "little"))
        f.write(header)
        if tensors is None:
            f.truncate(total)
            return
        for spec, (got, tensor) in zip(specs, tensors):
            assert got.name == spec.name, f"tensor order mismatch: {got.name} != {spec.name}"
            f.write(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    assert os.path.getsize(path) == total, f"{path}: wrote {os.path.getsize(path)} of {total} bytes"


def make_checkpoint(
    preset: str,
    out: str | Path,
    *,
    seed: int = 0,
    data: str = "random",
    max_shard_bytes: int = SHARD_BYTES,
    config_overrides: dict | None = None,
) -> Path:
    """Writes config, generation config, tokenizer files and weights of `preset` into `out`."""
    if data not in ("random", "sparse"):
        raise ValueError(f"data must be 'random' or 'sparse', got {data!r}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg_dict = preset_config(preset) | (config_overrides or {})
    config = ModelConfig.from_dict(cfg_dict, GENERATION_CONFIG)
    (out / "config.json").write_text(json.dumps(cfg_dict, indent=2, sort_keys=True) + "\n")
    (out / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2) + "\n")
    _write_tokenizer(out)

    specs = checkpoint_tensors(config)
    shards = shard_plan(specs, max_shard_bytes)
    total = sum(s.nbytes for s in specs)
    weights = synthetic_tensors(config, seed)
    stream = None if data == "sparse" else tensor_progress(weights, total, f"writing {preset}")
    if len(shards) == 1:
        write_safetensors(out / "model.safetensors", specs, stream)
        return out
    weight_map: dict[str, str] = {}
    last = len(shards) - 1
    for i, shard in enumerate(shards):
        name = f"model-{i:05d}-of-{last:05d}.safetensors"
        write_safetensors(out / name, shard, stream)
        weight_map.update((spec.name, name) for spec in shard)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return out


def _write_tokenizer(out: Path) -> None:
    from tinyoss.tools.o200k import write_tokenizer_files

    write_tokenizer_files(out)
    template = Path(__file__).resolve().parent.parent / "data" / "chat_template.jinja"
    if template.is_file():
        shutil.copyfile(template, out / "chat_template.jinja")


def cache_dir() -> Path:
    return Path(os.environ.get("TINYOSS_CACHE", Path.home() / ".cache" / "tinyoss"))


def ensure_tiny(seed: int = 0) -> Path:
    """The built-in `tiny` checkpoint, written on first use into the cache (race-safe)."""
    target = cache_dir() / f"tiny-v1-seed{seed}"
    if (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("writing the built-in model tiny (random weights) to %s: first use only", target)
    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tiny-"))
    make_checkpoint("tiny", tmp, seed=seed)
    log.info("wrote tiny in %.1f s", time.perf_counter() - t0)
    try:
        tmp.rename(target)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def main(argv: list[str] | None = None) -> None:
    """`python -m tinyoss.tools.make_checkpoint ...` is `tinyoss make-checkpoint ...` (one
    parser, with its help, in tinyoss/cli.py)."""
    import sys

    from tinyoss.cli import main as cli_main

    cli_main(["make-checkpoint", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    main()
