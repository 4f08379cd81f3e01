"""bench/offline_sass.py names each kernel's arguments by hand: they must stay those the kernels
take (checked without compiling, so on any machine). Compiled for sm_90 with Triton's own ptxas
(no GPU needed), the decode GEMVs issue bulk L2 prefetches, and the MoE GEMV loads its weights
evict-first in 16-byte vectors."""

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


def compiled(name: str, tmp_path: Path) -> tuple[str, str]:
    """(report, SASS) of `bench/offline_sass.py --kernel name`, run outside the interpreter
    that the test session may have switched on."""
    dump = tmp_path / f"{name}.sass"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(BENCH / "offline_sass.py"), "--kernel", name,
                          "--dump", str(dump)], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout, dump.read_text()


@pytest.mark.parametrize("name", ["linear_bf16", "pair_gemv"])
def test_gemvs_prefetch_into_l2(name, tmp_path):
    report, sass = compiled(name, tmp_path)
    assert "UBLKPF.L2" in sass, f"{name}: no bulk L2 prefetch in the SASS"
    assert "LOCAL:0" in report, f"{name} spills: {report}"


def test_moe_gemv_streams_weights_evict_first_in_16_byte_loads(tmp_path):
    _, sass = compiled("pair_gemv", tmp_path)
    mix, _ = offline_sass.loop_mix(sass)
    assert mix["LDG.E.EF.128"] >= 4, f"weight loads in the K loop: {mix}"
    assert not any(op.startswith("LDG.E.EF.64") for op in mix), f"8-byte weight loads: {mix}"
