// Does a CUDA graph replay slower once its kernel functions sit in more graphs, without PyTorch,
// Triton or the model? graph_gaps.py found the batch-1 decode graph ~55 us (170 kernels) slower
// once the model's kernels were captured into 3 more graphs of any kind. This builds a graph
// like it (NODES kernels of FUNCS distinct functions, each streaming a few MB), times its
// replays, does one variant, times again. One variant a process (the slowdown stays).
//
//   nvcc -O3 -std=c++17 -arch=sm_90a graph_count.cu -o graph_count
//   for v in none again again3 small small_copies small_upload small_reinst small_priority \
//            small_destroyed; do ./graph_count $v; done
//   for how in raw auto side auto_side prio auto_prio auto_prio_side; do
//     ./graph_count small $how; ./graph_count again3 $how; done
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <vector>

#define CHECK(x)                                                                  \
  do {                                                                            \
    cudaError_t e_ = (x);                                                         \
    if (e_ != cudaSuccess) {                                                      \
      std::printf("%s failed: %s\n", #x, cudaGetErrorString(e_));                 \
      std::exit(1);                                                               \
    }                                                                             \
  } while (0)

constexpr int FUNCS = 12, NODES = 170, N4 = 1 << 18;  // 4 MB of float4 a node

// F: which function; COPY: a second, identical set of functions for the extra graphs
template <int F, int COPY>
__global__ void work(const float4* __restrict__ in, float* __restrict__ out, int n) {
  float acc = 0.f;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const float4 v = in[i];
    acc += v.x * (F + 1) + v.y + v.z + v.w;
  }
  if (acc == 12345.f) out[F] = acc;  // keeps the loads
}

using Kernel = void (*)(const float4*, float*, int);
template <int COPY, int... F>
std::vector<Kernel> table(std::integer_sequence<int, F...>) {
  return {work<F, COPY>...};
}

void launch(const std::vector<Kernel>& k, int node, const float4* in, float* out,
            cudaStream_t s) {
  k[node % FUNCS]<<<264, 256, 0, s>>>(in + (size_t)(node % 8) * N4, out, N4);
}

// PyTorch's ways, to tell which matters (argv[2]): torch.cuda.CUDAGraph instantiates every graph
// with cudaGraphInstantiateFlagAutoFreeOnLaunch | cudaGraphInstantiateFlagUseNodePriority and
// captures on a side stream; "auto" and "prio" add one flag to every graph, "side" captures on
// a stream of its own and replays on another; combine them ("auto_prio_side" is PyTorch's).
static unsigned long long extra_flags = 0;
static cudaStream_t capture_stream = nullptr;

cudaGraphExec_t capture(const std::vector<Kernel>& k, int nodes, const float4* in, float* out,
                        cudaStream_t s, unsigned long long flags = 0) {
  cudaGraph_t g;
  cudaGraphExec_t ge;
  if (capture_stream) s = capture_stream;
  CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (int n = 0; n < nodes; ++n) launch(k, n, in, out, s);
  CHECK(cudaStreamEndCapture(s, &g));
  CHECK(cudaGraphInstantiateWithFlags(&ge, g, flags | extra_flags));
  CHECK(cudaGraphDestroy(g));
  return ge;
}

double replay_us(cudaGraphExec_t ge, cudaStream_t s) {
  std::vector<double> t;
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  for (int rep = 0; rep < 5; ++rep) {
    CHECK(cudaEventRecord(a, s));
    for (int i = 0; i < 50; ++i) CHECK(cudaGraphLaunch(ge, s));
    CHECK(cudaEventRecord(b, s));
    CHECK(cudaEventSynchronize(b));
    float ms;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms * 1000.0 / 50);
  }
  std::sort(t.begin(), t.end());
  return t[2];
}

int main(int argc, char** argv) {
  const char* v = argc > 1 ? argv[1] : "none";
  const char* how = argc > 2 ? argv[2] : "raw";
  if (std::strstr(how, "auto")) extra_flags |= cudaGraphInstantiateFlagAutoFreeOnLaunch;
  if (std::strstr(how, "prio")) extra_flags |= cudaGraphInstantiateFlagUseNodePriority;
  if (std::strstr(how, "side")) {
    CHECK(cudaStreamCreateWithFlags(&capture_stream, cudaStreamNonBlocking));
  }
  float4* in;
  float* out;
  CHECK(cudaMalloc(&in, sizeof(float4) * N4 * 8));
  CHECK(cudaMemset(in, 0, sizeof(float4) * N4 * 8));
  CHECK(cudaMalloc(&out, 64 * sizeof(float)));
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const auto k0 = table<0>(std::make_integer_sequence<int, FUNCS>{});
  const auto k1 = table<1>(std::make_integer_sequence<int, FUNCS>{});
  const bool priority = !std::strcmp(v, "small_priority");
  cudaGraphExec_t g0 =
      capture(k0, NODES, in, out, s, priority ? cudaGraphInstantiateFlagUseNodePriority : 0);
  CHECK(cudaGraphUpload(g0, s));
  const double before = replay_us(g0, s), before2 = replay_us(g0, s);
  std::vector<cudaGraphExec_t> extra;
  if (!std::strncmp(v, "again", 5)) {  // "again": 1 more copy of the graph, "again3": 3
    for (int i = 0; i < (v[5] == '3' ? 3 : 1); ++i) extra.push_back(capture(k0, NODES, in, out, s));
  } else if (!std::strncmp(v, "small", 5)) {  // 3 graphs of one node of each function
    const auto& k = !std::strcmp(v, "small_copies") ? k1 : k0;
    for (int i = 0; i < 3; ++i) extra.push_back(capture(k, FUNCS, in, out, s));
    for (auto ge : extra) CHECK(cudaGraphLaunch(ge, s));
  }
  CHECK(cudaStreamSynchronize(s));
  if (!std::strcmp(v, "small_upload")) CHECK(cudaGraphUpload(g0, s));
  if (!std::strcmp(v, "small_reinst")) {
    CHECK(cudaGraphExecDestroy(g0));
    g0 = capture(k0, NODES, in, out, s);
  }
  if (!std::strcmp(v, "small_destroyed")) {
    for (auto ge : extra) CHECK(cudaGraphExecDestroy(ge));
  }
  const double after = replay_us(g0, s), after2 = replay_us(g0, s);
  std::printf("%-14s %-16s before %8.1f %8.1f us  after %8.1f %8.1f us  (%+.1f)\n", how, v,
              before, before2, after, after2, after - before);
  return 0;
}
