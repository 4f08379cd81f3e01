// Tile variants of the product's tensor-core MoE GEMVs (tinyoss/kernels/moe_gemv_mma.cu), for
// sweep_pair.py: the pair kernel with other (U, KSPLIT, TILES) choices and the streamed one;
// with --grouped the grouped kernels with other (U, TILES) and (C, S, W). Built by nvcc into a
// library of its own, launched through ctypes like the product's.
#include <type_traits>

#include "../../../tinyoss/kernels/moe_gemv_mma.cu"

#define TINYOSS_VARIANTS(X)                                                                   \
  X(0, true, 9, 2, 4) X(1, true, 15, 3, 2) X(2, true, 9, 5, 1) X(3, true, 15, 2, 1)           \
  X(4, true, 45, 2, 2) X(5, true, 15, 3, 1) X(6, true, 9, 2, 2) X(7, true, 9, 1, 4)           \
  X(20, false, 15, 1, 4) X(21, false, 15, 3, 2) X(22, false, 15, 6, 1) X(23, false, 9, 5, 2)  \
  X(24, false, 18, 5, 1) X(25, false, 10, 3, 2) X(26, false, 9, 10, 1) X(27, false, 45, 2, 1) \
  X(28, false, 5, 3, 2) X(29, false, 9, 2, 2)

// streamed (pair_gemv_stream): (variant, swiglu, C blocks a stage, S stages, W warps); 46-49 and
// 56-59 keep a whole 16-row tile (9 stages of 10 blocks, 5 of 18) or half of it in flight from
// the start: at 1 token every load is requested at once (one round trip, not 5-9), not yet run
#define TINYOSS_STREAMED(X)                                                                   \
  X(40, true, 10, 4, 4) X(41, true, 10, 3, 4) X(42, true, 18, 3, 4) X(43, true, 6, 6, 4)      \
  X(44, true, 10, 4, 2) X(45, true, 10, 6, 2)                                                 \
  X(46, true, 10, 9, 1) X(47, true, 10, 9, 2) X(48, true, 10, 5, 2) X(49, true, 18, 5, 1)     \
  X(50, false, 10, 4, 4) X(51, false, 10, 3, 4) X(52, false, 18, 3, 4) X(53, false, 6, 6, 4)  \
  X(54, false, 10, 4, 2) X(55, false, 10, 6, 2)                                               \
  X(56, false, 10, 9, 1) X(57, false, 10, 9, 2) X(58, false, 10, 9, 4) X(59, false, 18, 5, 2)

// gate_up (bf16 x) or down (fp32 x), as the name says; -1 for an unknown variant
extern "C" int tinyoss_pair_variant(int variant, const void* x, int x_div, const int* ids,
                                    int pairs, const uint8_t* q, const uint8_t* s,
                                    const void* bias, const float* wts, float* out, int N, int K,
                                    long stride_qe, int stride_q, long stride_se, float alpha,
                                    float limit, void* stream) {
  switch (variant) {
#define TINYOSS_CASE(V, SW, U, KS, TL)                                                    \
  case V:                                                                                     \
    return launch<SW, U, KS, TL, std::conditional_t<SW, __nv_bfloat16, float>>(           \
        x, x_div, ids, pairs, q, s, bias, wts, out, N, K, stride_qe, stride_q, stride_se,     \
        alpha, limit, static_cast<cudaStream_t>(stream));
    TINYOSS_VARIANTS(TINYOSS_CASE)
#define TINYOSS_SCASE(V, SW, C, S, W)                                                         \
  case V:                                                                                     \
    return launch_stream<SW, C, S, W, std::conditional_t<SW, __nv_bfloat16, float>>(          \
        x, x_div, ids, pairs, q, s, bias, wts, out, N, K, stride_qe, stride_q, stride_se,     \
        alpha, limit, static_cast<cudaStream_t>(stream));
    TINYOSS_STREAMED(TINYOSS_SCASE)
  }
  return -1;
}

