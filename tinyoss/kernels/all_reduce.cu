// The small all-reduces of a tensor-parallel decode step (two a layer, a few KB each) among the
// GPUs of one host, in one launch and one trip over NVLink, optionally fused with the residual
// add and RMSNorm after it. Each rank stores its rows straight into a slot of every rank's
// receive buffer (peer-to-peer stores into PyTorch symmetric memory), then sums what arrived in
// its own. There is no flag and no barrier: a receive buffer holds bf16 -0.0 (0x8000) wherever
// nothing has arrived, and no sender sends -0.0 (it sends +0.0, the same number), so a value has
// arrived once it is not -0.0 (Lamport's trick, as TensorRT-LLM's one-shot all-reduce does it).
//
// Three slots rotate (`state[0]`): a call writes slot s and clears, in its own buffer, the
// slot its previous call read, (s + 2) % 3. No rank can be more than one call ahead of another
// (a call waits for every rank's rows), so nobody writes into a slot while it is cleared.
// `state[1]` holds what the previous call used, `state[2]` counts the blocks that have read
// the state; block 0 advances it once all have.
//
// The rows may also come as the experts' uncombined output: fp32 [rows * topk, hidden], a row a
// (token, expert) pair, which the kernel sums over each token's pairs (those of id -1, held by
// another rank, left out) and rounds to bf16 before sending, as moe_triton's `_combine` does:
// the combine's launch goes.
// After attention (`one_shot_route`), the all-reduce also takes what follows it up to the
// experts, as layer_ops_triton's `_norm_route_kernel` does after an unfused all-reduce: G
// programs a token each send 1/G of its row, wait for the whole row, add the residual and take
// the RMSNorm (each program the whole row; program 0 stores it and the new residual), compute
// the router logits of EPB experts, and the token's last program to finish (a ticket) takes the
// top-k and their softmax.
// Sums run in fp32 in rank order, the same on every rank, and round to bf16 once: the sum of
// two ranks is NCCL's exactly. Fused (the experts' all-reduce): residual' = bf16(bf16(sum) +
// residual), out = bf16(weight * (residual' * rsqrt(mean(residual'^2) + eps))), as the unfused
// path (NCCL, then rms_norm_torch's contract) rounds it.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cstdint>

namespace {

constexpr int MAX_RANKS = 8;
constexpr int MAX_THREADS = 1024;      // a row's 16-byte vectors, one a thread
constexpr uint32_t NEG_ZERO2 = 0x80008000u;  // two bf16 -0.0: nothing has arrived
constexpr int ROUTE_MAX_ROWS = 8;  // tokens one_shot_route takes (its programs all resident)
constexpr int ROUTE_MAX_THREADS = 512;  // its rows: hidden up to 4096

struct Peers {
  uint4* buf[MAX_RANKS];  // every rank's receive buffer: 3 slots of `slot` vectors
};

__device__ __forceinline__ uint4 load_volatile(const uint4* p) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ bool arrived(uint4 v) {
  return !(__vcmpeq2(v.x, NEG_ZERO2) | __vcmpeq2(v.y, NEG_ZERO2) | __vcmpeq2(v.z, NEG_ZERO2) |
           __vcmpeq2(v.w, NEG_ZERO2));
}

__device__ __forceinline__ uint32_t plus_zero(uint32_t w) { return w & ~__vcmpeq2(w, NEG_ZERO2); }

__device__ __forceinline__ float lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float hi(uint32_t w) { return __uint_as_float(w & 0xFFFF0000u); }

__device__ __forceinline__ uint32_t pack(float a, float b) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&h);
}

__device__ __forceinline__ void unpack(uint4 v, float (&f)[8]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) f[2 * i] = lo(w[i]), f[2 * i + 1] = hi(w[i]);
}

__device__ __forceinline__ uint4 pack8(const float (&f)[8]) {
  return make_uint4(pack(f[0], f[1]), pack(f[2], f[3]), pack(f[4], f[5]), pack(f[6], f[7]));
}

// The block's sum of v (every thread gets it).
__device__ __forceinline__ float block_sum(float v, float* shared) {
#pragma unroll
  for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = lane < (blockDim.x >> 5) ? shared[lane] : 0.f;
#pragma unroll
  for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
  return v;
}

