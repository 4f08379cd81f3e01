#!/usr/bin/env bash
# FlashInfer's all-reduce module (`trtllm_comm`, sm_90a) built on a machine without a GPU.
#
# On the GPU machines FlashInfer's JIT build of it ran over 5 minutes and never finished inside
# a device call. Built here from FlashInfer's own build file (its JIT spec writes it) and put at
# <flashinfer>/data/aot/trtllm_comm/trtllm_comm.so on the GPU machine, FlashInfer loads it as a
# prebuilt module without building (and tinyoss's `auto` all-reduce then takes it).
#
#   PYTHON=python3.12 SITE=/tmp/site bash bench/experiments/all_reduce/prebuild_trtllm_comm.sh out.so
#
# PYTHON: a Python that imports FlashInfer (and torch; tvm_ffi's module needs 3.12 or later);
# SITE: a folder holding the `flashinfer` package, added to PYTHONPATH; needs nvcc and ninja.
# No libcuda here: a stub with its soname satisfies the link (the module calls only cudart).
set -euo pipefail
out=$(realpath -m "${1:-trtllm_comm.so}")
work=$(mktemp -d)
mkdir -p "$work/stub"
echo "" > "$work/stub/e.c"
gcc -shared -o "$work/stub/libcuda.so" -Wl,-soname,libcuda.so.1 "$work/stub/e.c"
cuda_home=${CUDA_HOME:-/usr/local/cuda}  # where lib64/libcudart.so is
ninja_file=$(CUDA_HOME=$cuda_home FLASHINFER_CUDA_ARCH_LIST=9.0a FLASHINFER_WORKSPACE_BASE="$work" \
  PYTHONPATH="${SITE:+$SITE:}${PYTHONPATH:-}" "${PYTHON:-python3}" -c '
from flashinfer.jit.comm import gen_trtllm_comm_module
spec = gen_trtllm_comm_module()
spec.write_ninja()
print(spec.ninja_path)')
# the GPU machine's compilers are not here: this machine's, and the stub for -lcuda
sed -i -e "s#-ccbin [^ ]*#-ccbin $(command -v gcc)#" -e "s#^cxx = .*#cxx = $(command -v g++)#" \
  -e "s#-L\$cuda_home/lib64/stubs#-L$work/stub#" "$ninja_file"
ninja -C "$(dirname "$ninja_file")" -f "$ninja_file"
cp "$(dirname "$ninja_file")/trtllm_comm.so" "$out"
rm -rf "$work"
echo "built $out"
