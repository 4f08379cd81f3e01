"""Find a checkpoint (folder, hub id or the built-in `tiny`) and load it into the model.

Tensors are read one at a time from memory-mapped safetensors and copied once onto their device;
MXFP4 experts stay packed. Every failure names the tensor and the file, and says what to do.
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch
from torch import nn
from safetensors import SafetensorError, safe_open

from tinyoss.config import ModelConfig
from tinyoss.kernels import Kernels
from tinyoss.model.gpt_oss import Attention, Experts, GptOssForCausalLM
from tinyoss.model.layout import TensorSpec, checkpoint_tensors
from tinyoss.model.sharding import Cut, Shard
from tinyoss.model.synthetic import synthetic_tensors
from tinyoss.progress import tensor_progress

log = logging.getLogger("tinyoss")

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# Only what tinyoss reads: not original/ (OpenAI's own format) or metal/ (a second 13 GB copy).
HUB_FILES = ["config.json", "generation_config.json", "model*.safetensors", INDEX,
             "tokenizer*", "special_tokens_map.json", "chat_template.jinja"]


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete or not in the gpt-oss layout."""


def resolve_model(model: str | Path, revision: str | None = None) -> Path:
    """A local folder as is; `tiny` -> the built-in model (written on first use); else a hub id."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if str(model) == "tiny":
        from tinyoss.tools.make_checkpoint import ensure_tiny

        return ensure_tiny()
    if path.exists() or str(model).startswith((".", "/", "~")) or str(model).count("/") != 1:
        raise CheckpointError(
            f"model {str(model)!r} is neither a checkpoint folder nor a hub id like "
            "'openai/gpt-oss-20b' (use 'tiny' for the built-in test model)"
        )
    return _download(str(model), revision)


def _download(repo_id: str, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=HUB_FILES))
    except LocalEntryNotFoundError as e:
        raise CheckpointError(
            f"{repo_id} is not in the local Hugging Face cache and the hub cannot be reached "
            f"(HF_HUB_OFFLINE or no network): download it first or pass a local folder ({e})"
        ) from e
    except HfHubHTTPError as e:
        raise CheckpointError(f"could not download {repo_id} from the Hugging Face hub: {e}") from e


class SafetensorsCheckpoint:
    """Lazy, memory-mapped access to a single-file or sharded safetensors checkpoint."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        index = self.folder / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index} is not a valid safetensors index: {e}") from e
        elif (self.folder / SINGLE).is_file():
            weight_map = None
        else:
            raise CheckpointError(f"{self.folder} has neither {SINGLE} nor {INDEX}")
        files = sorted(set(weight_map.values())) if weight_map else [SINGLE]
        missing = [f for f in files if not (self.folder / f).is_file()]
        if missing:
            raise CheckpointError(
                f"{self.folder}: shard(s) {', '.join(missing)} listed in {INDEX} "
                "are missing; the download is incomplete"
            )
        self._handles: dict[str, object] = {}
        self._stack = contextlib.ExitStack()
        self.file_of: dict[str, str] = {}
        for f in files:
            handle = self._open(f)
            for name in handle.keys():
                self.file_of[name] = f
        if weight_map:
            for name, f in weight_map.items():
                if self.file_of.get(name) != f:
                    raise CheckpointError(f"{INDEX} places {name} in {f}, but {f} does not hold it")

    def _open(self, file: str):
        if file not in self._handles:
            try:
                self._handles[file] = self._stack.enter_context(
                    safe_open(self.folder / file, framework="pt")
                )
            except (SafetensorError, OSError) as e:
                raise CheckpointError(
                    f"{self.folder / file} is truncated or corrupt ({e}); download it again"
                ) from e
        return self._handles[file]

    def close(self) -> None:
        self._stack.close()

    def read(self, spec: TensorSpec, cut: Cut | None = None) -> torch.Tensor:
        """The tensor named by `spec`, checked against the expected shape and dtype; with `cut`
        only that slice is read from the file (tensor parallelism)."""
        handle = self._open(self.check(spec))
        if cut is None:
            return handle.get_tensor(spec.name)
        return cut.pad(handle.get_slice(spec.name)[cut.index(len(spec.shape))])

    def check(self, spec: TensorSpec) -> str:
        """Checks a tensor's presence, shape and dtype from the header alone; returns its file."""
        file = self.file_of.get(spec.name)
        if file is None:
            raise CheckpointError(
                f"tensor {spec.name} is missing from the checkpoint in "
                f"{self.folder} (looked in {', '.join(sorted(self._handles))})"
            )
        handle = self._open(file)
        lazy = handle.get_slice(spec.name)
        shape, dtype = tuple(lazy.get_shape()), lazy.get_dtype()
        where = f"tensor {spec.name} in {self.folder / file}"
        if shape != spec.shape:
            raise CheckpointError(
                f"{where} has shape {list(shape)}, but config.json implies {list(spec.shape)}"
            )
        want_int = spec.dtype == "U8"
        if want_int != (dtype == "U8") or dtype not in ("U8", "BF16", "F16", "F32"):
            raise CheckpointError(f"{where} has dtype {dtype}, expected {spec.dtype}")
        return file

    def tensors(
        self, specs: Iterable[TensorSpec], cut: Callable[[TensorSpec], Cut | None] = lambda s: None
    ) -> Iterator[tuple[TensorSpec, torch.Tensor]]:
        for spec in specs:
            yield spec, self.read(spec, cut(spec))


