// rows.cu: the row plumbing of the engine's layer on the GPU — residual
// adds, biases, clamps, gathers and strided copies. None reduces anything:
// each output element is one thread's one (or no) rounded f32 operation,
// the CPU tier's own, so these kernels never change a value's bits.
#include "common.cuh"

#define RW_THREADS 256

// y[i] = y[i] + a[i] for n elements (the residual stream: the CPU tier's
// `*x += a`). grid = ceil(n / 256) blocks (x), with y ≠ a.
extern "C" __global__ void __launch_bounds__(RW_THREADS)
    add_inplace(float* __restrict__ y, const float* __restrict__ a, u64 n) {
    pdl_entry();
    const u64 i = (u64)blockIdx.x * RW_THREADS + threadIdx.x;
    if (i < n) y[i] = __fadd_rn(y[i], a[i]);
}

// y[t][i] = y[t][i] + b[i]: a linear layer's bias on `rows` rows of `cols`.
// grid = (ceil(cols / 256), rows).
extern "C" __global__ void __launch_bounds__(RW_THREADS)
    add_bias(float* __restrict__ y, const float* __restrict__ b, u32 cols) {
    pdl_entry();
    const u32 i = blockIdx.x * RW_THREADS + threadIdx.x;
    if (i >= cols) return;
    const u64 at = (u64)blockIdx.y * cols + i;
    y[at] = __fadd_rn(y[at], b[i]);
}

// y[i] = clamp(y[i], -c, c) (clip_qkv), NaN kept as NaN like f32::clamp.
extern "C" __global__ void __launch_bounds__(RW_THREADS)
    clamp_inplace(float* __restrict__ y, u64 n, float c) {
    pdl_entry();
    const u64 i = (u64)blockIdx.x * RW_THREADS + threadIdx.x;
    if (i >= n) return;
    const float v = y[i];
    y[i] = v != v ? v : fminf(fmaxf(v, -c), c);
}

// dst[r][0..cols) = src[idx[r]][0..cols) with row strides in floats:
// the rows that chose an expert packed together, and back. grid =
// (ceil(cols / 256), rows of dst).
extern "C" __global__ void __launch_bounds__(RW_THREADS)
    gather_rows(const float* __restrict__ src, u32 src_stride, const u32* __restrict__ idx,
                float* __restrict__ dst, u32 dst_stride, u32 cols) {
    pdl_entry();
    const u32 i = blockIdx.x * RW_THREADS + threadIdx.x;
    if (i >= cols) return;
    const u64 r = blockIdx.y;
    dst[r * dst_stride + i] = src[(u64)idx[r] * src_stride + i];
}

// dst[r][0..cols) = src[r][0..cols) with row strides in floats (into and
// out of the KV cache, column slices of a row). grid = (ceil(cols / 256),
// rows).
extern "C" __global__ void __launch_bounds__(RW_THREADS)
    copy_2d(const float* __restrict__ src, u32 src_stride, float* __restrict__ dst,
            u32 dst_stride, u32 cols) {
    pdl_entry();
    const u32 i = blockIdx.x * RW_THREADS + threadIdx.x;
    if (i >= cols) return;
    const u64 r = blockIdx.y;
    dst[r * dst_stride + i] = src[r * src_stride + i];
}
