// What a dependency between two phases of a GPU decode step costs: a
// kernel boundary inside a CUDA graph (plain, and with programmatic
// dependent launch, as colibri launches on sm_90+), against a grid-wide
// barrier inside one persistent kernel (a counter and a generation word; a
// release reduction with an acquire spin; cooperative groups' grid.sync).
// Every phase reads what the previous one wrote, an L2 round trip, as a
// decode step's launches do. A measurement tool, not part of the engine
// (whose kernels are in cuda/kernels and compiled by NVRTC); on a machine
// with the CUDA toolkit:
//
//     nvcc -O2 -arch=sm_90 tools/sync_cost.cu -o /tmp/sync_cost && /tmp/sync_cost
//
// Results: docs/benchmarks.md, "What a dependency between launches costs".
#include <cstdio>
#include <cuda_runtime.h>
#include <cooperative_groups.h>
namespace cg = cooperative_groups;
#include <vector>
#include <algorithm>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); return 1; } } while (0)

__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_launch() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

// One phase: every block reads the previous phase's value, block 0 thread 0
// writes the next one.
__global__ void phase(unsigned* buf, int i, int pdl) {
    if (pdl) { pdl_wait(); pdl_launch(); }
    unsigned v = *(volatile unsigned*)&buf[i];
    if (blockIdx.x == 0 && threadIdx.x == 0) buf[i + 1] = v + 1;
}

// A grid barrier: arrive on a counter, the last arriver bumps the
// generation, the others spin on it.
__device__ __forceinline__ void grid_barrier(unsigned* count, volatile unsigned* gen, unsigned nblocks) {
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned g = *gen;
        __threadfence();
        unsigned arrived = atomicAdd(count, 1);
        if (arrived == nblocks - 1) {
            *count = 0;
            __threadfence();
            atomicAdd((unsigned*)gen, 1);
        } else {
            while (*gen == g) { }
        }
        __threadfence();
    }
    __syncthreads();
}

// A monotonic counter: every block adds 1 without waiting for the reply
// (red.release), then spins until the counter reaches its target.
__device__ __forceinline__ void grid_barrier_red(unsigned* count, unsigned target) {
    __syncthreads();
    if (threadIdx.x == 0) {
        asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(count) : "memory");
        unsigned v;
        do {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(count) : "memory");
        } while (v < target);
    }
    __syncthreads();
}

__global__ void persistent_red(unsigned* buf, int n, unsigned* count) {
    for (int i = 0; i < n; ++i) {
        unsigned v = *(volatile unsigned*)&buf[i];
        if (blockIdx.x == 0 && threadIdx.x == 0) buf[i + 1] = v + 1;
        grid_barrier_red(count, gridDim.x * (unsigned)(i + 1));
    }
}

__global__ void persistent_cg(unsigned* buf, int n) {
    cg::grid_group grid = cg::this_grid();
    for (int i = 0; i < n; ++i) {
        unsigned v = *(volatile unsigned*)&buf[i];
        if (blockIdx.x == 0 && threadIdx.x == 0) buf[i + 1] = v + 1;
        grid.sync();
    }
}

__global__ void persistent(unsigned* buf, int n, unsigned* count, unsigned* gen) {
    for (int i = 0; i < n; ++i) {
        unsigned v = *(volatile unsigned*)&buf[i];
        if (blockIdx.x == 0 && threadIdx.x == 0) buf[i + 1] = v + 1;
        grid_barrier(count, gen, gridDim.x);
    }
}

static float graph_time(int n, int blocks, int threads, int pdl, unsigned* buf, cudaStream_t s) {
    cudaGraph_t g; cudaGraphExec_t ge;
    cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal);
    for (int i = 0; i < n; ++i) {
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(blocks); cfg.blockDim = dim3(threads); cfg.stream = s;
        cudaLaunchAttribute at[1];
        at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        at[0].val.programmaticStreamSerializationAllowed = 1;
        cfg.attrs = at; cfg.numAttrs = pdl ? 1 : 0;
        cudaLaunchKernelEx(&cfg, phase, buf, i, pdl);
    }
    cudaStreamEndCapture(s, &g);
    cudaGraphInstantiate(&ge, g, 0);
    cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
    std::vector<float> t;
    for (int r = 0; r < 12; ++r) {
        cudaEventRecord(a, s); cudaGraphLaunch(ge, s); cudaEventRecord(b, s); cudaEventSynchronize(b);
        float ms; cudaEventElapsedTime(&ms, a, b); if (r >= 2) t.push_back(ms);
    }
    std::sort(t.begin(), t.end());
    cudaGraphExecDestroy(ge); cudaGraphDestroy(g);
    return t[t.size() / 2] * 1000.0f / n;
}