def _targets(model: GptOssForCausalLM) -> dict[str, tuple[torch.Tensor, int]]:
    """Checkpoint tensor name -> (parameter it fills, first row of it within that parameter)."""
    c = model.config
    params = dict(model.named_parameters())
    targets: dict[str, tuple[torch.Tensor, int]] = {}
    for name, param in params.items():
        if name.endswith(("qkv_proj.weight", "qkv_proj.bias")):
            stem, kind = name.rsplit(".qkv_proj.", 1)
            for part, row in (("q", 0), ("k", c.q_size), ("v", c.q_size + c.kv_size)):
                targets[f"{stem}.{part}_proj.{kind}"] = (param, row)
        elif name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        else:
            targets[name] = (param, 0)
    return targets


def load_weights(
    model: GptOssForCausalLM, source: Iterable[tuple[TensorSpec, torch.Tensor]]
) -> None:
    """Copy every checkpoint tensor into its parameter (converting dtype on the device), and
    refuse weights that are not finite: a NaN would otherwise surface as failed requests."""
    targets = _targets(model)
    filled: set[str] = set()
    for spec, tensor in source:
        param, row = targets[spec.name]
        dst = param.data[row : row + tensor.shape[0]] if param.dim() > 0 else param.data
        dst.copy_(tensor.reshape(dst.shape))
        _check_finite(spec.name, dst)
        filled.add(spec.name)
    unfilled = sorted(set(targets) - filled)
    assert not unfilled, f"loader bug: parameters left unfilled: {unfilled[:5]}"
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight


def _check_finite(name: str, t: torch.Tensor) -> None:
    """NaN/Inf in a float tensor, or the E8M0 NaN code (255) in an MXFP4 scale tensor."""
    if t.dtype == torch.uint8:
        bad = int((t == 255).sum()) if name.endswith("_scales") else 0
    else:  # counted only when there are any: one pass less for the good ones
        bad = 0 if _all_finite(t) else int((~torch.isfinite(t)).sum())
    if bad:
        raise CheckpointError(
            f"tensor {name} holds {bad} NaN or infinite value(s) of {t.numel()}: the checkpoint "
            "is corrupt; download it again"
        )


_MINMAX_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _all_finite(t: torch.Tensor) -> bool:
    """Whether every value is finite. Through aminmax where it can: NaN propagates into both,
    an infinity is the max or the min, so both are finite exactly when every value is. On
    the CPU, isfinite().all() took 15x as long (0.55 s of tiny's 0.9 s load on a 2-core
    machine); the result is the same."""
    if t.numel() == 0 or t.dtype not in _MINMAX_DTYPES:
        return bool(torch.isfinite(t).all())
    low, high = torch.aminmax(t)
    return bool(low.isfinite() & high.isfinite())


