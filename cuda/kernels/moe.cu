// moe.cu: a MoE layer's routing and launch plan on the device, for a layer
// whose routed experts all sit in VRAM (the host then needs to see nothing
// of the layer: no read-back, no synchronization).
//
// The routing is the GPU tier's own (sched/src/gpu/route.rs), written so
// that the host and the device compute it bit for bit alike:
//
//   * exp is `exp_portable`: in f64, k = floor(x·log2(e) + 0.5), r = x − k·ln2,
//     a degree-11 Taylor polynomial in Horner form, scaled by 2^k, rounded
//     once to f32. Every step is one IEEE f64 operation with an explicit
//     rounding intrinsic (no FMA contraction), so the host's plain f64
//     arithmetic gives the same bits;
//   * the softmax denominator is summed in a fixed shape: lane l adds the
//     values l, l + 32, ... in increasing order, then a fixed butterfly
//     (`warp_sum`); the host emulates exactly that;
//   * selection is top-k under f32::total_cmp, ties to the lower index (a
//     total order: any correct algorithm picks the same experts);
//   * the chosen weights are summed by one lane in selection order.
//
// Then the plan of the layer's expert launches (what the host builds in
// sched/src/gpu/experts.rs for the launches it drives): the experts chosen
// by any row, ascending, get launch indices 0, 1, ...; expert i's users (the
// (row, slot) pairs that chose it, in row order) get consecutive pair rows
// from tok_off[i]; the pointer tables get the expert's resident slot
// addresses; launch indices past the last used expert get no tokens (the
// table matvec's blocks leave at once).
//
// Launch: one block of MR_THREADS; warps route rows round-robin.
#include "common.cuh"

#define MR_THREADS 256
#define MR_WARPS (MR_THREADS / 32)
#define MR_MAX_E 256
#define MR_MAX_K 64
// Rows × k the plan keeps in shared memory (the host routes larger passes).
#define MR_MAX_PAIRS 2048
#define MR_NONE 0xffffffffu

// 1/n! for n = 0..11, as f64 bit patterns (the host checks the same bits).
__device__ __forceinline__ double mr_coef(int n) {
    switch (n) {
        case 0: return __longlong_as_double(0x3ff0000000000000ULL);
        case 1: return __longlong_as_double(0x3ff0000000000000ULL);
        case 2: return __longlong_as_double(0x3fe0000000000000ULL);
        case 3: return __longlong_as_double(0x3fc5555555555555ULL);
        case 4: return __longlong_as_double(0x3fa5555555555555ULL);
        case 5: return __longlong_as_double(0x3f81111111111111ULL);
        case 6: return __longlong_as_double(0x3f56c16c16c16c17ULL);
        case 7: return __longlong_as_double(0x3f2a01a01a01a01aULL);
        case 8: return __longlong_as_double(0x3efa01a01a01a01aULL);
        case 9: return __longlong_as_double(0x3ec71de3a556c734ULL);
        case 10: return __longlong_as_double(0x3e927e4fb7789f5cULL);
        default: return __longlong_as_double(0x3e5ae64567f544e4ULL);
    }
}

// e^x, the same bits as sched/src/gpu/route.rs `exp_portable`.
__device__ __forceinline__ float exp_portable(float x) {
    if (x != x) return x;
    if (x > 89.0f) return f32_inf();
    if (x < -104.0f) return 0.0f;
    const double log2e = __longlong_as_double(0x3ff71547652b82feULL);
    const double ln2 = __longlong_as_double(0x3fe62e42fefa39efULL);
    const double xd = (double)x;
    const double k = floor(__dadd_rn(__dmul_rn(xd, log2e), 0.5));
    const double r = __dsub_rn(xd, __dmul_rn(k, ln2));
    double p = mr_coef(11);
#pragma unroll
    for (int n = 10; n >= 0; --n) p = __dadd_rn(__dmul_rn(p, r), mr_coef(n));
    const long long e = (long long)k + 1023;
    const double scale = __longlong_as_double(e << 52);
    return __double2float_rn(__dmul_rn(p, scale));
}

__device__ __forceinline__ float sigmoid_portable(float x) {
    return __fdiv_rn(1.0f, __fadd_rn(1.0f, exp_portable(-x)));
}

// Best (largest key, then smallest index) of every lane's candidate.
__device__ __forceinline__ void mr_warp_argmax(int& key, u32& idx) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const int ok = __shfl_xor_sync(FULL_MASK, key, o);
        const u32 oi = __shfl_xor_sync(FULL_MASK, idx, o);
        if (oi != MR_NONE && (idx == MR_NONE || ok > key || (ok == key && oi < idx))) {
            key = ok;
            idx = oi;
        }
    }
}

