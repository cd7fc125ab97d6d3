// common.cuh: helpers shared by every colibri kernel.
//
// The kernels include no system or CUDA header: NVRTC compiles them with
// nothing but its built-ins, so CI needs only libnvrtc (no toolkit) and the
// conversions below are written out exactly instead of taken from
// cuda_fp16.h / cuda_bf16.h.
//
// Determinism: every reduction here has a fixed shape (a butterfly over the
// 32 lanes of a warp, then warps combined in index order), so a value
// depends only on the inputs and the block size, which each kernel fixes at
// compile time.
#pragma once

#define FULL_MASK 0xffffffffu

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

// Weight formats; the numbers are part of the ABI with cuda/src/ops.rs.
#define FMT_F32 0
#define FMT_F16 1
#define FMT_BF16 2
#define FMT_F8E4M3 3
#define FMT_Q8_0 4
#define FMT_Q4_0 5
// Q4_0 weights, each product's input quantized to 8-bit blocks (the CPU
// tier's default arithmetic; matvec.cu).
#define FMT_Q4_0_Q8 6
// Q8_0 weights, likewise.
#define FMT_Q8_0_Q8 7
// ggml Q6_K (super-blocks of 256 in 210 bytes), exact dequantized product.
#define FMT_Q6_K 8
// Q6_K weights with 8-bit activations (the CPU tier's `dot_q6_k_q8`).
#define FMT_Q6_K_Q8 9
// ggml Q4_K (super-blocks of 256 in 144 bytes: 8 sub-blocks of 32, each
// with a 6-bit scale and min), exact dequantized product.
#define FMT_Q4_K 10
// Q4_K weights with 8-bit activations (the CPU tier's `dot_q4_k_q8`).
#define FMT_Q4_K_Q8 11
// ggml Q5_K (Q4_K with a fifth bit per element: 176 bytes), exact.
#define FMT_Q5_K 12
// Q5_K weights with 8-bit activations (the CPU tier's `dot_q5_k_q8`).
#define FMT_Q5_K_Q8 13
// ggml Q4_1, Q5_0 and Q5_1 (blocks of 32 with a scale, Q4_1/Q5_1 a min as
// well, Q5_0/Q5_1 a fifth bit per element: 20, 22 and 24 bytes), exact
// dequantized products: llama.cpp's fallback where a k-quant's 256-element
// super-blocks do not fit a row.
#define FMT_Q4_1 14
#define FMT_Q5_0 15
#define FMT_Q5_1 16
// ggml Q2_K and Q3_K (super-blocks of 256 in 84 and 110 bytes: llama.cpp's
// Q2_K and Q3_K_S/M/L files), IQ4_NL (blocks of 32 in 18 bytes) and
// IQ4_XS (super-blocks of 256 in 136 bytes), whose 4-bit codes index a
// fixed table of 16 values: exact dequantized products.
#define FMT_Q2_K 17
#define FMT_Q3_K 18
#define FMT_IQ4_NL 19
#define FMT_IQ4_XS 20
// The same seven with 8-bit activations: the CPU tier's default arithmetic
// (model/src/kernels/legacy_q8.rs `dot_q4_1_q8`, `_q5_0_q8`, `_q5_1_q8`,
// `dot_iq4_nl_q8`; low_k.rs `dot_q2_k_q8`, `_q3_k_q8`, `dot_iq4_xs_q8`).
#define FMT_Q4_1_Q8 21
#define FMT_Q5_0_Q8 22
#define FMT_Q5_1_Q8 23
#define FMT_Q2_K_Q8 24
#define FMT_Q3_K_Q8 25
#define FMT_IQ4_NL_Q8 26
#define FMT_IQ4_XS_Q8 27
// Whether FMT takes the 8-bit-activation path (matvec_core_q8).
#define FMT_INT_ACT(FMT)                                                                    \
    ((FMT) == FMT_Q4_0_Q8 || (FMT) == FMT_Q8_0_Q8 || (FMT) == FMT_Q6_K_Q8 ||                \
     (FMT) == FMT_Q4_K_Q8 || (FMT) == FMT_Q5_K_Q8 || ((FMT) >= FMT_Q4_1_Q8 && (FMT) <= FMT_IQ4_XS_Q8))

// Four IQ4 codes (bytes 0..15 of `c`) through ggml's kvalues_iq4nl table
// {−127, −104, −83, −65, −49, −35, −22, −10, 1, 13, 25, 38, 53, 69, 89, 113},
// as four signed bytes: two byte permutes pick each code's entry (by its
// low 3 bits) from the table's low and high halves, bit 3 chooses.
__device__ __forceinline__ u32 iq4_values(u32 c) {
    const u32 s = c & 0x07070707u;
    const u32 t = s | s >> 4;
    const u32 sel = (t & 0xffu) | (t >> 8 & 0xff00u);
    const u32 lo = __byte_perm(0xbfad9881u, 0xf6eaddcfu, sel);
    const u32 hi = __byte_perm(0x26190d01u, 0x71594535u, sel);
    const u32 m = ((c >> 3) & 0x01010101u) * 0xffu;
    return (lo & ~m) | (hi & m);
}