// Block b takes row b, thread i its vector i (8 bf16). n: vectors in a rank's rows (rows * vpr).
template <int NR, bool NORM>
__global__ void __launch_bounds__(MAX_THREADS, 1)
    one_shot(const uint4* __restrict__ in, const float4* __restrict__ pairs,
             const int* __restrict__ ids, int topk, Peers peers, uint4* own, int rank,
             int* state, long slot, int n, int vpr, uint4* out, uint4* residual,
             const float* __restrict__ weight, float eps) {
  __shared__ int shared_state[2];
  __shared__ float partial[32];
  if (threadIdx.x == 0) {
    shared_state[0] = state[0];
    shared_state[1] = state[1];
    __threadfence();
    atomicAdd(state + 2, 1);  // read: block 0 may advance the state
  }
  __syncthreads();
  const int s = shared_state[0], cleared = shared_state[1];
  const int i = threadIdx.x;
  const bool mine = i < vpr;
  const long at = (long)blockIdx.x * vpr + i;
  if (mine) {
    uint4 v;
    if (topk == 0) {
      v = in[at];
    } else {
      float f[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      for (int k = 0; k < topk; ++k) {
        const long pair = (long)blockIdx.x * topk + k;
        if (ids[pair] < 0) continue;
        const float4 a = pairs[pair * 2 * vpr + 2 * i], b = pairs[pair * 2 * vpr + 2 * i + 1];
        f[0] += a.x, f[1] += a.y, f[2] += a.z, f[3] += a.w;
        f[4] += b.x, f[5] += b.y, f[6] += b.z, f[7] += b.w;
      }
      v = pack8(f);
    }
    v = make_uint4(plus_zero(v.x), plus_zero(v.y), plus_zero(v.z), plus_zero(v.w));
#pragma unroll
    for (int r = 0; r < NR; ++r) peers.buf[r][s * slot + (long)rank * n + at] = v;
  }
  uint4* previous = own + ((s + 2) % 3) * slot;
  const uint4 empty = make_uint4(NEG_ZERO2, NEG_ZERO2, NEG_ZERO2, NEG_ZERO2);
  for (long j = (long)blockIdx.x * blockDim.x + i; j < cleared; j += (long)gridDim.x * blockDim.x)
    previous[j] = empty;
  float x[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  if (mine) {
    const uint4* got = own + s * slot + at;
    uint4 parts[NR];
    bool done;
    do {
      done = true;
#pragma unroll
      for (int r = 0; r < NR; ++r) {
        parts[r] = load_volatile(got + (long)r * n);
        done &= arrived(parts[r]);
      }
    } while (!done);
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      float f[8];
      unpack(parts[r], f);
#pragma unroll
      for (int k = 0; k < 8; ++k) x[k] += f[k];
    }
  }
  if constexpr (!NORM) {
    if (mine) out[at] = pack8(x);
  } else {
    float squares = 0.f;
    if (mine) {
      float res[8];
      unpack(pack8(x), x);  // the all-reduce's result in bf16, as the unfused path has it
      unpack(residual[at], res);
#pragma unroll
      for (int k = 0; k < 8; ++k) x[k] += res[k];
      const uint4 added = pack8(x);
      residual[at] = added;
      unpack(added, x);
#pragma unroll
      for (int k = 0; k < 8; ++k) squares += x[k] * x[k];
    }
    const float inv = rsqrtf(block_sum(squares, partial) / (8.f * vpr) + eps);
    if (mine) {
      const float4 w0 = reinterpret_cast<const float4*>(weight)[2 * i];
      const float4 w1 = reinterpret_cast<const float4*>(weight)[2 * i + 1];
      const float w[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
#pragma unroll
      for (int k = 0; k < 8; ++k) x[k] = w[k] * (x[k] * inv);
      out[at] = pack8(x);
    }
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    while (atomicAdd(state + 2, 0) != (int)gridDim.x) {
    }
    state[0] = (s + 1) % 3;
    state[1] = NR * n;
    state[2] = 0;
  }
}

// The block's sums of v[0..M) (every thread gets them); `shared` holds 32 * M floats.
template <int M>
__device__ __forceinline__ void block_sums(float (&v)[M], float* shared) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
  for (int m = 0; m < M; ++m) {
#pragma unroll
    for (int o = 16; o; o >>= 1) v[m] += __shfl_xor_sync(0xFFFFFFFFu, v[m], o);
    if (lane == 0) shared[warp * M + m] = v[m];
  }
  __syncthreads();
#pragma unroll
  for (int m = 0; m < M; ++m) {
    v[m] = lane < (blockDim.x >> 5) ? shared[lane * M + m] : 0.f;
#pragma unroll
    for (int o = 16; o; o >>= 1) v[m] += __shfl_xor_sync(0xFFFFFFFFu, v[m], o);
  }
  __syncthreads();  // shared may be written again
}

constexpr int EPB = 4;          // router rows (experts) a program
constexpr int MAX_EXPERTS = 256;  // the top-k's warp holds 8 logits a lane

// The K largest of the token's E logits (lowest index among equals) by one warp, K rounds of
// argmax, and their softmax: weights and ids (id - first inside [first, end), else -1: expert
// parallelism), as layer_ops_triton's `_topk_softmax`.
__device__ void warp_topk(const float* logits, int E, int K, int first, int end, float* top_w,
                          int* top_ids) {
  const int lane = threadIdx.x & 31;
  float v[MAX_EXPERTS / 32];
#pragma unroll
  for (int j = 0; j < MAX_EXPERTS / 32; ++j) {
    const int e = lane + 32 * j;
    v[j] = e < E ? *reinterpret_cast<const volatile float*>(logits + e) : -INFINITY;
  }
  float best_v0 = 0.f, sum = 0.f;
  unsigned picked = 0u;  // bit j: lane + 32 j is taken
  for (int k = 0; k < K; ++k) {
    float bv = -INFINITY;
    int bi = MAX_EXPERTS;
#pragma unroll
    for (int j = 0; j < MAX_EXPERTS / 32; ++j) {
      const int e = lane + 32 * j;
      const bool free = e < E && !(picked >> j & 1u);
      if (free && (bi == MAX_EXPERTS || v[j] > bv || (v[j] == bv && e < bi))) bv = v[j], bi = e;
    }
#pragma unroll
    for (int o = 16; o; o >>= 1) {
      const float ov = __shfl_xor_sync(0xFFFFFFFFu, bv, o);
      const int oi = __shfl_xor_sync(0xFFFFFFFFu, bi, o);
      if (oi != MAX_EXPERTS && (bi == MAX_EXPERTS || ov > bv || (ov == bv && oi < bi)))
        bv = ov, bi = oi;
    }
#pragma unroll
    for (int j = 0; j < MAX_EXPERTS / 32; ++j)
      if (lane + 32 * j == bi) picked |= 1u << j;
    if (k == 0) best_v0 = bv;
    const float p = expf(bv - best_v0);
    sum += p;
    if (lane == 0) {
      top_w[k] = p;
      top_ids[k] = bi >= first && bi < end ? bi - first : -1;
    }
  }
  __syncwarp();
  if (lane < K) top_w[lane] = top_w[lane] / sum;
}

template <int NR>
__global__ void __launch_bounds__(ROUTE_MAX_THREADS, 1)
    one_shot_route(const uint4* __restrict__ in, Peers peers, uint4* own, int rank, int* state,
                   long slot, int n, int vpr, const uint4* __restrict__ residual, uint4* res_out,
                   uint4* out, const float* __restrict__ weight, float eps,
                   const uint4* __restrict__ router_w, const __nv_bfloat16* __restrict__ router_b,
                   int experts, float* logits, int topk, int first, int end, float* top_w,
                   int* top_ids) {
  __shared__ int shared_state[2];
  __shared__ float partial[32 * EPB];
  __shared__ int last;
  const int t = blockIdx.x, g = blockIdx.y, programs = gridDim.y;
  int* tickets = state + 3;
  if (threadIdx.x == 0) {
    shared_state[0] = state[0];
    shared_state[1] = state[1];
    __threadfence();
    atomicAdd(state + 2, 1);
  }
  const int i = threadIdx.x;
  const bool mine = i < vpr;
  // the router rows first: they do not wait for the other GPUs
  uint4 wr[EPB];
#pragma unroll
  for (int e = 0; e < EPB; ++e) {
    const int ex = g * EPB + e;
    wr[e] = mine && ex < experts ? router_w[(long)ex * vpr + i] : make_uint4(0u, 0u, 0u, 0u);
  }
  __syncthreads();
  const int s = shared_state[0], cleared = shared_state[1];
  const int share = (vpr + programs - 1) / programs;  // this program sends vectors g*share..
  if (i < share && g * share + i < vpr) {
    const long at = (long)t * vpr + g * share + i;
    uint4 v = in[at];
    v = make_uint4(plus_zero(v.x), plus_zero(v.y), plus_zero(v.z), plus_zero(v.w));
#pragma unroll
    for (int r = 0; r < NR; ++r) peers.buf[r][s * slot + (long)rank * n + at] = v;
  }
  uint4* previous = own + ((s + 2) % 3) * slot;
  const uint4 empty = make_uint4(NEG_ZERO2, NEG_ZERO2, NEG_ZERO2, NEG_ZERO2);
  const long program = (long)t * programs + g, all = (long)gridDim.x * programs;
  for (long j = program * blockDim.x + i; j < cleared; j += all * blockDim.x) previous[j] = empty;
  const long at = (long)t * vpr + i;
  float x[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  float sq[1] = {0.f};
  if (mine) {
    const uint4* got = own + s * slot + at;
    uint4 parts[NR];
    bool done;
    do {
      done = true;
#pragma unroll
      for (int r = 0; r < NR; ++r) {
        parts[r] = load_volatile(got + (long)r * n);
        done &= arrived(parts[r]);
      }
    } while (!done);
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      float f[8];
      unpack(parts[r], f);
#pragma unroll
      for (int k = 0; k < 8; ++k) x[k] += f[k];
    }
    float res[8];
    unpack(pack8(x), x);  // the all-reduce's result in bf16, as the unfused path has it
    unpack(residual[at], res);
#pragma unroll
    for (int k = 0; k < 8; ++k) x[k] += res[k];
    const uint4 added = pack8(x);
    if (g == 0) res_out[at] = added;
    unpack(added, x);
#pragma unroll
    for (int k = 0; k < 8; ++k) sq[0] += x[k] * x[k];
  }
  block_sums<1>(sq, partial);
  const float inv = rsqrtf(sq[0] / (8.f * vpr) + eps);
  float l[EPB] = {};
  if (mine) {
    const float4 w0 = reinterpret_cast<const float4*>(weight)[2 * i];
    const float4 w1 = reinterpret_cast<const float4*>(weight)[2 * i + 1];
    const float w[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
#pragma unroll
    for (int k = 0; k < 8; ++k) x[k] = w[k] * (x[k] * inv);
    const uint4 normed = pack8(x);
    if (g == 0) out[at] = normed;
    unpack(normed, x);  // the router reads the normed row in bf16
#pragma unroll
    for (int e = 0; e < EPB; ++e) {
      float f[8];
      unpack(wr[e], f);
#pragma unroll
      for (int k = 0; k < 8; ++k) l[e] += f[k] * x[k];
    }
  }
  block_sums<EPB>(l, partial);
  if (threadIdx.x == 0) {
#pragma unroll
    for (int e = 0; e < EPB; ++e) {
      const int ex = g * EPB + e;
      // rounded as the router's output is in the unfused path (a linear layer in bf16)
      if (ex < experts)
        logits[(long)t * experts + ex] =
            __bfloat162float(__float2bfloat16_rn(l[e] + __bfloat162float(router_b[ex])));
    }
    __threadfence();
    last = atomicAdd(tickets + t, 1) == programs - 1;
  }
  __syncthreads();
  if (last && threadIdx.x < 32) {
    __threadfence();
    warp_topk(logits + (long)t * experts, experts, topk, first, end, top_w + (long)t * topk,
              top_ids + (long)t * topk);
    if (threadIdx.x == 0) tickets[t] = 0;
  }
  if (t == 0 && g == 0 && threadIdx.x == 0) {
    while (atomicAdd(state + 2, 0) != (int)all) {
    }
    state[0] = (s + 1) % 3;
    state[1] = NR * n;
    state[2] = 0;
  }
}

template <int NR>
cudaError_t launch(bool norm, dim3 grid, dim3 block, cudaStream_t stream, const uint4* in,
                   const float4* pairs, const int* ids, int topk, const Peers& peers, int rank,
                   int* state, long slot, int n, int vpr, uint4* out, uint4* residual,
                   const float* weight, float eps) {
  uint4* own = peers.buf[rank];  // (a kernel indexing its parameter by rank copies it to memory)
  if (norm)
    one_shot<NR, true><<<grid, block, 0, stream>>>(in, pairs, ids, topk, peers, own, rank, state,
                                                   slot, n, vpr, out, residual, weight, eps);
  else
    one_shot<NR, false><<<grid, block, 0, stream>>>(in, pairs, ids, topk, peers, own, rank,
                                                    state, slot, n, vpr, out, residual, weight,
                                                    eps);
  return cudaGetLastError();
}

}  // namespace

// rows x hidden bf16 `in` summed over the `ranks` GPUs into `out`; or, with `pairs` and `ids`
// (in null), each row the sum of its `topk` fp32 pair rows whose id is not negative; with
// `residual` and `weight` (float32 [hidden]) also residual += sum and out = RMSNorm(residual).
// `peers`: every rank's receive buffer (host array), each 3 * `slot` 16-byte vectors, filled
// with 0x8000 before the first call; `state`: 3 ints on this GPU, zero before the first call.
extern "C" int tinyoss_all_reduce(const void* in, const float* pairs, const int* ids, int topk,
                                  int rows, int hidden, void* const* peers, int ranks, int rank,
                                  int* state, long slot, void* out, void* residual,
                                  const float* weight, float eps, void* stream) {
  const int vpr = hidden / 8;
  if (rows < 1 || hidden < 8 || hidden % 8 || vpr > MAX_THREADS || rank < 0 || rank >= ranks ||
      (long)ranks * rows * vpr > slot || (residual == nullptr) != (weight == nullptr) ||
      (in == nullptr) == (pairs == nullptr) || (pairs != nullptr) != (ids != nullptr) ||
      (pairs != nullptr) != (topk > 0))
    return (int)cudaErrorInvalidValue;
  Peers p{};
  for (int r = 0; r < ranks; ++r) p.buf[r] = static_cast<uint4*>(peers[r]);
  const dim3 grid(rows), block((vpr + 31) / 32 * 32);
  const auto* x = static_cast<const uint4*>(in);
  const auto* y = reinterpret_cast<const float4*>(pairs);
  auto* o = static_cast<uint4*>(out);
  auto* res = static_cast<uint4*>(residual);
  const bool norm = residual != nullptr;
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  const int n = rows * vpr;
  switch (ranks) {
    case 2: return (int)launch<2>(norm, grid, block, st, x, y, ids, topk, p, rank, state, slot,
                                  n, vpr, o, res, weight, eps);
    case 4: return (int)launch<4>(norm, grid, block, st, x, y, ids, topk, p, rank, state, slot,
                                  n, vpr, o, res, weight, eps);
    case 8: return (int)launch<8>(norm, grid, block, st, x, y, ids, topk, p, rank, state, slot,
                                  n, vpr, o, res, weight, eps);
    default: return (int)cudaErrorInvalidValue;
  }
}

// `one_shot_route`: `in` (rows x hidden bf16, rows <= ROUTE_MAX_ROWS) summed over the ranks,
// plus `residual` into `res_out`, its RMSNorm (`weight` float32) into `out`, the router's
// logits (`router_w` bf16 [experts, hidden], `router_b` bf16) into `logits` (fp32 [rows,
// experts], scratch), their top `topk` softmax weights and ids into `top_w`, `top_ids`. `state`
// holds 3 + ROUTE_MAX_ROWS ints (the tickets after the three), zero before the first call.
extern "C" int tinyoss_all_reduce_route(const void* in, int rows, int hidden, void* const* peers,
                                        int ranks, int rank, int* state, long slot,
                                        const void* residual, void* res_out, void* out,
                                        const float* weight, float eps, const void* router_w,
                                        const void* router_b, int experts, float* logits,
                                        int topk, int first, int end, float* top_w,
                                        int* top_ids, void* stream) {
  const int vpr = hidden / 8;
  const int programs = (experts + EPB - 1) / EPB;
  if (rows < 1 || rows > ROUTE_MAX_ROWS || hidden < 8 || hidden % 8 || vpr > ROUTE_MAX_THREADS ||
      rank < 0 || rank >= ranks || (long)ranks * rows * vpr > slot || experts < 1 ||
      experts > MAX_EXPERTS || topk < 1 || topk > 32 || topk > experts)
    return (int)cudaErrorInvalidValue;
  Peers p{};
  for (int r = 0; r < ranks; ++r) p.buf[r] = static_cast<uint4*>(peers[r]);
  uint4* own = p.buf[rank];
  const dim3 grid(rows, programs), block((vpr + 31) / 32 * 32);
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  const auto* x = static_cast<const uint4*>(in);
  const auto* res = static_cast<const uint4*>(residual);
  auto* ro = static_cast<uint4*>(res_out);
  auto* o = static_cast<uint4*>(out);
  const auto* rw = static_cast<const uint4*>(router_w);
  const auto* rb = static_cast<const __nv_bfloat16*>(router_b);
  const int n = rows * vpr;
#define TINYOSS_ROUTE(NR)                                                                     \
  one_shot_route<NR><<<grid, block, 0, st>>>(x, p, own, rank, state, slot, n, vpr, res, ro, o, \
                                             weight, eps, rw, rb, experts, logits, topk, first, \
                                             end, top_w, top_ids)
  switch (ranks) {
    case 2: TINYOSS_ROUTE(2); break;
    case 4: TINYOSS_ROUTE(4); break;
    case 8: TINYOSS_ROUTE(8); break;
    default: return (int)cudaErrorInvalidValue;
  }
#undef TINYOSS_ROUTE
  return (int)cudaGetLastError();
}

extern "C" const char* tinyoss_all_reduce_error(int err) {
  return cudaGetErrorString(static_cast<cudaError_t>(err));
}
