// The MoE GEMV grouped by expert on tensor cores: an experiment (see README.md beside this).
// It reuses the product kernel's helpers (block_mma, pack, to_f) by including
// its source; built with torch's load_inline by bench.py.
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>

#include "../../../tinyoss/kernels/moe_gemv_mma.cu"

namespace {
// Grouped by expert: the pairs sorted by expert, a program takes up to 8 pairs of one expert
// (one per column of B) and reads the expert's rows once for all of them. Program s of the
// grid starts a group when sorted position s is the first of its expert's run or 8, 16, ...
// after it; the others exit at once. x (bf16 or fp32) is staged per column as fp16 pairs
// (SPLIT: also the fp32 remainder, two more MMAs).
template <bool SWIGLU, bool SPLIT, int U, int KSPLIT, typename XT, int TILES>
__global__ void __launch_bounds__(TILES * KSPLIT * 32)
    group_gemv_mma(const XT* __restrict__ x, int x_div, const int* __restrict__ sorted_ids,
                   const int* __restrict__ order, int P, const uint8_t* __restrict__ q,
                   const uint8_t* __restrict__ s, const float* __restrict__ bias,
                   const float* __restrict__ wts, float* __restrict__ out, int N, int K,
                   long stride_qe, int stride_q, long stride_se, float alpha, float limit) {
  constexpr int ROWS = 16 * TILES;  // weight rows a program (TILES 16-row tiles)
  extern __shared__ uint4 smem[];
  const int start = blockIdx.x;
  const int e = sorted_ids[start];
  if (start > 0 && sorted_ids[start - 1] == e) {
    int r = start;
    while (r > 0 && sorted_ids[r - 1] == e) --r;
    if ((start - r) % 8) return;
  }
  int count = 1;
  while (count < 8 && start + count < P && sorted_ids[start + count] == e) ++count;
  const int nblk = K / 32, KP = K / 8 + 1;  // a column's stride, padded against bank conflicts
  uint4* xs = smem;                          // [8][KP] fp16 pairs (hi)
  uint4* xl = smem + 8 * KP;                 // [8][KP] (lo), SPLIT only
  uint8_t* ss = (uint8_t*)(smem + (SPLIT ? 2 : 1) * 8 * KP);  // [ROWS][nblk]
  const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) % TILES;
  const int part = (threadIdx.x >> 5) / TILES, per = nblk / KSPLIT, first = part * per;
  const int g = lane >> 2, t = lane & 3;
  const int row0 = blockIdx.y * ROWS;
  const int la = SWIGLU ? 2 * (warp * 8 + g) : warp * 16 + g;
  const int lb = SWIGLU ? la + 1 : la + 8;
  const uint32_t* qa = reinterpret_cast<const uint32_t*>(q + (long)e * stride_qe +
                                                         (long)(row0 + la) * stride_q) + t + 4 * first;
  const uint32_t* qb = reinterpret_cast<const uint32_t*>(q + (long)e * stride_qe +
                                                         (long)(row0 + lb) * stride_q) + t + 4 * first;
  uint32_t wa[U], wb[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    wa[u] = __ldg(qa + 4 * u);
    wb[u] = __ldg(qb + 4 * u);
  }
  const uint4* sg = reinterpret_cast<const uint4*>(s + (long)e * stride_se + (long)row0 * nblk);
  for (int i = threadIdx.x; i < ROWS * nblk / 16; i += blockDim.x) {
    reinterpret_cast<uint4*>(ss)[i] = sg[i];
  }
  for (int i = threadIdx.x; i < 8 * (K / 8); i += blockDim.x) {
    const int j = i / (K / 8), w = i % (K / 8);
    __half h[8], l[8];
    if (j < count) {
      const XT* xr = x + (long)(order[start + j] / x_div) * K;
#pragma unroll
      for (int c = 0; c < 8; ++c) {
        const float v = to_f(xr[8 * w + c]);
        h[c] = __float2half_rn(v);
        l[c] = __float2half_rn(v - __half2float(h[c]));
      }
    } else {
#pragma unroll
      for (int c = 0; c < 8; ++c) h[c] = l[c] = __float2half_rn(0.f);
    }
    xs[j * KP + w] = make_uint4(pack(h[0], h[4]), pack(h[1], h[5]), pack(h[2], h[6]), pack(h[3], h[7]));
    if (SPLIT) {
      xl[j * KP + w] = make_uint4(pack(l[0], l[4]), pack(l[1], l[5]), pack(l[2], l[6]), pack(l[3], l[7]));
    }
  }
  __syncthreads();
  float acc[4] = {0.f, 0.f, 0.f, 0.f};  // rows g, g (cols 2t, 2t + 1), g + 8, g + 8
  for (int b0 = 0; b0 < per; b0 += U) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int b = first + b0 + u;
      float d[4] = {0.f, 0.f, 0.f, 0.f};
      block_mma<SPLIT>(d, wa[u], wb[u], xs[g * KP + 4 * b + t],
                       SPLIT ? xl[g * KP + 4 * b + t] : uint4{});
      const float sa = __uint_as_float((uint32_t)ss[la * nblk + b] << 23);
      const float sb = __uint_as_float((uint32_t)ss[lb * nblk + b] << 23);
      acc[0] = fmaf(d[0], sa, acc[0]);
      acc[1] = fmaf(d[1], sa, acc[1]);
      acc[2] = fmaf(d[2], sb, acc[2]);
      acc[3] = fmaf(d[3], sb, acc[3]);
    }
    if (b0 + U < per) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        wa[u] = __ldg(qa + 4 * (b0 + U + u));
        wb[u] = __ldg(qb + 4 * (b0 + U + u));
      }
    }
  }
  if (KSPLIT > 1) {
    float4* red = reinterpret_cast<float4*>(smem);
    __syncthreads();
    if (part > 0) red[((part - 1) * TILES + warp) * 32 + lane] = make_float4(acc[0], acc[1], acc[2], acc[3]);
    __syncthreads();
    if (part > 0) return;
#pragma unroll
    for (int p = 1; p < KSPLIT; ++p) {
      const float4 o = red[((p - 1) * TILES + warp) * 32 + lane];
      acc[0] += o.x; acc[1] += o.y; acc[2] += o.z; acc[3] += o.w;
    }
  }
  const int ra = row0 + la, rb = row0 + lb;
  const float ba = bias[(long)e * N + ra], bb = bias[(long)e * N + rb];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int c = 2 * t + i;
    if (c < count) {
      const int pair = order[start + c];
      const float ha = acc[i] * 16384.f + ba, hb = acc[2 + i] * 16384.f + bb;
      if (SWIGLU) {
        const float gate = fminf(ha, limit);
        const float up = fminf(fmaxf(hb, -limit), limit);
        out[(long)pair * (N / 2) + ra / 2] = (up + 1.f) * gate / (1.f + __expf(-alpha * gate));
      } else {
        const float wt = wts[pair];
        out[(long)pair * N + ra] = ha * wt;
        out[(long)pair * N + rb] = hb * wt;
      }
    }
  }
}

}  // namespace