// Top-k of vals[0..n) (n ≤ MR_MAX_E) into sel[0..k) (lane 0 writes),
// largest first by total order, ties to the lower index.
__device__ __forceinline__ void mr_top_k(const float* vals, u32 n, u32 k, u32* sel) {
    const u32 lane = threadIdx.x & 31;
    u32 taken = 0;
    for (u32 r = 0; r < k; ++r) {
        int key = 0;
        u32 idx = MR_NONE;
        for (u32 j = 0, i = lane; i < n; ++j, i += 32) {
            if ((taken >> j) & 1u) continue;
            const int kk = total_order_key(vals[i]);
            if (idx == MR_NONE || kk > key) {
                key = kk;
                idx = i;
            }
        }
        mr_warp_argmax(key, idx);
        if (idx != MR_NONE && (idx & 31) == lane) taken |= 1u << (idx >> 5);
        if (lane == 0) sel[r] = idx;
    }
    __syncwarp();
}

// Routes one row with the calling warp: ids and weights of its k choices.
// `a` and `b` are this warp's MR_MAX_E scratch floats, `sel`/`gsel` its k
// and 32 selection slots.
__device__ void mr_route_row(const float* __restrict__ lr, u32 E, u32 k, u32 kind, u32 norm,
                             const float* __restrict__ bias, u32 n_group, u32 topk_group,
                             float scaling, float* a, float* b, u32* sel, float* gs, u32* gsel,
                             u32* out_ids, float* out_w, u32* s_ids) {
    const u32 lane = threadIdx.x & 31;
    if (kind == 0) {
        // Softmax, then top-k of the probabilities.
        float mx = -f32_inf();
        for (u32 i = lane; i < E; i += 32) mx = fmaxf(mx, lr[i]);
        mx = warp_max(mx);
        float s = 0.0f;
#pragma unroll 4
        for (u32 i = lane; i < E; i += 32) {
            const float e = exp_portable(__fsub_rn(lr[i], mx));
            a[i] = e;
            s = __fadd_rn(s, e);
        }
        s = warp_sum(s);
        const float inv = __fdiv_rn(1.0f, s);
        for (u32 i = lane; i < E; i += 32) a[i] = __fmul_rn(a[i], inv);
        __syncwarp();
        mr_top_k(a, E, k, sel);
        if (lane == 0) {
            float sum = 0.0f;
            if (norm)
                for (u32 r = 0; r < k; ++r) sum = __fadd_rn(sum, a[sel[r]]);
            for (u32 r = 0; r < k; ++r) {
                const float w = a[sel[r]];
                out_ids[r] = sel[r];
                s_ids[r] = sel[r];
                out_w[r] = norm ? __fdiv_rn(w, sum) : w;
            }
        }
    } else {
        // Sigmoid scores, bias for the choice, group-limited top-k.
        for (u32 i = lane; i < E; i += 32) {
            const float sc = sigmoid_portable(lr[i]);
            a[i] = sc;
            b[i] = bias != nullptr ? __fadd_rn(sc, bias[i]) : sc;
        }
        __syncwarp();
        const u32 per = E / n_group;
        if (lane < n_group) {
            const float* g = b + lane * per;
            u32 b0 = 0;
            for (u32 i = 1; i < per; ++i)
                if (total_order_key(g[i]) > total_order_key(g[b0])) b0 = i;
            u32 b1 = b0 == 0 ? 1 : 0;
            for (u32 i = 0; i < per; ++i)
                if (i != b0 && total_order_key(g[i]) > total_order_key(g[b1])) b1 = i;
            gs[lane] = __fadd_rn(g[b0], g[b1]);
        }
        __syncwarp();
        mr_top_k(gs, n_group, topk_group, gsel);
        u32 keep = 0;
        for (u32 r = 0; r < topk_group; ++r) keep |= 1u << gsel[r];
        for (u32 i = lane; i < E; i += 32)
            if (!((keep >> (i / per)) & 1u)) b[i] = -f32_inf();
        __syncwarp();
        mr_top_k(b, E, k, sel);
        if (lane == 0) {
            float sum = 0.0f;
            if (norm) {
                for (u32 r = 0; r < k; ++r) sum = __fadd_rn(sum, a[sel[r]]);
                sum = __fadd_rn(sum, 1e-20f);
            }
            for (u32 r = 0; r < k; ++r) {
                float w = a[sel[r]];
                if (norm) w = __fdiv_rn(w, sum);
                out_ids[r] = sel[r];
                s_ids[r] = sel[r];
                out_w[r] = __fmul_rn(w, scaling);
            }
        }
    }
    __syncwarp();
}

