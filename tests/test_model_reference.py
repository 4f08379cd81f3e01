"""tinyoss's reference model equals transformers' GptOssForCausalLM on the tiny checkpoint.

fp32 on CPU, one 300-token prompt (longer than the 128-token window, so sliding and full layers
differ), attention through the paged cache with scattered blocks. Measured relative error is
~6e-7; the bound below leaves room for summation-order differences only.
"""

import pytest
import torch

from tinyoss.config import ModelConfig
from tinyoss.engine.kv_cache import CacheLayout, allocate_kv_tensors
from tinyoss.kernels.attention import AttentionMetadata, GroupMetadata, TorchAttention
from tinyoss.model.loader import load_model

BLOCK = 16
TOL = 1e-5  # ||ours - transformers|| / ||transformers||


def run_paged(model, config, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Logits of one sequence, its KV (in `dtype`) in deliberately shuffled blocks of a paged
    cache."""
    layout = CacheLayout.for_model(config)
    n = len(ids)
    nb = -(-n // BLOCK)
    caches = allocate_kv_tensors(
        layout, 2 * nb + 3, BLOCK, config, dtype, torch.device("cpu")
    )
    perm = torch.randperm(2 * nb + 3)[:nb].tolist()
    slots = torch.tensor([perm[p // BLOCK] * BLOCK + p % BLOCK for p in range(n)])
    group = GroupMetadata([perm], [0], slots)
    windows = [layout.windows[g] for g in layout.layer_group]
    attn = TorchAttention(caches, layout.layer_group, windows, config.head_dim**-0.5)
    attn.plan(AttentionMetadata([n], [n], [group] * len(layout.windows)))
    with torch.inference_mode():
        return model.compute_logits(model(ids, torch.arange(n), attn))


@pytest.fixture(scope="module")
def models(tiny_dir):
    from transformers import GptOssForCausalLM

    config = ModelConfig.from_folder(tiny_dir)
    ours = load_model(tiny_dir, config, dtype=torch.float32, device=torch.device("cpu"))
    ours.init_runtime(4096, torch.device("cpu"))
    theirs = GptOssForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    return config, ours, theirs


def test_logits_match_transformers(models):
    config, ours, theirs = models
    torch.manual_seed(1)
    ids = torch.randint(0, 199998, (300,))
    logits = run_paged(ours, config, ids)
    with torch.inference_mode():
        ref = theirs(ids[None]).logits[0]
    rel = ((logits - ref).norm() / ref.norm()).item()
    assert rel < TOL, rel
    assert torch.equal(logits.argmax(-1), ref.argmax(-1))
    assert logits.argmax(-1).unique().numel() > 200  # next-token choices differ across positions


def test_sinks_and_window_matter(models):
    """If sinks or the window were ignored, these logits would not move."""
    config, ours, _ = models
    torch.manual_seed(2)
    ids = torch.randint(0, 199998, (200,))
    base = run_paged(ours, config, ids)
    saved = [layer.self_attn.sinks.clone() for layer in ours.model.layers]
    try:
        for layer in ours.model.layers:
            layer.self_attn.sinks.zero_()
        no_sinks = run_paged(ours, config, ids)
    finally:
        for layer, s in zip(ours.model.layers, saved):
            layer.self_attn.sinks.copy_(s)
    assert ((no_sinks - base).norm() / base.norm()).item() > 1e-2
    full = run_paged(ours, config.with_(layer_types=("full_attention",) * 4), ids)
    assert torch.allclose(full[:128], base[:128], rtol=1e-4, atol=1e-4)  # inside the window: same
    assert ((full[128:] - base[128:]).norm() / base[128:].norm()).item() > 1e-2


def test_logits_written_into_a_buffer_equal_the_returned_ones(models):
    """`compute_logits(out=...)` (a CUDA graph's fixed buffer) converts bf16 logits to float32
    in the copy itself: the same values as the float32 logits it returns without `out`."""
    config, ours, _ = models
    hidden = torch.randn(3, config.hidden_size)
    head = ours.lm_head.weight.data
    try:
        ours.lm_head.weight.data = head.to(torch.bfloat16)
        with torch.inference_mode():
            want = ours.compute_logits(hidden.to(torch.bfloat16))
            buf = torch.full((4, config.vocab_size), float("nan"))
            got = ours.compute_logits(hidden.to(torch.bfloat16), out=buf[:3])
    finally:
        ours.lm_head.weight.data = head
    assert want.dtype == got.dtype == torch.float32 and got.data_ptr() == buf.data_ptr()
    assert torch.equal(got, want) and torch.isnan(buf[3]).all()