// Programmatic dependent launch (sm_90 and later; nothing before). The
// host launches every kernel with programmatic stream serialization
// allowed where the device has it (cuda/src/ops.rs), so a kernel may start
// while the previous kernel of its stream still runs. Every kernel therefore
// calls `pdl_entry()` before it reads anything an earlier launch writes, or
// writes anything an earlier launch reads: `griddepcontrol.wait` returns once
// the previous grid has completed and its writes are visible, which makes
// the order exactly that of a plain launch. Then `launch_dependents` lets the
// next kernel be scheduled at once: its launch latency and whatever it does
// before its own wait (a matvec loads its weights, which no launch writes)
// overlap this kernel. Only device-constant data (weights, tables set up
// before the pass) may be read before `pdl_entry()`.
// (cuda/src/kernels.rs checks that every kernel calls it.)
__device__ __forceinline__ void pdl_entry() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// `pdl_entry()` for a kernel that loads device constants first (a plain
// matvec's first tile of weights): the wait is tied to `dep`, a word those
// loads returned. Untied, ptxas hoisted `griddepcontrol.wait` above loads
// that precede it in the same basic block (`cuobjdump --dump-sass`), so
// they left only after the previous grid had finished. Tied, every load
// is issued before the wait; the wait then also waits for `dep`'s load,
// which the kernel needs anyway.
__device__ __forceinline__ void pdl_entry_after(unsigned dep) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile(
        "{\n\t.reg .pred p;\n\tsetp.ne.u32 p, %0, 0x9e3779b9;\n\t@p griddepcontrol.wait;\n\t"
        "@!p griddepcontrol.wait;\n\t}" ::"r"(dep)
        : "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#else
    (void)dep;
#endif
}

// A kernel that moves little but precedes a launch with much to load (the
// norms before q/k/v and the router) may let its successor be scheduled
// *before* its own wait: the successor's weight loads (which precede its
// own wait) then overlap this kernel's whole life, its wait included,
// instead of only what follows the wait. Still exactly a plain launch's
// order: the successor's wait returns once this grid completes, and this
// grid completes only after its own wait returned, so every earlier
// grid's writes are visible to it too.
//
// `kind` is the caller's bit of PDL_RELEASE_FIRST, which says which of
// them do it; the host sets it from COLIBRI_PDL_RELEASE, for comparing
// (cuda/src/kernels.rs). By default the two norms: on an H100 (48-layer
// synthetic Qwen3-30B-A3B Q4_0, docs/benchmarks.md, 2026-12-06) they
// saved 0.04–0.05 ms of 2.68 per token; attention added nothing more,
// and gqa_prep and the routing plan cost (their successors' early blocks
// sit on multiprocessor slots the launch before them needs).
#define PDL_REL_NORM 1u        // rms_norm
#define PDL_REL_ADD_NORM 2u    // add_rms_norm
#define PDL_REL_ATTENTION 4u   // attention_split
#define PDL_REL_GQA_PREP 8u    // gqa_prep
#define PDL_REL_ROUTE_PLAN 16u // moe_route_plan
#ifndef PDL_RELEASE_FIRST
#define PDL_RELEASE_FIRST (PDL_REL_NORM | PDL_REL_ADD_NORM)
#endif
__device__ __forceinline__ void pdl_entry(unsigned kind) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if ((PDL_RELEASE_FIRST & kind) != 0) {
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
        asm volatile("griddepcontrol.wait;" ::: "memory");
    } else {
        pdl_entry();
    }
#endif
}

__device__ __forceinline__ float f32_inf() { return __int_as_float(0x7f800000); }

// bf16 is the top half of an f32: exact.
__device__ __forceinline__ float bf16_bits_to_f32(u32 bits) { return __uint_as_float(bits << 16); }

