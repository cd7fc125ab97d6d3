// elementwise.cu: RMSNorm, rotary embeddings, SwiGLU and the MoE output
// combine. Each output element is computed by one thread with the CPU
// tier's own sequence of f32 operations (intrinsics with explicit rounding,
// so nothing is fused into an FMA behind our back); only RMSNorm has a
// reduction, and it is fixed by the row length alone.
#include "common.cuh"

#define RN_THREADS 256
#define RN_WARPS (RN_THREADS / 32)

#define RN_PER 8

// One row of RMSNorm by one block: y = w * (x * rsqrt(mean(x²) + eps)),
// with ADD first x = x + a (the residual add, stored back to x). The sum of
// squares is taken in f64 as the CPU tier does (each square is exact in
// f64), in a fixed order: thread i sums elements i, i + 256, ... and the
// partial sums meet in a fixed tree. Rows of up to RN_PER · 256 values are
// held in registers with their weights, which are loaded before the
// reduction (same values, same operations, one pass over memory).
template <bool ADD>
__device__ __forceinline__ void rms_norm_row(float* xr, const float* ar, const float* __restrict__ w,
                                             float* yr, u32 n, float eps, double* scratch) {
    double ss = 0.0;
    float xv[RN_PER], wv[RN_PER], av[RN_PER];
    const bool held = n <= RN_PER * RN_THREADS;
    if (held) {
        // Every load first, then the adds and their stores: a store to x
        // between the loads would make each later load wait for it (x and
        // a are not known apart here), a chain of round trips.
#pragma unroll
        for (int k = 0; k < RN_PER; ++k) {
            const u32 i = threadIdx.x + k * RN_THREADS;
            xv[k] = 0.0f;
            wv[k] = 0.0f;
            av[k] = 0.0f;
            if (i < n) {
                xv[k] = xr[i];
                if (ADD) av[k] = ar[i];
                wv[k] = w[i];
            }
        }
        if (ADD) {
#pragma unroll
            for (int k = 0; k < RN_PER; ++k) {
                const u32 i = threadIdx.x + k * RN_THREADS;
                if (i < n) {
                    xv[k] = __fadd_rn(xv[k], av[k]);
                    xr[i] = xv[k];
                }
            }
        }
#pragma unroll
        for (int k = 0; k < RN_PER; ++k) {
            const u32 i = threadIdx.x + k * RN_THREADS;
            if (i < n) {
                const double v = (double)xv[k];
                ss += v * v;
            }
        }
    } else {
        for (u32 i = threadIdx.x; i < n; i += RN_THREADS) {
            float f = xr[i];
            if (ADD) {
                f = __fadd_rn(f, ar[i]);
                xr[i] = f;
            }
            const double v = (double)f;
            ss += v * v;
        }
    }
    const double total = block_sum_f64<RN_WARPS>(ss, scratch);
    const float var = (float)(total / (double)n);
    const float r = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(var, eps)));
    if (held) {
#pragma unroll
        for (int k = 0; k < RN_PER; ++k) {
            const u32 i = threadIdx.x + k * RN_THREADS;
            if (i < n) yr[i] = __fmul_rn(wv[k], __fmul_rn(xv[k], r));
        }
    } else {
        for (u32 i = threadIdx.x; i < n; i += RN_THREADS) yr[i] = __fmul_rn(w[i], __fmul_rn(xr[i], r));
    }
}

// y[row] = w * (x[row] * rsqrt(mean(x[row]²) + eps)) for `rows` rows of `n`
// values (one block per row; x and y may be the same buffer).
extern "C" __global__ void __launch_bounds__(RN_THREADS)
    rms_norm(const float* x, u32 x_stride, const float* __restrict__ w, float* y, u32 y_stride,
             u32 n, float eps) {
    pdl_entry(PDL_REL_NORM);
    __shared__ double scratch[RN_WARPS];
    const u64 row = blockIdx.x;
    rms_norm_row<false>((float*)(x + row * x_stride), nullptr, w, y + row * y_stride, n, eps,
                        scratch);
}

// The residual add and the next RMSNorm in one pass: x[row] += a[row], then
// y[row] = RMSNorm(x[row]) as `rms_norm` computes it (one block per row;
// x, a and y distinct).
extern "C" __global__ void __launch_bounds__(RN_THREADS)
    add_rms_norm(float* __restrict__ x, const float* __restrict__ a, const float* __restrict__ w,
                 float* __restrict__ y, u32 n, float eps) {
    pdl_entry(PDL_REL_ADD_NORM);
    __shared__ double scratch[RN_WARPS];
    const u64 row = blockIdx.x;
    rms_norm_row<true>(x + row * n, a + row * n, w, y + row * n, n, eps, scratch);
}

#define RP_THREADS 64
#define RP_MAX_DIM 1024