// A softmax router's single row (a decode step) routed by the whole block,
// one expert per thread, with mr_route_row's bits: the maximum (exact in
// any order), exp_portable of each logit minus it, the denominator in
// mr_route_row's shape (lane l of warp 0 adds l, l + 32, ... in order, then
// the butterfly), the probabilities; top-k by rank: expert i's place is the
// number of experts before it in total order (larger key, or an equal key
// and a lower index), the order mr_top_k picks them in. Then, as there,
// lane 0 sums the chosen probabilities in selection order. One row routed
// by one warp spent ~2,600 dependent instructions on that warp (ncu, H200:
// 12.7 µs per decode layer).
__device__ void mr_route_one_softmax(const float* __restrict__ lr, u32 E, u32 k, u32 norm,
                                     float* a, int* key, float* red, u32* sel, u32* out_ids,
                                     float* out_w, u32* s_ids) {
    const u32 tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const float v = tid < E ? lr[tid] : -f32_inf();
    const float mx = block_max<MR_WARPS>(v, red);
    const float e = tid < E ? exp_portable(__fsub_rn(v, mx)) : 0.0f;
    if (tid < E) a[tid] = e;
    __syncthreads();
    if (warp == 0) {
        float s = 0.0f;
        for (u32 i = lane; i < E; i += 32) s = __fadd_rn(s, a[i]);
        s = warp_sum(s);
        if (lane == 0) red[MR_WARPS] = __fdiv_rn(1.0f, s);
    }
    __syncthreads();
    const float p = __fmul_rn(e, red[MR_WARPS]);
    const int kp = total_order_key(p);
    if (tid < E) {
        a[tid] = p;
        key[tid] = kp;
    }
    __syncthreads();
    if (tid < E) {
        u32 rank = 0;
#pragma unroll 8
        for (u32 j = 0; j < E; ++j) {
            const int kj = key[j];
            rank += (kj > kp || (kj == kp && j < tid)) ? 1u : 0u;
        }
        if (rank < k) sel[rank] = tid;
    }
    __syncthreads();
    if (warp == 0) {
        if (lane == 0) {
            float sum = 0.0f;
            if (norm)
                for (u32 r = 0; r < k; ++r) sum = __fadd_rn(sum, a[sel[r]]);
            red[MR_WARPS] = sum;
        }
        __syncwarp();
        const float sum = red[MR_WARPS];
        for (u32 r = lane; r < k; r += 32) {
            const float w = a[sel[r]];
            out_ids[r] = sel[r];
            s_ids[r] = sel[r];
            out_w[r] = norm ? __fdiv_rn(w, sum) : w;
        }
    }
}

