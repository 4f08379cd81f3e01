"""Engine start-up options on CPU: the MoE warm-up (largest step, every expert) and
`attention_sinks` (auto keeps the checkpoint's sinks, false removes them; argument > env > auto).
"""

from __future__ import annotations

import argparse
import contextlib
from types import SimpleNamespace

import pytest
import torch

from tests.test_model_reference import run_paged
from tinyoss import LLM
from tinyoss.cli import add_engine_args, engine_kwargs
from tinyoss.config import EngineConfig
from tinyoss.engine.builder import SINKS_ENV, uniform_routing, warm_up_moe
from tinyoss.kernels import attention
from tinyoss.kernels.moe_torch import moe_torch
from tinyoss.settings import resolve


def test_uniform_routing_gives_every_expert_tokens():
    ids = uniform_routing(10, 4, 8, torch.device("cpu"))
    assert ids.shape == (10, 4)
    assert all(len(set(row.tolist())) == 4 for row in ids)  # K distinct experts per token
    assert torch.equal(torch.bincount(ids.flatten(), minlength=8), torch.full((8,), 5))


def test_warm_up_runs_every_layer_on_the_largest_step_over_all_experts(tiny_llm, monkeypatch):
    model = tiny_llm.engine.executor.model
    kernels = model.lm_head.kernels  # the engine's: one Kernels object for the whole model
    backends = SimpleNamespace(kernels=kernels)
    calls, contexts = [], []

    def spy(x, topk_weights, topk_ids, w):
        calls.append((x.shape, topk_ids.unique().tolist(), contexts[-1]))
        return moe_torch(x, topk_weights, topk_ids, w)

    @contextlib.contextmanager
    def tuning():
        contexts.append("open")
        yield
        contexts[-1] = "closed"

    monkeypatch.setattr(kernels, "moe", spy)
    monkeypatch.setattr(kernels, "moe_warmup", tuning)
    m = model.config
    warm_up_moe(model, backends, m, 2048, torch.float32, torch.device("cpu"))
    assert calls == [
        ((2048, m.hidden_size), list(range(m.num_local_experts)), "open")
    ] * m.num_hidden_layers
    assert contexts == ["closed"]
    # a kernel with its own layout (CUTLASS) empties the checkpoint tensors after loading: the
    # warm-up still routes over every expert (it counted the emptied tensor's 0 rows)
    experts = model.model.layers[0].mlp.experts
    monkeypatch.setattr(experts.gate_up_proj_blocks, "data",
                        experts.gate_up_proj_blocks.data.new_empty(0))
    seen = []
    monkeypatch.setattr(kernels, "moe", lambda x, w, ids, e: seen.append(ids.unique().tolist())
                        or torch.zeros_like(x))
    warm_up_moe(model, backends, m, 64, torch.float32, torch.device("cpu"))
    assert seen == [list(range(m.num_local_experts))] * m.num_hidden_layers


def attend_without_sinks(q, k, v, sinks, q_pos, k_pos, window, scale):
    """Plain causal (windowed) attention: the reference for "no sinks"."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.float().repeat_interleave(group, dim=1).transpose(0, 1) for t in (k, v))
    allowed = k_pos[None, :] <= q_pos[:, None]
    if window:
        allowed &= k_pos[None, :] > q_pos[:, None] - window
    out = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(0, 1), k, v, attn_mask=allowed, scale=scale
    )
    return out.transpose(0, 1)


def test_attention_sinks_false_means_no_sinks(tiny_llm, tiny_dir, monkeypatch):
    monkeypatch.setenv(SINKS_ENV, "false")  # the env alone turns them off
    off = LLM(str(tiny_dir), device="cpu", dtype="float32", kv_cache_tokens=1024)
    layers = off.engine.executor.model.model.layers
    assert all(torch.isneginf(layer.self_attn.sinks).all() for layer in layers)
    auto = tiny_llm.engine.executor.model  # attention_sinks left at auto: the checkpoint's sinks
    assert all(torch.isfinite(layer.self_attn.sinks).all() for layer in auto.model.layers)

    config = auto.config
    ids = torch.randint(0, 199998, (48,), generator=torch.Generator().manual_seed(5))
    with_sinks = run_paged(auto, config, ids)
    without = run_paged(off.engine.executor.model, config, ids)
    assert ((without - with_sinks).norm() / with_sinks.norm()).item() > 1e-2
    monkeypatch.setattr(attention, "attend", attend_without_sinks)
    reference = run_paged(auto, config, ids)  # the checkpoint's model, sinks removed by hand
    torch.testing.assert_close(without, reference, rtol=1e-4, atol=1e-4)


def test_attention_sinks_precedence_and_bad_values(monkeypatch):
    monkeypatch.setenv(SINKS_ENV, "false")
    assert resolve("attention_sinks", None, SINKS_ENV, ("auto", "false")).value == "false"
    assert resolve("attention_sinks", "auto", SINKS_ENV, ("auto", "false")).value == "auto"
    monkeypatch.delenv(SINKS_ENV)
    assert resolve("attention_sinks", None, SINKS_ENV, ("auto", "false")).source == "default"
    for bad in ("off", "true", "False"):
        with pytest.raises(ValueError, match=f"invalid attention_sinks '{bad}': choose one of "
                                             "auto, false"):
            EngineConfig(attention_sinks=bad)
    monkeypatch.setenv(SINKS_ENV, "off")
    with pytest.raises(ValueError, match=f"attention_sinks 'off' \\(from env {SINKS_ENV}=off\\) "
                                         "is not one of: auto, false"):
        LLM("tiny", load_format="dummy", device="cpu")
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_kwargs(p.parse_args([]))["attention_sinks"] is None
    assert engine_kwargs(p.parse_args(["--attention-sinks", "false"]))["attention_sinks"] == "false"
    with pytest.raises(SystemExit):
        p.parse_args(["--attention-sinks", "off"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")
def test_device_cuda_without_a_gpu_says_so_before_loading(tiny_dir):
    with pytest.raises(ValueError, match="device 'cuda' was asked for, but PyTorch finds no CUDA "
                       "GPU here .*: give device='cpu'"):
        LLM(str(tiny_dir), device="cuda")


def test_options_that_change_nothing_here_are_said(tiny_dir, caplog):
    """Found by a new-user trial: these were dropped in silence."""
    caplog.set_level("WARNING", logger="tinyoss")
    LLM(str(tiny_dir), device="cpu", gpu_memory_utilization=0.5, enable_expert_parallel=True,
        kv_cache_tokens=2048, decode_step_budget_ms=30.0)
    assert "gpu_memory_utilization 0.5 has no effect on the CPU" in caplog.text
    assert "enable_expert_parallel has no effect without tensor_parallel_size > 1" in caplog.text
    # its cost model is timed on a GPU only: on the CPU prefill chunks were never sized
    assert "decode_step_budget_ms 30.0 has no effect on the CPU" in caplog.text
