"""bench/offline_sass.py names each kernel's arguments by hand: they must stay those the kernels
take (checked without compiling, so on any machine)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import offline_sass  # noqa: E402


def test_every_kernel_spec_names_the_kernels_arguments():
    for name, (fn, example, constexprs, _, _) in offline_sass.kernels().items():
        given = set(example) | set(constexprs)
        missing = [a for a in fn.arg_names if a not in given]
        assert not missing, f"{name}: no value for {missing}"
        assert set(constexprs) <= set(fn.arg_names), f"{name}: {set(constexprs) - set(fn.arg_names)}"
        offline_sass.spec(fn, example, constexprs)  # builds the ASTSource a compile would use