// f16 to f32 through the hardware conversion: exact (every f16 is an f32).
__device__ __forceinline__ float f16_bits_to_f32(u32 bits) {
    float f;
    unsigned short h = (unsigned short)bits;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// FP8 e4m3fn (bias 7, no infinities, S.1111.111 is NaN) to f32, exactly,
// without a table (no lane waits on a divergent constant-memory read): the
// 7 magnitude bits placed at the top of an f32's exponent/mantissa give
// (1 + m/8)·2^(e − 127) for e ≥ 1 and the f32 subnormal (m/8)·2^−126 for
// e = 0, so one exact multiplication by 2^120 yields (1 + m/8)·2^(e − 7)
// and m·2^−9, the e4m3 values. (NVRTC keeps f32 subnormals: no -ftz.)
// Checked against the CPU tier's decoder for all 256 codes.
__device__ __forceinline__ float fp8e4m3_to_f32(u32 b) {
    const float v = __uint_as_float(((b & 0x7fu) << 20) | ((b & 0x80u) << 24)) * __int_as_float(0x7b800000);  // 2^120
    return (b & 0x7fu) == 0x7fu ? __int_as_float(0x7fc00000) : v;
}

// Sum over the 32 lanes of a warp: a fixed butterfly, every lane ends with
// the same bits (each step adds two equal-shaped partial sums, and float
// addition is commutative).
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ double warp_sum_f64(double v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

// Block-wide sum for a block of NWARPS warps: warp butterflies, then warp 0
// adds the warp sums in index order. `scratch` holds NWARPS floats. Every
// thread returns the same value.
template <int NWARPS>
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float s = scratch[0];
#pragma unroll
    for (int w = 1; w < NWARPS; ++w) s += scratch[w];
    return s;
}

template <int NWARPS>
__device__ __forceinline__ double block_sum_f64(double v, double* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum_f64(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    double s = scratch[0];
#pragma unroll
    for (int w = 1; w < NWARPS; ++w) s += scratch[w];
    return s;
}

template <int NWARPS>
__device__ __forceinline__ float block_max(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float m = scratch[0];
#pragma unroll
    for (int w = 1; w < NWARPS; ++w) m = fmaxf(m, scratch[w]);
    return m;
}

// The order of Rust's f32::total_cmp as a signed integer key: larger key,
// larger value (NaNs at the ends, -0 < +0), so top-k selection here orders
// exactly as the CPU tier's `ops::top_k`.
__device__ __forceinline__ int total_order_key(float v) {
    int b = __float_as_int(v);
    return b ^ (int)(((u32)(b >> 31)) >> 1);
}

// Sigmoid and SiLU as the CPU tier writes them (`1 / (1 + exp(-x))`,
// `x * sigmoid(x)`), every step rounded on its own (no contraction).
__device__ __forceinline__ float sigmoid_f32(float x) {
    return __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-x)));
}
__device__ __forceinline__ float silu_f32(float x) { return __fmul_rn(x, sigmoid_f32(x)); }

// ---- 8-bit activations (the CPU tier's Q8 quantization of a product's
// input, blocks of 32 values with one f32 scale) ----

// One input element quantized as the CPU's `(v * id).round().clamp(-127.0,
// 127.0) as i8`: roundf rounds half away from zero as Rust's round does;
// the conversion saturates and takes NaN to 0, as Rust's cast does.
__device__ __forceinline__ int q8_of(float v, float id) {
    return max(-127, min(127, __float2int_rz(roundf(__fmul_rn(v, id)))));
}

// amax / 127 correctly rounded, for every amax ≥ 0 (and +inf): one product
// by the rounded reciprocal and one fused correction step (Markstein). A
// unit test (cuda/src/kernels.rs) checks it against IEEE division for
// every f32 whose quotient can be subnormal and for whole binades (the
// steps scale exactly by powers of two elsewhere).
__device__ __forceinline__ float div127(float a) {
    const float y = __int_as_float(0x3c010204);  // RN(1/127)
    const float q = __fmul_rn(a, y);
    const float r = fmaf(-q, 127.0f, a);
    return a == f32_inf() ? a : fmaf(r, y, q);
}

// A row of n activations (n a multiple of 32) quantized once by the kernel
// that produces it, for every 8-bit-activation product that reads it
// (matvec.cu copies its tiles instead of quantizing them again): bytes
// [0, n/2) hold each block's first 16 quants as 4 words (block b at 16·b,
// Q8Tile's `lo`), [n/2, n) its last 16 (`hi`), then the n/32 f32 scales,
// then the n/32 i32 values 8·Σq. Rows lie q8_row_bytes(n) apart (16-byte
// aligned). cuda/src/ops.rs `q8_row_bytes` is the host's copy.
__device__ __forceinline__ u64 q8_row_bytes(u32 n) { return ((u64)n * 5 / 4 + 15) & ~(u64)15; }

// Block `blk` of a Q8 row: the 32 lanes of a warp hold its values in order
// (lane l: value 32·blk + l), and every lane calls this. The same scale,
// quants and sum as matvec.cu's q8_stage gives the block (max and integer
// sums are exact in any order; the scale and each quant are the same
// operations on the same values).
__device__ __forceinline__ void q8_store_block(float v, u8* __restrict__ row, u32 n, u32 blk) {
    const u32 lane = threadIdx.x & 31;
    // NaNs are skipped, as f32::max skips them (fmaxf returns the other).
    const float amax = fmaxf(0.0f, warp_max(fabsf(v)));
    const float d = div127(amax);
    const float id = d > 0.0f ? __frcp_rn(d) : 0.0f;
    const int q = q8_of(v, id);
    int sum = q;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(FULL_MASK, sum, o);
    // Lanes 0–15 write the low 16 bytes of the block, 16–31 the high ones.
    row[(lane < 16 ? 0 : n / 2) + 16 * blk + (lane & 15)] = (u8)q;
    if (lane == 0) {
        ((float*)(row + n))[blk] = d;
        ((int*)(row + n + n / 8))[blk] = 8 * sum;
    }
}
