"""The reduced SM90 CUTLASS MoE build's pure parts: the binding patch and the tile choice
(FlashInfer itself is not installed in CI; the build is checked on a GPU machine)."""

from __future__ import annotations

import pytest

from tinyoss.kernels import moe_cutlass_sm90_build as b

BINDING = (
    "class FusedMoeRunner {\n  FusedMoeRunner() {\n"
    + b._RUNNERS_BEGIN
    + "    if (mActivationDtype == dl_float16) { /* twenty runner types */ }\n"
    + b._RUNNERS_END
    + "      TVM_FFI_LOG_AND_THROW(NotImplementedError);\n    }\n  }\n};\n"
)


def test_binding_keeps_one_runner():
    out = b.one_runner_binding(BINDING)
    assert "twenty runner types" not in out
    assert "CutlassMoeFCRunner<__nv_bfloat16, kernels::Fp4Type>" in out
    assert out.startswith("class FusedMoeRunner") and b._RUNNERS_END in out


def test_binding_that_moved_is_a_clear_error():
    with pytest.raises(RuntimeError, match="binding.cu changed.*--mxfp4-backend triton"):
        b.one_runner_binding(BINDING.replace(b._RUNNERS_END, ""))


@pytest.mark.parametrize(
    "cta,cluster,coop,kept",
    [
        ((64, 16, 128), (1, 1, 1), False, True),  # FlashInfer's untuned default tactic
        ((64, 16, 128), (1, 1, 1), True, False),  # M 64 runs ping-pong only
        ((128, 128, 128), (2, 1, 1), True, True),
        ((128, 128, 128), (2, 1, 1), False, False),
        ((256, 64, 128), (1, 2, 1), True, True),
        ((64, 32, 256), (1, 1, 1), False, False),  # K tile 256 never divides 2944
        ((128, 64, 256), (1, 1, 1), True, True),  # sizes the workspace
        ((128, 64, 256), (2, 1, 1), True, False),
    ],
)
def test_tiles_kept(cta, cluster, coop, kept):
    assert b.keep_tile(cta, cluster, coop) is kept
    assert kept is False or cta[2] == 128 or cta == (128, 64, 256)
