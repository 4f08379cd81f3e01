"""MXFP4 packing against hand-computed bytes: nibble order, sign bit, every code, scale bias."""

import pytest
import torch

from tinyoss.model import mxfp4


def _block(codes: list[int]) -> torch.Tensor:
    """Pack 32 codes (even index -> low nibble) into one 16-byte block, by hand."""
    return torch.tensor(
        [[codes[2 * j] | (codes[2 * j + 1] << 4) for j in range(16)]], dtype=torch.uint8
    )


def test_every_code_and_nibble_order():
    codes = list(range(16)) * 2  # 0..15 twice
    out = mxfp4.dequantize(_block(codes), torch.tensor([127], dtype=torch.uint8))
    expected = [
        0.0,
        0.5,
        1.0,
        1.5,
        2.0,
        3.0,
        4.0,
        6.0,
        -0.0,
        -0.5,
        -1.0,
        -1.5,
        -2.0,
        -3.0,
        -4.0,
        -6.0,
    ]
    assert out.tolist() == expected * 2
    # byte 0x71: low nibble 1 (0.5) is element 0, high nibble 7 (6.0) is element 1
    b = torch.zeros(1, 16, dtype=torch.uint8)
    b[0, 0] = 0x71
    vals = mxfp4.dequantize(b, torch.tensor([127], dtype=torch.uint8))
    assert vals[:2].tolist() == [0.5, 6.0]


@pytest.mark.parametrize(
    "scale,factor", [(127, 1.0), (128, 2.0), (126, 0.5), (120, 2.0**-7), (0, 2.0**-127)]
)
def test_scale_bias_127(scale, factor):
    codes = [5] * 32  # 3.0
    out = mxfp4.dequantize(_block(codes), torch.tensor([scale], dtype=torch.uint8))
    assert torch.equal(out, torch.full((32,), 3.0 * factor))


def test_quantize_exact_values_round_trip():
    torch.manual_seed(0)
    lut = torch.tensor(mxfp4.FP4_VALUES)
    exps = torch.randint(-10, 5, (6, 4, 1)).float()
    x = lut[torch.randint(0, 16, (6, 4, 32))] * torch.exp2(exps)
    x[..., 0] = 6.0 * torch.exp2(exps[..., 0])  # pin each block's max so the exponent is exact
    blocks, scales = mxfp4.quantize(x.flatten(-2))
    assert blocks.shape == (6, 4, 16) and scales.shape == (6, 4)
    assert torch.equal(mxfp4.dequantize(blocks, scales), x.flatten(-2))


def test_quantize_rounds_to_nearest_and_never_clips():
    x = torch.tensor([[6.0, 5.2, 4.9, 2.6, 2.4, 1.2, 0.3, -0.2, -5.1] + [0.0] * 23])
    blocks, scales = mxfp4.quantize(x)
    assert scales.item() == 127
    got = mxfp4.dequantize(blocks, scales)[0, :9].tolist()
    assert got == [6.0, 6.0, 4.0, 3.0, 2.0, 1.0, 0.5, -0.0, -6.0]
    y = torch.randn(3, 64) * 10
    err = (mxfp4.dequantize(*mxfp4.quantize(y)) - y).abs()
    amax = y.unflatten(-1, (-1, 32)).abs().amax(-1, keepdim=True)
    # half the widest code gap (4 to 6) is one scale unit, and the scale is below amax / 3
    assert (err.unflatten(-1, (-1, 32)) <= amax / 3).all()


def test_bad_inputs_are_named():
    with pytest.raises(TypeError, match="uint8"):
        mxfp4.dequantize(torch.zeros(1, 16), torch.zeros(1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="shapes do not match"):
        mxfp4.dequantize(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4.quantize(torch.zeros(33))