extern "C" const char* tinyoss_pair_variant_name(int variant) {
  switch (variant) {
#define TINYOSS_NAME(V, SW, U, KS, TL) \
  case V:                              \
    return SW ? "gate_up U" #U " KSPLIT" #KS " TILES" #TL : "down U" #U " KSPLIT" #KS " TILES" #TL;
    TINYOSS_VARIANTS(TINYOSS_NAME)
#define TINYOSS_SNAME(V, SW, C, S, W) \
  case V:                             \
    return SW ? "gate_up streamed C" #C " S" #S " W" #W : "down streamed C" #C " S" #S " W" #W;
    TINYOSS_STREAMED(TINYOSS_SNAME)
  }
  return nullptr;
}

// The grouped kernel (group_gemv_mma) with other row tiles: (variant, swiglu, U, TILES)
#define TINYOSS_GROUPED(X)                                                                    \
  X(100, true, 9, 2) X(101, true, 9, 4) X(102, true, 9, 6) X(103, true, 9, 12)                \
  X(104, true, 9, 15) X(105, true, 9, 20) X(106, true, 15, 12) X(107, true, 5, 12)            \
  X(108, true, 6, 15)                                                                         \
  X(110, false, 9, 2) X(111, false, 9, 4) X(112, false, 9, 6) X(113, false, 9, 12)            \
  X(114, false, 9, 15) X(115, false, 9, 20) X(116, false, 15, 12) X(117, false, 5, 12)        \
  X(118, false, 6, 15)

// The streamed grouped kernel (group_gemv_stream): (variant, swiglu, C, S, W)
#define TINYOSS_GROUPED_STREAM(X)                                                             \
  X(170, true, 10, 3, 4) X(171, true, 10, 3, 6) X(172, true, 10, 4, 4) X(173, true, 6, 4, 6)  \
  X(174, true, 6, 3, 4) X(175, true, 10, 2, 6)                                                \
  X(180, false, 10, 3, 12) X(181, false, 6, 3, 12) X(182, false, 10, 2, 12)                   \
  X(183, false, 6, 4, 9) X(184, false, 10, 3, 6) X(185, false, 6, 3, 6)

extern "C" int tinyoss_grouped_variant(int variant, const void* x, int x_div, const int* groups,
                                       int G, const int* sorted_ids, const int* order, int pairs,
                                       const uint8_t* q, const uint8_t* s, const void* bias,
                                       const float* wts, float* out, int N, int K,
                                       long stride_qe, int stride_q, long stride_se, float alpha,
                                       float limit, void* stream) {
  (void)pairs;
  switch (variant) {
#define TINYOSS_GCASE(V, SW, U, TL)                                                           \
  case V:                                                                                     \
    return launch_grouped<SW, U, TL, std::conditional_t<SW, __nv_bfloat16, float>>(           \
        x, x_div, groups, G, sorted_ids, order, q, s, bias, wts, out, N, K, stride_qe,        \
        stride_q, stride_se, alpha, limit, static_cast<cudaStream_t>(stream));
    TINYOSS_GROUPED(TINYOSS_GCASE)
#define TINYOSS_GSCASE(V, SW, C, S, W)                                                        \
  case V:                                                                                     \
    return launch_grouped_stream<SW, C, S, W, std::conditional_t<SW, __nv_bfloat16, float>>(  \
        x, x_div, groups, G, sorted_ids, order, q, s, bias, wts, out, N, K, stride_qe,        \
        stride_q, stride_se, alpha, limit, static_cast<cudaStream_t>(stream));
    TINYOSS_GROUPED_STREAM(TINYOSS_GSCASE)
  }
  return -1;
}

extern "C" const char* tinyoss_grouped_variant_name(int variant) {
  switch (variant) {
#define TINYOSS_GNAME(V, SW, U, TL) \
  case V:                           \
    return SW ? "grouped gate_up U" #U " TILES" #TL : "grouped down U" #U " TILES" #TL;
    TINYOSS_GROUPED(TINYOSS_GNAME)
#define TINYOSS_GSNAME(V, SW, C, S, W)                                 \
  case V:                                                              \
    return SW ? "grouped gate_up streamed C" #C " S" #S " W" #W        \
              : "grouped down streamed C" #C " S" #S " W" #W;
    TINYOSS_GROUPED_STREAM(TINYOSS_GSNAME)
  }
  return nullptr;
}
