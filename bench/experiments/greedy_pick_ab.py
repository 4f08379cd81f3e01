"""The product's greedy pick against another version of `greedy_triton.py`, side by side at
1-256 rows of gpt-oss's 201,088 logits (fp32), replayed from CUDA graphs; both must give the same
ids. GPU only.

    git show 62fb407~1:tinyoss/kernels/greedy_triton.py > /tmp/greedy_old.py
    python bench/experiments/greedy_pick_ab.py /tmp/greedy_old.py
"""
import importlib.util
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tinyoss.kernels import greedy_triton as new  # noqa: E402

spec = importlib.util.spec_from_file_location("greedy_old", sys.argv[1])
old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)



def timed(fn, x):
    fn(x)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(10):
            fn(x)
    return triton.testing.do_bench(g.replay, warmup=25, rep=300) * 1e3 / 10

print(torch.cuda.get_device_name())
for rows in (1, 3, 8, 37, 64, 100, 256):
    x = torch.randn(rows, 201088, device="cuda")
    assert torch.equal(old.greedy_pick_triton(x), new.greedy_pick_triton(x))
    a, b, a2, b2 = (timed(old.greedy_pick_triton, x), timed(new.greedy_pick_triton, x),
                    timed(old.greedy_pick_triton, x), timed(new.greedy_pick_triton, x))
    print(f"rows {rows:3d}: other {a:6.2f} / {a2:6.2f} us, "
          f"product {b:6.2f} / {b2:6.2f} us")