// Rotates dims [offset, offset + rot_dim) of every head in place; one block
// per (head, token). cos/sin are host-computed tables of `half = rot_dim/2`
// columns per position (YaRN's attention factor already applied), and
// pos[token] picks the row. Halves layout: pair j is (x[j], x[j + half]).
// Interleaved (DeepSeek): pair j is (x[2j], x[2j + 1]) and the result is
// written de-interleaved, rotated evens first, as transformers does.
extern "C" __global__ void __launch_bounds__(RP_THREADS)
    rope(float* x, u32 tok_stride, u32 head_stride, u32 offset, u32 rot_dim,
         const float* __restrict__ cos_t, const float* __restrict__ sin_t,
         const u32* __restrict__ pos, u32 table_rows, u32 interleaved) {
    pdl_entry();
    __shared__ float tmp[RP_MAX_DIM];
    const u32 head = blockIdx.x, tok = blockIdx.y;
    const u32 p = pos[tok];
    float* h = x + (u64)tok * tok_stride + (u64)head * head_stride + offset;
    const u32 half = rot_dim / 2;
    // Positions live on the device, out of the host's sight: one past the
    // table turns the head's rotary dims into NaN (loudly wrong) instead of
    // reading outside the table.
    if (p >= table_rows) {
        for (u32 i = threadIdx.x; i < rot_dim; i += RP_THREADS) h[i] = __int_as_float(0x7fc00000);
        return;
    }
    for (u32 i = threadIdx.x; i < rot_dim; i += RP_THREADS) tmp[i] = h[i];
    __syncthreads();
    const float* c = cos_t + (u64)p * half;
    const float* s = sin_t + (u64)p * half;
    for (u32 j = threadIdx.x; j < half; j += RP_THREADS) {
        const float a = interleaved ? tmp[2 * j] : tmp[j];
        const float b = interleaved ? tmp[2 * j + 1] : tmp[j + half];
        h[j] = __fsub_rn(__fmul_rn(a, c[j]), __fmul_rn(b, s[j]));
        h[j + half] = __fadd_rn(__fmul_rn(b, c[j]), __fmul_rn(a, s[j]));
    }
}

// GQA's per-head work between the q/k/v projections and attention, in one
// launch: q heads get their RMSNorm (q_w, if given) and rotary embedding;
// k heads their RMSNorm (k_w), rotary embedding, and are appended to the key
// cache; v heads are appended to the value cache. Each step is exactly the
// one rms_norm / rope / kv_append does (the same helper for the norm, the
// same block size, the same rounded operations), in the same order, so the
// bits are theirs. grid = (nh + 2·nkv, rows): block b < nh is q head b,
// then the nkv k heads, then the nkv v heads; row r's position is pos[r]
// and its cache slot slot0[r] + pos[r] (not written past `capacity`).
extern "C" __global__ void __launch_bounds__(RN_THREADS)
    gqa_prep(float* __restrict__ q, float* __restrict__ k, const float* __restrict__ v, u32 nh,
             u32 nkv, u32 hd, const float* __restrict__ q_w, const float* __restrict__ k_w,
             float eps, const float* __restrict__ cos_t, const float* __restrict__ sin_t,
             u32 table_rows, u32 rot_dim, u32 interleaved, const u32* __restrict__ pos,
             const u32* __restrict__ slot0, float* __restrict__ kc, float* __restrict__ vc,
             u32 capacity) {
    pdl_entry(PDL_REL_GQA_PREP);
    __shared__ double scratch[RN_WARPS];
    __shared__ float tmp[RP_MAX_DIM];
    const u32 b = blockIdx.x, tok = blockIdx.y;
    const u32 p = pos[tok];
    const u64 slot = (u64)slot0[tok] + p;
    const u32 kvd = nkv * hd;
    if (b >= nh + nkv) {
        const u32 vh = b - nh - nkv;
        if (slot >= capacity) return;
        const float* src = v + (u64)tok * kvd + (u64)vh * hd;
        float* dst = vc + slot * kvd + (u64)vh * hd;
        for (u32 i = threadIdx.x; i < hd; i += RN_THREADS) dst[i] = src[i];
        return;
    }
    const bool is_q = b < nh;
    float* h = is_q ? q + ((u64)tok * nh + b) * hd : k + (u64)tok * kvd + (u64)(b - nh) * hd;
    const float* w = is_q ? q_w : k_w;
    if (w != nullptr) {
        rms_norm_row<false>(h, nullptr, w, h, hd, eps, scratch);
        __syncthreads();
    }
    const u32 half = rot_dim / 2;
    if (p >= table_rows) {
        for (u32 i = threadIdx.x; i < rot_dim; i += RN_THREADS) h[i] = __int_as_float(0x7fc00000);
    } else {
        for (u32 i = threadIdx.x; i < rot_dim; i += RN_THREADS) tmp[i] = h[i];
        __syncthreads();
        const float* c = cos_t + (u64)p * half;
        const float* sn = sin_t + (u64)p * half;
        for (u32 j = threadIdx.x; j < half; j += RN_THREADS) {
            const float a = interleaved ? tmp[2 * j] : tmp[j];
            const float bb = interleaved ? tmp[2 * j + 1] : tmp[j + half];
            h[j] = __fsub_rn(__fmul_rn(a, c[j]), __fmul_rn(bb, sn[j]));
            h[j + half] = __fadd_rn(__fmul_rn(bb, c[j]), __fmul_rn(a, sn[j]));
        }
    }
    if (is_q || slot >= capacity) return;
    __syncthreads();
    float* dst = kc + slot * kvd + (u64)(b - nh) * hd;
    for (u32 i = threadIdx.x; i < hd; i += RN_THREADS) dst[i] = h[i];
}