def prepare_experts(model: GptOssForCausalLM) -> None:
    """Lets the MoE kernel re-lay out each layer's loaded experts once (see `Experts.prepare`).

    The released checkpoint tensors go back to the driver, so that sizing the KV cache from the
    free GPU memory counts them as free."""
    for module in model.modules():
        if isinstance(module, Experts):
            module.prepare()
    if model.kernels.prepare_experts is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def disable_attention_sinks(model: GptOssForCausalLM) -> None:
    """Every layer's sink logits -> -inf: exp(-inf) = 0 drops the sink column from the softmax,
    in the torch reference, FlashInfer's sink variants (FA2 itself uses -inf for "no sink") and
    the Triton decode kernel alike (every real query row has at least its own key)."""
    for module in model.modules():
        if isinstance(module, Attention):
            module.sinks.data.fill_(float("-inf"))


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_model(
    config: ModelConfig, *, dtype: torch.dtype, device: torch.device,
    kernels: Kernels | None = None, shard: Shard = Shard(),
) -> GptOssForCausalLM:
    """An empty model (uninitialised memory) on `device`: weights are written once, by loading.
    `config` is the whole model's; the model holds `shard`'s part of it."""
    with torch.device("meta"), _default_dtype(dtype):
        model = GptOssForCausalLM(shard.local_config(config), kernels, shard)
    return _materialize(model, device).eval()


def _materialize(model: nn.Module, device: torch.device) -> nn.Module:
    """`Module.to_empty`, but through `torch.empty`: `empty_like` of a meta tensor runs torch's
    Python reference, whose first call imports sympy (~1 s of a CPU start-up)."""
    made: dict[int, torch.Tensor] = {}  # shared tensors stay shared
    for module in model.modules():
        for store in (module._parameters, module._buffers):
            for name, t in store.items():
                if t is not None and id(t) not in made:
                    new = torch.empty(t.shape, dtype=t.dtype, device=device)
                    made[id(t)] = (nn.Parameter(new, requires_grad=t.requires_grad)
                                   if isinstance(t, nn.Parameter) else new)
                if t is not None:
                    store[name] = made[id(t)]
    return model


def load_model(
    folder: str | Path | None,
    config: ModelConfig,
    *,
    dtype: torch.dtype,
    device: torch.device,
    kernels: Kernels | None = None,
    load_format: str = "auto",
    seed: int = 0,
    shard: Shard = Shard(),
) -> GptOssForCausalLM:
    """Builds the model and fills it from `folder`, or with random weights for `dummy` (the
    same weights for any `shard`: each rank makes whole tensors and keeps its slice)."""
    if load_format not in ("auto", "safetensors", "dummy"):
        raise ValueError(
            f"load_format must be 'auto', 'safetensors' or 'dummy', got {load_format!r}"
        )
    if load_format != "dummy" and folder is None:
        raise CheckpointError(f"load_format {load_format!r} needs a checkpoint folder")
    specs = checkpoint_tensors(config)
    total = sum(s.nbytes for s in specs)
    source = "random weights (load_format dummy)" if load_format == "dummy" else folder
    log.info("loading %d tensors (%.2f GB) from %s", len(specs), total / 1e9, source)
    model = build_model(config, dtype=dtype, device=device, kernels=kernels, shard=shard)

    def cut(spec: TensorSpec) -> Cut | None:
        return shard.cut(spec.name, spec.shape, config)

    if load_format == "dummy":
        weights = (
            (spec, t if (c := cut(spec)) is None else c.take(t))
            for spec, t in synthetic_tensors(config, seed, device)
        )
        load_weights(model, tensor_progress(weights, total, "random weights"))
    else:
        ckpt = SafetensorsCheckpoint(folder)
        try:
            extra = sorted(set(ckpt.file_of) - {s.name for s in specs})
            if extra:
                log.warning(
                    "checkpoint holds %d tensors tinyoss does not use, e.g. %s",
                    len(extra),
                    ", ".join(extra[:3]),
                )
            source = ckpt.tensors(specs, cut)
            load_weights(model, tensor_progress(source, total, "loading weights"))
        finally:
            ckpt.close()
    prepare_experts(model)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return model