template <bool SWIGLU, bool SPLIT, int U, int KSPLIT, typename XT, int TILES = 4>
void launch_grouped(const torch::Tensor& x, int x_div, const torch::Tensor& sorted_ids,
                    const torch::Tensor& order, const torch::Tensor& q, const torch::Tensor& s,
                    const torch::Tensor& bias, const torch::Tensor& wts, torch::Tensor& out,
                    double alpha, double limit) {
  constexpr int ROWS = 16 * TILES;
  const int N = q.size(1), K = q.size(2) * 32, P = sorted_ids.numel();
  TORCH_CHECK(N % ROWS == 0 && K % (32 * U * KSPLIT) == 0, "shape");
  const int smem = (SPLIT ? 2 : 1) * 8 * (K / 8 + 1) * 16 + ROWS * (K / 32);
  auto kernel = group_gemv_mma<SWIGLU, SPLIT, U, KSPLIT, XT, TILES>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  dim3 grid(P, N / ROWS);
  kernel<<<grid, TILES * KSPLIT * 32, smem, at::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const XT*>(x.data_ptr()), x_div, sorted_ids.data_ptr<int>(),
      order.data_ptr<int>(), P, q.data_ptr<uint8_t>(), s.data_ptr<uint8_t>(),
      bias.data_ptr<float>(), wts.data_ptr<float>(), out.data_ptr<float>(), N, K, q.stride(0),
      q.stride(1), s.stride(0), (float)alpha, (float)limit);
}

// grouped variants: 0 (U 15, 1 part), 1 (U 9, 2 parts); down: 2 = variant 1 with the fp32
// remainder (SPLIT); 3: U 9, 1 part, 12 tiles (192 rows a program); 4: U 9, 2 parts, 6 tiles
void gate_up_grouped(torch::Tensor x, int64_t x_div, torch::Tensor sorted_ids, torch::Tensor order,
                     torch::Tensor q, torch::Tensor s, torch::Tensor bias, torch::Tensor wts,
                     torch::Tensor out, double alpha, double limit, int64_t variant) {
  if (variant == 0) launch_grouped<true, false, 15, 1, __nv_bfloat16>(x, x_div, sorted_ids, order, q, s, bias, wts, out, alpha, limit);
  else if (variant == 3) launch_grouped<true, false, 9, 1, __nv_bfloat16, 12>(x, x_div, sorted_ids, order, q, s, bias, wts, out, alpha, limit);
  else if (variant == 4) launch_grouped<true, false, 9, 2, __nv_bfloat16, 6>(x, x_div, sorted_ids, order, q, s, bias, wts, out, alpha, limit);
  else launch_grouped<true, false, 9, 2, __nv_bfloat16>(x, x_div, sorted_ids, order, q, s, bias, wts, out, alpha, limit);
}

void down_grouped(torch::Tensor x, int64_t x_div, torch::Tensor sorted_ids, torch::Tensor order,
                  torch::Tensor q, torch::Tensor s, torch::Tensor bias, torch::Tensor wts,
                  torch::Tensor out, double alpha, double limit, int64_t variant) {
  if (variant == 0) launch_grouped<false, false, 15, 1, float>(x, x_div, sorted_ids, order, q, s, bias, wts, out, alpha, limit);
  else if (variant == 1) launch_grouped<false, false, 9, 2, float>(x, x_div, sorted_ids, order, q, s, bias, wts, out, alpha, limit);
  else if (variant == 3) launch_grouped<false, true, 9, 1, float, 12>(x, x_div, sorted_ids, order, q, s, bias, wts, out, alpha, limit);
  else if (variant == 4) launch_grouped<false, true, 9, 2, float, 6>(x, x_div, sorted_ids, order, q, s, bias, wts, out, alpha, limit);
  else launch_grouped<false, true, 9, 2, float>(x, x_div, sorted_ids, order, q, s, bias, wts, out, alpha, limit);
}
