"""Checkpoint loading: single file and shards, the full-size inventories, every bad input."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tinyoss.config import ModelConfig
from tinyoss.model.layout import checkpoint_tensors
from tinyoss.model.loader import (
    CheckpointError,
    SafetensorsCheckpoint,
    _targets,
    build_model,
    load_model,
    resolve_model,
)
from tinyoss.tools.make_checkpoint import make_checkpoint

SMALL = {"vocab_size": 1024, "eos_token_id": 1000, "pad_token_id": 999}


def _load(folder):
    config = ModelConfig.from_folder(folder)
    return load_model(folder, config, dtype=torch.float32, device=torch.device("cpu"))


@pytest.fixture(scope="module")
def small_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    single = make_checkpoint("tiny", root / "single", config_overrides=SMALL)
    sharded = make_checkpoint(
        "tiny", root / "sharded", config_overrides=SMALL, max_shard_bytes=200_000
    )
    return single, sharded


def test_single_and_sharded_load_the_same_weights(small_dirs):
    single, sharded = small_dirs
    shards = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00000-of-{len(shards) - 1:05d}.safetensors"
    a, b = _load(single), _load(sharded)
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), name
    raw = load_file(single / "model.safetensors")
    qkv = a.model.layers[1].self_attn.qkv_proj.weight
    assert torch.equal(qkv[:1024], raw["model.layers.1.self_attn.q_proj.weight"].float())
    assert torch.equal(qkv[1024 + 128 :], raw["model.layers.1.self_attn.v_proj.weight"].float())
    blocks = a.model.layers[0].mlp.experts.gate_up_proj_blocks
    assert blocks.dtype == torch.uint8 and torch.equal(
        blocks, raw["model.layers.0.mlp.experts.gate_up_proj_blocks"]
    )


def _rewrite(src, dst, edit):
    shutil.copytree(src, dst)
    path = dst / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)
    return dst


@pytest.mark.parametrize(
    "edit,message",
    [
        (
            lambda t: t.pop("model.layers.2.self_attn.sinks"),
            r"tensor model.layers.2.self_attn.sinks is missing from the checkpoint in .*single-bad",
        ),
        (
            lambda t: t.update({"model.norm.weight": torch.zeros(64, dtype=torch.bfloat16)}),
            r"tensor model.norm.weight in .*model.safetensors has shape \[64\], "
            r"but config.json implies \[128\]",
        ),
        (
            lambda t: t.update(
                {
                    "model.layers.0.mlp.experts.down_proj_scales": t[
                        "model.layers.0.mlp.experts.down_proj_scales"
                    ].float()
                }
            ),
            r"down_proj_scales in .* has dtype F32, expected U8",
        ),
    ],
)
def test_bad_tensor_is_named_with_its_file(small_dirs, tmp_path, edit, message):
    bad = _rewrite(small_dirs[0], tmp_path / "single-bad", edit)
    with pytest.raises(CheckpointError, match=message):
        _load(bad)


def _poison(name: str, value: float | int):
    def edit(t):
        flat = t[name].view(-1)
        flat[flat.numel() // 2] = value

    return edit


@pytest.mark.parametrize(
    "name,value",
    [
        ("model.layers.1.self_attn.o_proj.weight", float("nan")),
        ("model.norm.weight", float("inf")),
        ("model.layers.0.self_attn.sinks", float("-inf")),
        ("model.layers.0.mlp.experts.gate_up_proj_scales", 255),  # E8M0's NaN code
    ],
)
def test_weights_that_are_not_finite_are_refused_by_name(small_dirs, tmp_path, name, value):
    bad = _rewrite(small_dirs[0], tmp_path / "nan", _poison(name, value))
    with pytest.raises(CheckpointError, match=rf"tensor {name} holds 1 NaN or infinite value"):
        _load(bad)


def test_truncated_and_missing_files(small_dirs, tmp_path):
    bad = shutil.copytree(small_dirs[0], tmp_path / "trunc")
    path = bad / "model.safetensors"
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 1000)
    with pytest.raises(CheckpointError, match=r"model.safetensors is truncated or corrupt"):
        _load(bad)
    sharded = shutil.copytree(small_dirs[1], tmp_path / "shards")
    (
        sharded / f"model-00001-of-{len(list(sharded.glob('*.safetensors'))) - 1:05d}.safetensors"
    ).unlink()
    with pytest.raises(CheckpointError, match=r"shard\(s\) model-00001-of-.* are missing"):
        _load(sharded)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="has neither model.safetensors nor"):
        SafetensorsCheckpoint(empty)


def test_index_that_lies_about_a_shard(small_dirs, tmp_path):
    sharded = shutil.copytree(small_dirs[1], tmp_path / "lying")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    name = "model.norm.weight"
    other = sorted(set(index["weight_map"].values()) - {index["weight_map"][name]})[0]
    index["weight_map"][name] = other
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(
        CheckpointError, match=f"places {name} in {other}, but {other} does not hold it"
    ):
        SafetensorsCheckpoint(sharded)


def test_model_names_that_are_neither_folder_nor_hub_id(tmp_path, monkeypatch):
    with pytest.raises(CheckpointError, match="neither a checkpoint folder nor a hub id"):
        resolve_model(str(tmp_path / "nope"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(CheckpointError, match="not in the local Hugging Face cache"):
        resolve_model("openai/gpt-oss-20b")


@pytest.mark.parametrize(
    "preset,total,shard_counts",
    [
        ("gpt-oss-20b", 13_761_264_768, [196, 197, 66]),
        (
            "gpt-oss-120b",
            65_248_815_744,
            [54, 54, 41, 54, 41, 54, 41, 54, 41, 54, 41, 54, 41, 54, 9],
        ),
    ],
)
def test_full_size_inventory(tmp_path, preset, total, shard_counts):
    """The published layouts (sizes, shard boundaries) load from headers alone: no 13 GB of RAM."""
    folder = make_checkpoint(preset, tmp_path / preset, data="sparse")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == total
    counts = {}
    for f in index["weight_map"].values():
        counts[f] = counts.get(f, 0) + 1
    assert [counts[f] for f in sorted(counts)] == shard_counts
    config = ModelConfig.from_folder(folder)
    specs = checkpoint_tensors(config)
    ckpt = SafetensorsCheckpoint(folder)
    try:
        assert sorted(ckpt.file_of) == sorted(s.name for s in specs)
        for spec in specs:
            ckpt.check(spec)
    finally:
        ckpt.close()
    model = build_model(config, dtype=torch.bfloat16, device=torch.device("meta"))
    assert set(_targets(model)) == {s.name for s in specs}
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj_blocks.shape == (config.num_local_experts, 5760, 90, 16)


def test_hub_download_takes_only_what_tinyoss_reads():
    import fnmatch

    from tinyoss.model.loader import HUB_FILES

    def wanted(path):
        return any(fnmatch.fnmatch(path, pattern) for pattern in HUB_FILES)

    for path in ("config.json", "generation_config.json", "model-00001-of-00002.safetensors",
                 "model.safetensors", "model.safetensors.index.json", "tokenizer.json",
                 "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        assert wanted(path), path
    for path in ("original/model.safetensors", "original/config.json", "metal/model.bin",
                 "README.md"):
        assert not wanted(path), path