int main() {
    cudaDeviceProp p; CK(cudaGetDeviceProperties(&p, 0));
    printf("%s, %d SMs\n", p.name, p.multiProcessorCount);
    const int n = 2000;
    unsigned *buf, *count, *gen;
    CK(cudaMalloc(&buf, (n + 1) * 4)); CK(cudaMalloc(&count, 4)); CK(cudaMalloc(&gen, 4));
    CK(cudaMemset(buf, 0, (n + 1) * 4)); CK(cudaMemset(count, 0, 4)); CK(cudaMemset(gen, 0, 4));
    cudaStream_t s; CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    int sms = p.multiProcessorCount;
    for (int blocks : {1, sms, 2 * sms, 4 * sms}) {
        for (int threads : {256, 512}) {
            float plain = graph_time(n, blocks, threads, 0, buf, s);
            float pdl = graph_time(n, blocks, threads, 1, buf, s);
            printf("graph of %d launches, %4d blocks x %3d threads: %.3f us per boundary plain, %.3f with PDL\n",
                   n, blocks, threads, plain, pdl);
        }
    }
    CK(cudaGetLastError());
    unsigned host = 0; CK(cudaMemcpy(&host, buf + n, 4, cudaMemcpyDeviceToHost));
    printf("check: %u (want %d)\n", host, n);
    for (int per_sm : {1, 2}) {
        for (int threads : {256, 512}) {
            int blocks = per_sm * sms;
            CK(cudaMemset(buf, 0, (n + 1) * 4));
            cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
            std::vector<float> t;
            for (int r = 0; r < 12; ++r) {
                cudaEventRecord(a, s);
                persistent<<<blocks, threads, 0, s>>>(buf, n, count, gen);
                cudaEventRecord(b, s); CK(cudaEventSynchronize(b));
                float ms; cudaEventElapsedTime(&ms, a, b); if (r >= 2) t.push_back(ms);
            }
            std::sort(t.begin(), t.end());
            CK(cudaMemcpy(&host, buf + n, 4, cudaMemcpyDeviceToHost));
            printf("persistent kernel, %4d blocks x %3d threads, %d barriers: %.3f us per barrier (check %u)\n",
                   blocks, threads, n, t[t.size() / 2] * 1000.0f / n, host);
        }
    }
    for (int variant = 0; variant < 2; ++variant) {
        for (int per_sm : {1, 2}) {
            int threads = 256, blocks = per_sm * sms;
            CK(cudaMemset(buf, 0, (n + 1) * 4));
            cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
            std::vector<float> t;
            for (int r = 0; r < 12; ++r) {
                CK(cudaMemset(count, 0, 4));
                cudaEventRecord(a, s);
                if (variant == 0) {
                    persistent_red<<<blocks, threads, 0, s>>>(buf, n, count);
                } else {
                    int nn = n;
                    void* args[] = {&buf, &nn};
                    CK(cudaLaunchCooperativeKernel((void*)persistent_cg, blocks, threads, args, 0, s));
                }
                cudaEventRecord(b, s); CK(cudaEventSynchronize(b));
                float ms; cudaEventElapsedTime(&ms, a, b); if (r >= 2) t.push_back(ms);
            }
            std::sort(t.begin(), t.end());
            CK(cudaMemcpy(&host, buf + n, 4, cudaMemcpyDeviceToHost));
            printf("persistent kernel (%s), %4d blocks x %3d threads: %.3f us per barrier (check %u)\n",
                   variant == 0 ? "red.release + acquire spin" : "cooperative grid.sync",
                   blocks, threads, t[t.size() / 2] * 1000.0f / n, host);
        }
    }
    return 0;
}
