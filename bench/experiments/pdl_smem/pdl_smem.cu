// The product's one-token MoE kernels for bench.py's sweep: gate_up with and without the trigger
// that lets down launch at its start (pair_gemv_stream on one GPU's rows, pair_gemv_mma on a
// tensor-parallel rank's share), and down_resident (launched early, its rows in shared memory
// before it waits) over program shapes. Built beside the product's source, which it includes.
#include "../../../tinyoss/kernels/moe_gemv_mma.cu"

namespace {

using B = __nv_bfloat16;
using GateUpFn = int (*)(const void*, int, const int*, int, const uint8_t*, const uint8_t*,
                         const void*, const float*, float*, int, int, long, int, long, float,
                         float, cudaStream_t);
using DownFn = int (*)(const float*, const int*, int, const uint8_t*, const uint8_t*,
                       const void*, const float*, float*, int, int, long, int, long,
                       cudaStream_t);

// [trigger][shape]: one GPU's rows (the product's one-token tiles), a rank's share (N >= 2880:
// TP 2), a narrower share (TP 4); one GPU's rows at 5-8 pairs (2 tokens), above 8 pairs
const GateUpFn kGateUp[2][5] = {
    {launch_stream<true, 10, 3, 4, B, 2, false>, launch<true, 15, 2, 1, B, float, false>,
     launch<true, 9, 5, 1, B, float, false>, launch<true, 9, 1, 4, B, float, false>,
     launch_stream<true, 10, 3, 4, B, 0, false>},
    {launch_stream<true, 10, 3, 4, B, 2, true>, launch<true, 15, 2, 1, B, float, true>,
     launch<true, 9, 5, 1, B, float, true>, launch<true, 9, 1, 4, B, float, true>,
     launch_stream<true, 10, 3, 4, B, 0, true>},
};
const DownFn kDown[] = {launch_resident<3, 4>, launch_resident<2, 4>, launch_resident<1, 4>,
                        launch_resident<3, 2>, launch_resident<2, 2>};
const char* kDownNames[] = {"48 rows x4 (product)", "32 rows x4", "16 rows x4", "48 rows x2",
                            "32 rows x2"};

}  // namespace

extern "C" int pdl_down_variants() { return (int)(sizeof(kDown) / sizeof(kDown[0])); }
extern "C" const char* pdl_down_name(int v) { return kDownNames[v]; }

extern "C" int pdl_gate_up(int trig, int shape, const void* x, int x_div, const int* ids,
                           int pairs, const uint8_t* q, const uint8_t* s, const void* bias,
                           const float* wts, float* out, int N, int K, long stride_qe,
                           int stride_q, long stride_se, float alpha, float limit,
                           void* stream) {
  return kGateUp[trig][shape](x, x_div, ids, pairs, q, s, bias, wts, out, N, K, stride_qe,
                              stride_q, stride_se, alpha, limit,
                              static_cast<cudaStream_t>(stream));
}

extern "C" int pdl_down(int v, const void* x, const int* ids, int pairs, const uint8_t* q,
                        const uint8_t* s, const void* bias, const float* wts, float* out, int N,
                        int K, long stride_qe, int stride_q, long stride_se, void* stream) {
  return kDown[v](static_cast<const float*>(x), ids, pairs, q, s, bias, wts, out, N, K,
                  stride_qe, stride_q, stride_se, static_cast<cudaStream_t>(stream));
}
