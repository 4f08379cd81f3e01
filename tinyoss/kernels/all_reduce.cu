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
// (a call waits for every rank's rows), so nobody writes into a slot while it is cleared. That
// needs each rank's calls to run one after another (one stream, no programmatic dependent
// launch), as the engine runs them. `state[1]` holds what the previous call used, `state[2]`
// counts the blocks that have read the state; block 0 advances it once all have. A rank that
// never sends leaves the others spinning (no timeout, as in TensorRT-LLM's): the engine ends a
// group whose worker is gone.
//
// The rows may also come as the experts' uncombined output: fp32 [rows * topk, hidden], a row a
// (token, expert) pair, which the kernel sums over each token's pairs (those of id -1, held by
// another rank, left out) and rounds to bf16 before sending, as moe_triton's `_combine` does;
// so the combine needs no launch of its own.
// Sums run in fp32 in rank order, the same on every rank, and round to bf16 once: the sum of
// two ranks is NCCL's exactly (but a zero is +0.0). Fused (the experts' all-reduce):
// residual' = bf16(bf16(sum) + residual), as the unfused path (NCCL, then rms_norm_torch's
// contract) rounds it, and out = bf16(weight * (residual' * rsqrt(mean(residual'^2) + eps))),
// within rounding of that path's norm (another summation order, rsqrtf).
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cstdint>

namespace {

constexpr int MAX_RANKS = 8;
constexpr int MAX_THREADS = 1024;      // a row's 16-byte vectors, one a thread
constexpr uint32_t NEG_ZERO2 = 0x80008000u;  // two bf16 -0.0: nothing has arrived

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

extern "C" const char* tinyoss_all_reduce_error(int err) {
  return cudaGetErrorString(static_cast<cudaError_t>(err));
}
