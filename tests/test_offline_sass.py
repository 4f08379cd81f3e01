"""bench/offline_sass.py names each kernel's arguments by hand: they must stay those the kernels
take (checked without compiling, so on any machine). Compiled for sm_90 with Triton's own ptxas
(no GPU needed), the Gluon MoE pair GEMV keeps its activations in registers: no barrier and no
shared memory in its K loop, no spills, 16-byte weight loads."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import offline_sass  # noqa: E402


def test_every_kernel_spec_names_the_kernels_arguments():
    for name, (fn, example, constexprs, _, _) in offline_sass.kernels().items():
        given = set(example) | set(constexprs)
        missing = [a for a in fn.arg_names if a not in given]
        assert not missing, f"{name}: no value for {missing}"
        assert set(constexprs) <= set(fn.arg_names), f"{name}: {set(constexprs) - set(fn.arg_names)}"
        offline_sass.spec(fn, example, constexprs)  # builds the ASTSource a compile would use


def test_gluon_pair_gemv_needs_no_barrier(tmp_path):
    dump = tmp_path / "gluon.sass"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile for real
    out = subprocess.run([sys.executable, str(BENCH / "offline_sass.py"), "--kernel",
                          "pair_gemv_gluon", "--dump", str(dump)], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "LOCAL:0" in out.stdout, out.stdout
    mix, total = offline_sass.loop_mix(dump.read_text())
    assert total > 0 and not any(op.startswith(("BAR", "LDS", "STS")) for op in mix), mix
    assert mix["LDG.E.EF.128"] >= 8, mix


def test_gluon_tiles_are_checked():
    from tinyoss.kernels.moe_gemv_gluon import check

    check(1024, 8, 1)
    check(512, 8, 2)
    with pytest.raises(ValueError, match="block_k in .256, 512, 1024."):
        check(2048, 8, 1)
    with pytest.raises(ValueError, match="multiple of 8 at 2 warps"):
        check(512, 12, 2)
