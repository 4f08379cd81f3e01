"""The first statement of a Triton kernel that takes part in programmatic dependent launch
(`launch.pdl_options` says when): kept apart from `launch` so that choosing needs no Triton."""

import triton
import triton.language as tl


@triton.jit
def pdl_start(USE_PDL: tl.constexpr):
    """Wait for the kernels before this one (their writes become visible), then let the next
    kernel launch."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