// logits [rows][E] → out_ids/out_w [rows][k], then the launch plan:
// ptrs: 6 tables of ptr_stride entries (gate, up, down, their scales),
// filled from expert_ptrs [E][6]; tok_off/tok_cnt [table_len]; pairs
// [rows·k] (pair row → token row); pair_of [rows·k] ((row, slot) → pair
// row).
extern "C" __global__ void __launch_bounds__(MR_THREADS)
    moe_route_plan(const float* __restrict__ logits, u32 rows, u32 E, u32 k, u32 kind, u32 norm,
                   const float* __restrict__ bias, u32 n_group, u32 topk_group, float scaling,
                   const u64* __restrict__ expert_ptrs, u32* __restrict__ out_ids,
                   float* __restrict__ out_w, u64* __restrict__ ptrs, u32 ptr_stride,
                   u32* __restrict__ tok_off, u32* __restrict__ tok_cnt, u32 table_len,
                   u32* __restrict__ pairs, u32* __restrict__ pair_of) {
    pdl_entry(PDL_REL_ROUTE_PLAN);
    __shared__ float sa[MR_WARPS][MR_MAX_E];
    __shared__ float sb[MR_WARPS][MR_MAX_E];
    __shared__ u32 ssel[MR_WARPS][MR_MAX_K];
    __shared__ float sgs[MR_WARPS][32];
    __shared__ u32 sgsel[MR_WARPS][32];
    __shared__ u32 ids[MR_MAX_PAIRS];
    __shared__ u32 cnt[MR_MAX_E];
    __shared__ u32 launch_of[MR_MAX_E];
    __shared__ u32 off_of[MR_MAX_E];
    __shared__ u32 used;
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

    if (rows == 1 && kind == 0) {
        // A decode step: the whole block routes the row, and its k chosen
        // experts (one pair each) get launch index and pair row = their
        // rank by expert id, what the general plan below gives them.
        mr_route_one_softmax(logits, E, k, norm, sa[0], (int*)sb[0], sgs[0], ssel[0], out_ids,
                             out_w, ids);
        __syncthreads();
        if (threadIdx.x < k) {
            const u32 r = threadIdx.x, e = ids[r];
            u32 i = 0;
            for (u32 j = 0; j < k; ++j) i += ids[j] < e ? 1u : 0u;
            tok_off[i] = i;
            tok_cnt[i] = 1;
#pragma unroll
            for (int t = 0; t < 6; ++t) ptrs[(u64)t * ptr_stride + i] = expert_ptrs[(u64)e * 6 + t];
            pairs[i] = 0;
            pair_of[r] = i;
        }
        for (u32 i = k + threadIdx.x; i < table_len; i += MR_THREADS) {
            tok_off[i] = 0;
            tok_cnt[i] = 0;
#pragma unroll
            for (int t = 0; t < 6; ++t) ptrs[(u64)t * ptr_stride + i] = 0;
        }
        return;
    }
    for (u32 row = warp; row < rows; row += MR_WARPS)
        mr_route_row(logits + (u64)row * E, E, k, kind, norm, bias, n_group, topk_group, scaling,
                     sa[warp], sb[warp], ssel[warp], sgs[warp], sgsel[warp], out_ids + (u64)row * k,
                     out_w + (u64)row * k, ids + row * k);
    __syncthreads();

    const u32 nk = rows * k;
    for (u32 e = threadIdx.x; e < E; e += MR_THREADS) {
        u32 c = 0;
        for (u32 j = 0; j < nk; ++j) c += ids[j] == e ? 1u : 0u;
        cnt[e] = c;
    }
    __syncthreads();
    // Launch indices and pair offsets in ascending expert order: warp 0
    // scans 32 experts at a time (integer sums: exact in any order).
    if (warp == 0) {
        u32 base_i = 0, base_p = 0;
        for (u32 e0 = 0; e0 < E; e0 += 32) {
            const u32 e = e0 + lane;
            const u32 c = e < E ? cnt[e] : 0u;
            const u32 flag = __ballot_sync(FULL_MASK, c > 0);
            u32 incl = c;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const u32 v = __shfl_up_sync(FULL_MASK, incl, o);
                if (lane >= (u32)o) incl += v;
            }
            if (e < E) {
                launch_of[e] = base_i + __popc(flag & ((1u << lane) - 1u));
                off_of[e] = base_p + incl - c;
            }
            base_i += __popc(flag);
            base_p += __shfl_sync(FULL_MASK, incl, 31);
        }
        if (lane == 0) used = base_i;
    }
    __syncthreads();
    for (u32 e = threadIdx.x; e < E; e += MR_THREADS) {
        const u32 c = cnt[e];
        if (c == 0) continue;
        const u32 i = launch_of[e], off = off_of[e];
        tok_off[i] = off;
        tok_cnt[i] = c;
#pragma unroll
        for (int t = 0; t < 6; ++t) ptrs[(u64)t * ptr_stride + i] = expert_ptrs[(u64)e * 6 + t];
        u32 p = off;
        for (u32 j = 0; j < nk; ++j) {
            if (ids[j] == e) {
                pairs[p] = j / k;
                pair_of[j] = p;
                ++p;
            }
        }
    }
    for (u32 i = used + threadIdx.x; i < table_len; i += MR_THREADS) {
        tok_off[i] = 0;
        tok_cnt[i] = 0;
#pragma unroll
        for (int t = 0; t < 6; ++t) ptrs[(u64)t * ptr_stride + i] = 0;
    }
}

// Appends `rows` rows of `cols` floats to a KV cache part: row r goes to
// slot slot0[r] + pos[r] (positions live on the device, so a captured
// decode step appends at the right place on every replay). A row whose slot
// lies past the cache is not written (the attention kernel answers such a
// row with NaN).
extern "C" __global__ void __launch_bounds__(256)
    kv_append(const float* __restrict__ src, u32 src_stride, float* __restrict__ dst,
              u32 dst_stride, u32 cols, const u32* __restrict__ pos,
              const u32* __restrict__ slot0, u32 capacity) {
    pdl_entry();
    const u32 i = blockIdx.x * 256 + threadIdx.x;
    const u64 r = blockIdx.y;
    if (i >= cols) return;
    const u64 slot = (u64)slot0[r] + pos[r];
    if (slot >= capacity) return;
    dst[slot * dst_stride + i] = src[r * src_stride + i];
}
