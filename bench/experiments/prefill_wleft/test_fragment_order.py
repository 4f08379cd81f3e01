"""The permuted blocks, read the way the decode kernels read a word, meet x in natural order."""

import torch
from fragment_order import SLOT, _codes, fragment_dot, permute_blocks


def test_slots_are_a_permutation_of_the_block():
    assert sorted(k for row in SLOT for k in row) == list(range(32))


def test_fragment_reads_of_permuted_blocks_equal_the_plain_dot():
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (90, 16), dtype=torch.uint8, generator=gen)
    x = torch.randn(90 * 32, generator=gen, dtype=torch.float64)
    plain = (_codes(blocks).double() * x.view(90, 32)).sum(-1)
    assert torch.allclose(fragment_dot(permute_blocks(blocks), x), plain)
    assert not torch.allclose(fragment_dot(blocks, x), plain)  # unpermuted blocks do not
