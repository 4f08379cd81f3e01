"""The W-left prefill GEMMs give the product's pair outputs (interpreter on CPU, real on a GPU)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))

from test_moe_triton import PREFILL, TOL, inputs, rel_err  # noqa: E402
from wleft import prefill_pairs_left  # noqa: E402

from tinyoss.kernels import moe_triton as mt  # noqa: E402


@pytest.mark.parametrize("seed,t", [(3, 9), (4, 40)])
def test_w_left_equals_the_product(seed, t):
    x, weights, ids, w = inputs(seed, t)
    ref = mt._prefill_pairs(x, weights, ids, w, PREFILL)
    out = prefill_pairs_left(x, weights, ids, w, PREFILL)
    assert rel_err(out, ref) < TOL