#define EW_THREADS 256

// out[t][i] = silu(gate[t][i]) * up[t][i]; grid = (ceil(cols / 256), rows).
// out may be gate or up.
extern "C" __global__ void __launch_bounds__(EW_THREADS)
    swiglu(const float* gate, u32 g_stride, const float* up, u32 u_stride, float* out,
           u32 o_stride, u32 cols) {
    pdl_entry();
    const u32 i = blockIdx.x * EW_THREADS + threadIdx.x;
    const u64 t = blockIdx.y;
    if (i >= cols) return;
    out[t * o_stride + i] = __fmul_rn(silu_f32(gate[t * g_stride + i]), up[t * u_stride + i]);
}

#define CB_MAX_K 64

// The MoE block's output for `rows` rows: the k expert outputs of each row
// (slot_out[row][slot][hidden]) weighted and summed in ascending expert id
// (ties by slot), then the shared expert added, gated by sigmoid of its
// logit when `shared_gate` is given: the CPU tier's order, step for step;
// with `accumulate`, added to out (out += result, the residual add).
// Slot s of row r is row slot_rows[r·k + s] of slot_out when slot_rows is
// given (the experts' outputs where their launch left them, packed by
// expert), else row r·k + s.
// grid = (ceil(hidden / 256), rows). `shared`, `shared_gate` and
// `slot_rows` may be null.
extern "C" __global__ void __launch_bounds__(EW_THREADS)
    moe_combine(const float* __restrict__ slot_out, const u32* __restrict__ slot_rows,
                const u32* __restrict__ experts,
                const float* __restrict__ weights, const float* __restrict__ shared,
                const float* __restrict__ shared_gate, float* __restrict__ out, u32 k,
                u32 hidden, u32 accumulate) {
    pdl_entry();
    __shared__ u32 ids[CB_MAX_K];
    __shared__ u64 src[CB_MAX_K];   // slot_out row of the j-th summand
    __shared__ float wt[CB_MAX_K];  // its weight
    const u64 row = blockIdx.y;
    // The slots in ascending expert id, ties by slot (a stable sort): slot
    // s goes to place #{experts below e_s} + #{earlier slots with e_s}.
    // Every thread of the first k reads and places one slot, so the block
    // waits for one round of loads, not a chain of them: a slot's expert,
    // row and weight are requested together.
    u64 sr = 0;
    float sw = 0.0f;
    if (threadIdx.x < k) {
        const u32 s = threadIdx.x;
        ids[s] = experts[row * k + s];
        sr = slot_rows != nullptr ? (u64)slot_rows[row * k + s] : row * k + s;
        sw = weights[row * k + s];
    }
    __syncthreads();
    if (threadIdx.x < k) {
        const u32 s = threadIdx.x, e = ids[s];
        u32 place = 0;
        for (u32 j = 0; j < k; ++j) place += (ids[j] < e || (ids[j] == e && j < s)) ? 1u : 0u;
        src[place] = sr;
        wt[place] = sw;
    }
    __syncthreads();
    const u32 i = blockIdx.x * EW_THREADS + threadIdx.x;
    if (i >= hidden) return;
    float acc = 0.0f;
    // In order; eight summands' loads in flight at a time.
#pragma unroll 8
    for (u32 j = 0; j < k; ++j) acc = __fadd_rn(acc, __fmul_rn(slot_out[src[j] * hidden + i], wt[j]));
    if (shared != nullptr) {
        const float sv = shared[row * hidden + i];
        acc = __fadd_rn(acc, shared_gate != nullptr ? __fmul_rn(sigmoid_f32(shared_gate[row]), sv) : sv);
    }
    // accumulate: the residual add folded in (out is the residual stream).
    out[row * hidden + i] = accumulate ? __fadd_rn(out[row * hidden + i], acc) : acc;
}
