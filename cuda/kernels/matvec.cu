// matvec.cu: y[t][r] = dot(W[r], x[t]) for every weight format, for up to a
// few tokens per pass (decode and small batches), over one matrix, a
// strided group of matrices, up to three matrices of one width for one
// token (`_seg`: a layer's q, k and v), or a table of matrices anywhere in
// memory (grid.z: the experts of a layer in VRAM cache and staging slots,
// each applied to its own tokens; `_table_glu` computes a gate and an up
// matrix per row and writes silu(gate)·up).
//
// The reduction order of one output element is fixed by `cols` alone:
//
//   * columns are cut into groups of 32 (ggml's block size; the last group
//     of an f32/f16/bf16/fp8 row may be partial);
//   * lane l of the warp that owns the row sums the groups g ≡ l (mod 32)
//     in increasing order, each group's elements in increasing order, one
//     fmaf per element on the element's exact f32 value;
//   * the 32 lane sums are added by a fixed butterfly.
//
// So the result does not depend on the format the weights are stored in
// (a q4_0 row gives bit for bit what its dequantized f32 row gives), nor on
// how many tokens share the launch, nor on where the matrix lies in memory
// (alignment only picks wider loads, never another order), nor on how many
// matrices are in the group.
//
// FMT_Q4_0_Q8 and FMT_Q8_0_Q8 are the other arithmetic: the CPU tier's
// 8-bit activations and integer block sums (matvec_core_q8 below), with
// the same independence from the batch, the placement and the launch shape.
//
// Launch: block = MV_THREADS (8 warps), each warp owns R consecutive rows
// (MV_PLAIN_ROWS_PER_WARP, MV_TABLE_ROWS_PER_WARP, MV_GLU_ROWS_PER_WARP);
// grid = (ceil(rows / 8R), ceil(ntok / NT), matrices) (`_seg`: the three
// matrices' block counts side by side in x). Every launch begins with
// `pdl_entry()` (common.cuh), a one-token plain launch after loading its
// first tile of weights. The tokens of a pass are staged in shared
// memory a tile of MV_TILE_FOR(FMT, NT) columns (2048 with GroupHalfReg)
// at a time, padded by 4 floats every 32 so the lanes' float4 reads hit
// distinct banks.
//
// Memory contract: a weight buffer must be readable up to the next 4-byte
// boundary past its last row (colibri-cuda pads every allocation to 16
// bytes): misaligned q8_0/q4_0/fp8 groups are read as whole aligned words.
#include "common.cuh"

#define MV_WARPS 8
#define MV_THREADS (MV_WARPS * 32)
// Columns staged per tile: 1024 (32 groups, one per lane), or 2048 for one
// token of a format whose groups are loaded whole into registers (q8_0,
// q4_0, fp8, and every 8-bit-activation format but Q2_K; f16/bf16 where
// matvec_core_f takes GroupHalfReg): its lanes
// then own two groups of a tile and load both before using either (twice
// the loads in flight, half the barriers). Either way lane l meets its
// groups in increasing order. (f32 groups, and the other f16/bf16 ones,
// load as they are used; two of them per lane made ptxas spill, as did
// two exact Q6_K groups in its one-token table launch on sm_90, and two
// exact Q5_K groups in its q/k/v launch there, and two Q2_K groups with
// 8-bit activations in its one-token GLU table launch on sm_80.)
#define MV_TILE_FOR(FMT, NT) \
    (((NT) == 1 && ((FMT) == FMT_Q8_0 || (FMT) == FMT_Q4_0 || (FMT) == FMT_F8E4M3 || \
                    (FMT_INT_ACT(FMT) && (FMT) != FMT_Q2_K_Q8))) ? 2048 : 1024)

// Which plain launches load their first tile before `pdl_entry()`: the
// one-token ones of the formats whose groups are loaded whole into
// registers (an f32 group loads as it is used, and several tokens' tiles
// would keep too many registers live across the staging: ptxas spills).
#define MV_EARLY(FMT, NT) ((NT) == 1 && (FMT) != FMT_F32)

template <int FMT> struct Group;

// f32: 32 floats (128 bytes).
template <> struct Group<FMT_F32> {
    const float* p;
    u32 valid;
    bool vec;
    __device__ __forceinline__ void load(const u8* row, u32 g, u32 valid_, float) {
        p = (const float*)row + (u64)g * 32;
        valid = valid_;
        vec = valid == 32 && (((u64)p & 15) == 0);
    }
    __device__ __forceinline__ void zero() { p = nullptr; valid = 0; vec = false; }
    __device__ __forceinline__ float4 get4(int sub) const {
        if (vec) return __ldg((const float4*)p + sub);
        const u32 e = sub * 4;
        float4 r;
        r.x = e + 0 < valid ? __ldg(p + e + 0) : 0.0f;
        r.y = e + 1 < valid ? __ldg(p + e + 1) : 0.0f;
        r.z = e + 2 < valid ? __ldg(p + e + 2) : 0.0f;
        r.w = e + 3 < valid ? __ldg(p + e + 3) : 0.0f;
        return r;
    }
};

// f16 and bf16: 32 halves (64 bytes); `BF` picks the widening.
template <bool BF> struct GroupHalf {
    const u16* p;
    u32 valid;
    int mode;  // 0: 8-byte aligned, 1: 4-byte aligned, 2: 2-byte aligned or partial
    __device__ __forceinline__ static float widen(u32 bits) {
        return BF ? bf16_bits_to_f32(bits & 0xffffu) : f16_bits_to_f32(bits & 0xffffu);
    }
    __device__ __forceinline__ void load(const u8* row, u32 g, u32 valid_, float) {
        p = (const u16*)row + (u64)g * 32;
        valid = valid_;
        const u64 a = (u64)p;
        mode = valid != 32 ? 2 : (a & 7) == 0 ? 0 : (a & 3) == 0 ? 1 : 2;
    }
    __device__ __forceinline__ void zero() { p = nullptr; valid = 0; mode = 2; }
    __device__ __forceinline__ float4 get4(int sub) const {
        const u32 e = sub * 4;
        u32 lo, hi;
        if (mode == 0) {
            uint2 v = __ldg((const uint2*)(p + e));
            lo = v.x;
            hi = v.y;
        } else if (mode == 1) {
            lo = __ldg((const u32*)(p + e));
            hi = __ldg((const u32*)(p + e + 2));
        } else {
            u32 h0 = e + 0 < valid ? __ldg(p + e + 0) : 0u;
            u32 h1 = e + 1 < valid ? __ldg(p + e + 1) : 0u;
            u32 h2 = e + 2 < valid ? __ldg(p + e + 2) : 0u;
            u32 h3 = e + 3 < valid ? __ldg(p + e + 3) : 0u;
            lo = h0 | (h1 << 16);
            hi = h2 | (h3 << 16);
        }
        return make_float4(widen(lo), widen(lo >> 16), widen(hi), widen(hi >> 16));
    }
};
template <> struct Group<FMT_F16> : GroupHalf<false> {};
template <> struct Group<FMT_BF16> : GroupHalf<true> {};

// Element 4·sub .. 4·sub + 3 of a whole group held as four uint4.
template <bool BF>
__device__ __forceinline__ float4 half_group4(const uint4 (&q)[4], int sub) {
    const uint4 v = q[sub >> 1];
    const u32 lo = (sub & 1) ? v.z : v.x, hi = (sub & 1) ? v.w : v.y;
    return make_float4(GroupHalf<BF>::widen(lo), GroupHalf<BF>::widen(lo >> 16),
                       GroupHalf<BF>::widen(hi), GroupHalf<BF>::widen(hi >> 16));
}

// f16 and bf16 for one token: a whole, 16-byte-aligned group's 64 bytes are
// loaded into registers at `load` (four 16-byte loads in flight per group,
// where GroupHalf requests 8 bytes as each is used); other groups go
// through GroupHalf. Either way `get4` returns the same values. Measured
// on the H200 (cuda/examples/bench_kernels.rs, gpu_decode): a 768 × 2048
// bf16 matrix alone 4.95 → 3.12 µs; 80 of them in one launch 1.18 → 1.32
// µs each (88 registers instead of 40: fewer warps where the grid is
// large); the 8-layer synthetic Qwen3-30B-A3B's decode graph, whose bf16
// products are the LM head and the routers, 0.677–0.685 → 0.646–0.656 ms
// a token.
template <bool BF> struct GroupHalfReg {
    uint4 q[4];
    GroupHalf<BF> slow;
    bool whole;
    __device__ __forceinline__ void load(const u8* row, u32 g, u32 valid_, float sc) {
        const uint4* p = (const uint4*)(row + (u64)g * 64);
        whole = valid_ == 32 && ((u64)p & 15) == 0;
        if (whole) {
#pragma unroll
            for (int i = 0; i < 4; ++i) q[i] = __ldg(p + i);
        } else {
            slow.load(row, g, valid_, sc);
        }
    }
    __device__ __forceinline__ void zero() {
        whole = true;
#pragma unroll
        for (int i = 0; i < 4; ++i) q[i] = make_uint4(0u, 0u, 0u, 0u);
    }
    __device__ __forceinline__ float4 get4(int sub) const {
        return whole ? half_group4<BF>(q, sub) : slow.get4(sub);
    }
};

// The group type a launch uses: GroupHalfReg for one token of f16/bf16 in a
// plain or q/k/v launch (REG), Group<FMT> otherwise. (The table launches
// keep GroupHalf: with their three table addresses live, GroupHalfReg made
// ptxas spill on sm_80–sm_89.)
template <int FMT, bool REG> struct GroupSel { typedef Group<FMT> T; };
template <> struct GroupSel<FMT_F16, true> { typedef GroupHalfReg<false> T; };
template <> struct GroupSel<FMT_BF16, true> { typedef GroupHalfReg<true> T; };
#define MV_HALF(FMT) ((FMT) == FMT_F16 || (FMT) == FMT_BF16)

// Reads the `nwords` aligned words that hold bytes [p, p + nbytes) and
// returns them realigned so that word i holds bytes p + 4i .. p + 4i + 3.
template <int NW>
__device__ __forceinline__ void load_realigned(const u8* p, u32 (&q)[NW], u32 nbytes) {
    const u32 s = (u32)((u64)p & 3);
    const u32* a = (const u32*)(p - s);
    if (s == 0) {
#pragma unroll
        for (int i = 0; i < NW; ++i) q[i] = __ldg(a + i);
    } else {
        // NW + 1 words cover [p, p + 4 NW) when p is not aligned; the last
        // one ends at most 3 bytes past p + nbytes rounded up to 4.
        u32 w[NW + 1];
#pragma unroll
        for (int i = 0; i < NW + 1; ++i) w[i] = __ldg(a + i);
#pragma unroll
        for (int i = 0; i < NW; ++i) q[i] = __funnelshift_r(w[i], w[i + 1], 8 * s);
    }
    (void)nbytes;
}

// FP8 e4m3 with a block scale: 32 bytes, one f32 scale (groups never cross
// a scale block: the host checks that the block is a multiple of 32).
// Element = fp8 · scale rounded to f32, as the reference dequantizes it.
template <> struct Group<FMT_F8E4M3> {
    u32 q[8];
    float s;
    __device__ __forceinline__ void load(const u8* row, u32 g, u32 valid, float scale) {
        const u8* p = row + (u64)g * 32;
        s = scale;
        if (valid == 32) {
            if (((u64)p & 15) == 0) {
                uint4 a = __ldg((const uint4*)p), b = __ldg((const uint4*)p + 1);
                q[0] = a.x; q[1] = a.y; q[2] = a.z; q[3] = a.w;
                q[4] = b.x; q[5] = b.y; q[6] = b.z; q[7] = b.w;
            } else {
                load_realigned<8>(p, q, 32);
            }
        } else {
            // Partial last group: byte loads, zeros past the row (an fp8
            // zero times anything adds nothing).
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                u32 v = 0;
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    const u32 e = 4 * i + k;
                    if (e < valid) v |= (u32)__ldg(p + e) << (8 * k);
                }
                q[i] = v;
            }
        }
    }
    __device__ __forceinline__ void zero() {
#pragma unroll
        for (int i = 0; i < 8; ++i) q[i] = 0;
        s = 0.0f;
    }
    __device__ __forceinline__ float4 get4(int sub) const {
        const u32 v = q[sub];
        return make_float4(__fmul_rn(fp8e4m3_to_f32(v & 0xffu), s),
                           __fmul_rn(fp8e4m3_to_f32((v >> 8) & 0xffu), s),
                           __fmul_rn(fp8e4m3_to_f32((v >> 16) & 0xffu), s),
                           __fmul_rn(fp8e4m3_to_f32(v >> 24), s));
    }
};

// Byte k of `v` as the f32 2^23 + byte (PRMT puts the byte under the
// exponent 0x4b), so subtracting a constant gives byte − c exactly with
// one add instead of an int-to-float conversion.
__device__ __forceinline__ float magic_byte(u32 v, int k) {
    return __uint_as_float(__byte_perm(v, 0x4b000000u, 0x7650u + k));
}

// ggml Q8_0: f16 d, 32 × i8 (34 bytes, 2-byte aligned). Element = d · q (exact).
template <> struct Group<FMT_Q8_0> {
    u32 q[8];
    float d;
    __device__ __forceinline__ void load(const u8* row, u32 g, u32, float) {
        const u8* p = row + (u64)g * 34;
        const u32 s = (u32)((u64)p & 2);
        const u32* a = (const u32*)(p - s);
        u32 w[9];
#pragma unroll
        for (int i = 0; i < 9; ++i) w[i] = __ldg(a + i);
        d = f16_bits_to_f32((w[0] >> (8 * s)) & 0xffffu);
#pragma unroll
        for (int i = 0; i < 8; ++i) q[i] = s == 0 ? __funnelshift_r(w[i], w[i + 1], 16) : w[i + 1];
    }
    __device__ __forceinline__ void zero() {
#pragma unroll
        for (int i = 0; i < 8; ++i) q[i] = 0x80808080u;
        d = 0.0f;
    }
    __device__ __forceinline__ float el(u32 v, int k) const {
        // v holds the bytes ^ 0x80; (byte ^ 0x80) − 128 is the signed byte.
        return __fmul_rn(d, magic_byte(v, k) - 8388736.0f);
    }
    __device__ __forceinline__ float4 get4(int sub) const {
        const u32 v = q[sub] ^ 0x80808080u;
        return make_float4(el(v, 0), el(v, 1), el(v, 2), el(v, 3));
    }
};

// ggml Q4_0: f16 d, 16 bytes of nibbles (18 bytes, 2-byte aligned); element
// j < 16 is the low nibble of byte j, element j + 16 its high nibble.
// Element = d · (q − 8) (exact).
template <> struct Group<FMT_Q4_0> {
    u32 q[4];
    float d;
    __device__ __forceinline__ void load(const u8* row, u32 g, u32, float) {
        const u8* p = row + (u64)g * 18;
        const u32 s = (u32)((u64)p & 2);
        const u32* a = (const u32*)(p - s);
        u32 w[5];
#pragma unroll
        for (int i = 0; i < 5; ++i) w[i] = __ldg(a + i);
        d = f16_bits_to_f32((w[0] >> (8 * s)) & 0xffffu);
#pragma unroll
        for (int i = 0; i < 4; ++i) q[i] = s == 0 ? __funnelshift_r(w[i], w[i + 1], 16) : w[i + 1];
    }
    __device__ __forceinline__ void zero() {
#pragma unroll
        for (int i = 0; i < 4; ++i) q[i] = 0x88888888u;
        d = 0.0f;
    }
    __device__ __forceinline__ float el(u32 v, int k) const {
        return __fmul_rn(d, magic_byte(v, k) - 8388616.0f);
    }
    __device__ __forceinline__ float4 get4(int sub) const {
        // sub 0..3: low nibbles of word sub; sub 4..7: high nibbles of word
        // sub - 4. One mask leaves the four nibbles as four bytes.
        const u32 v = (q[sub & 3] >> (sub < 4 ? 0 : 4)) & 0x0f0f0f0fu;
        return make_float4(el(v, 0), el(v, 1), el(v, 2), el(v, 3));
    }
};

// ggml Q6_K: super-blocks of 256 elements in 210 bytes (ql[128]: low 4
// bits, qh[64]: high 2 bits, 16 × i8 sub-block scales, f16 d; 2-byte
// aligned), read as groups of 32: group g is part j = g mod 8 of
// super-block g / 8, whose element l (< 32) is nibble j / 2 mod 2 of
// ql[64 n + 32 (j mod 2) + l] under bits 2k, 2k + 1 of qh[32 n + l] (n = j
// / 4, k = j mod 4), its first 16 elements scaled by sc[2j], the last 16
// by sc[2j + 1] (model/src/quant.rs `q6_k_code`). q holds the 32 codes
// (0..63, code − 32 is the value) as bytes. Element = d · sc · (code −
// 32), exact in f32 (11 + 7 + 5 significant bits).
template <> struct Group<FMT_Q6_K> {
    u32 q[8];
    float d;
    int sc[2];
    __device__ __forceinline__ void load(const u8* row, u32 g, u32, float) {
        const u8* b = row + (u64)(g / 8) * 210;
        const u32 j = g % 8, n = j / 4, k = j % 4;
        u32 lo[8], hi[8];
        load_realigned<8>(b + 64 * n + 32 * (k % 2), lo, 32);
        load_realigned<8>(b + 128 + 32 * n, hi, 32);
        const u32 sw = (u32)__ldg((const unsigned short*)(b + 192 + 2 * j));
        const u32 dw = (u32)__ldg((const unsigned short*)(b + 208));
        d = f16_bits_to_f32(dw);
        sc[0] = (int)(signed char)(sw & 0xffu);
        sc[1] = (int)(signed char)(sw >> 8);
        const u32 ns = 4 * (k / 2), hs = 2 * k;
#pragma unroll
        for (int i = 0; i < 8; ++i)
            q[i] = ((lo[i] >> ns) & 0x0f0f0f0fu) | (((hi[i] >> hs) & 0x03030303u) << 4);
    }
    __device__ __forceinline__ void zero() {
#pragma unroll
        for (int i = 0; i < 8; ++i) q[i] = 0x20202020u;
        d = 0.0f;
        sc[0] = sc[1] = 0;
    }
    __device__ __forceinline__ float4 get4(int sub) const {
        const float ds = __fmul_rn(d, (float)sc[sub / 4]);
        const u32 v = q[sub];
        return make_float4(__fmul_rn(ds, magic_byte(v, 0) - 8388640.0f),
                           __fmul_rn(ds, magic_byte(v, 1) - 8388640.0f),
                           __fmul_rn(ds, magic_byte(v, 2) - 8388640.0f),
                           __fmul_rn(ds, magic_byte(v, 3) - 8388640.0f));
    }
};

// ggml Q4_K and Q5_K: super-blocks of 256 elements (f16 d, f16 dmin, 12
// bytes of packed 6-bit sub-block scales and mins, then Q5_K's qh[32],
// then qs[128]; 144 or 176 bytes, 2-byte aligned), read as groups of 32:
// group g is sub-block j = g mod 8 of super-block g / 8, whose element l
// (< 32) is nibble j mod 2 of qs[32 (j / 2) + l] (Q5_K: under bit j of
// qh[l]), with scale sc and min m from ggml's get_scale_min_k4
// (model/src/quant.rs `k4_scale_min`, `q4_k_code`, `q5_k_code`). q holds
// the 32 codes (0..15 or 0..31) as bytes. Element = (d · sc) · code −
// dmin · m: both products and d · sc · code are exact in f32, so the one
// rounding is the subtraction's, as the CPU's dequantization rounds it.
template <u32 SB, bool FIVE> struct GroupK4 {
    u32 q[8];
    float d, dmin;
    int sc, m;
    __device__ __forceinline__ void load(const u8* row, u32 g, u32, float) {
        const u8* b = row + (u64)(g / 8) * SB;
        const u32 j = g % 8;
        // The header: word 0 holds d and dmin, words 1..3 the scale bytes
        // 0..3, 4..7 and 8..11.
        u32 h[4], lo[8];
        load_realigned<4>(b, h, 16);
        load_realigned<8>(b + (FIVE ? 48 : 16) + 32 * (j / 2), lo, 32);
        d = f16_bits_to_f32(h[0] & 0xffffu);
        dmin = f16_bits_to_f32(h[0] >> 16);
        const u32 sh = 8 * (j % 4);
        const u32 s0 = h[1] >> sh, s4 = h[2] >> sh, s8 = h[3] >> sh;  // bytes j%4, +4, +8
        sc = (int)(j < 4 ? (s0 & 63u) : ((s8 & 15u) | ((s0 >> 6 & 3u) << 4)));
        m = (int)(j < 4 ? (s4 & 63u) : ((s8 >> 4 & 15u) | ((s4 >> 6 & 3u) << 4)));
        const u32 ns = 4 * (j % 2);
        if (FIVE) {
            u32 hi[8];
            load_realigned<8>(b + 16, hi, 32);
#pragma unroll
            for (int i = 0; i < 8; ++i)
                q[i] = ((lo[i] >> ns) & 0x0f0f0f0fu) | (((hi[i] >> j) & 0x01010101u) << 4);
        } else {
#pragma unroll
            for (int i = 0; i < 8; ++i) q[i] = (lo[i] >> ns) & 0x0f0f0f0fu;
        }
    }
    __device__ __forceinline__ void zero() {
#pragma unroll
        for (int i = 0; i < 8; ++i) q[i] = 0;
        d = dmin = 0.0f;
        sc = m = 0;
    }
    __device__ __forceinline__ float4 get4(int sub) const {
        const float d1 = __fmul_rn(d, (float)sc), m1 = __fmul_rn(dmin, (float)m);
        const u32 v = q[sub];
        return make_float4(fmaf(d1, magic_byte(v, 0) - 8388608.0f, -m1),
                           fmaf(d1, magic_byte(v, 1) - 8388608.0f, -m1),
                           fmaf(d1, magic_byte(v, 2) - 8388608.0f, -m1),
                           fmaf(d1, magic_byte(v, 3) - 8388608.0f, -m1));
    }
};
template <> struct Group<FMT_Q4_K> : GroupK4<144, false> {};
template <> struct Group<FMT_Q5_K> : GroupK4<176, true> {};

// The fifth bits of four consecutive elements (bits 0..3 of `b`) as bit
// 4 of four bytes.
__device__ __forceinline__ u32 fifth_bits(u32 b) {
    return ((b & 1u) | (b & 2u) << 7 | (b & 4u) << 14 | (b & 8u) << 21) << 4;
}

// ggml Q4_1, Q5_0 and Q5_1: blocks of 32 elements, one per group (model/src/
// quant.rs `dequantize_q4_1`, `_q5_0`, `_q5_1`): f16 d, then Q4_1/Q5_1's
// f16 min m, then Q5_0/Q5_1's 32 fifth bits qh (u32, element e's is bit
// e), then 16 bytes of nibbles (element j < 16 the low nibble of byte j,
// j + 16 its high nibble); 20, 22 or 24 bytes, 2-byte aligned. q holds the
// 32 codes as bytes. Element = d · (code − 16) for Q5_0 (exact), d · code
// + m for the others: d · code is exact in f32 (4 or 5 bits times f16's
// 11), so the one rounding is the addition's, as the CPU's two roundings
// give.
template <u32 SB, bool MIN, bool FIVE> struct GroupLegacy {
    u32 q[8];
    float d, m;
    __device__ __forceinline__ void load(const u8* row, u32 g, u32, float) {
        const u8* b = row + (u64)g * SB;
        d = f16_bits_to_f32((u32)__ldg((const unsigned short*)b));
        m = MIN ? f16_bits_to_f32((u32)__ldg((const unsigned short*)(b + 2))) : 0.0f;
        constexpr u32 QH = MIN ? 4 : 2, QS = QH + (FIVE ? 4 : 0);
        u32 lo[4];
        load_realigned<4>(b + QS, lo, 16);
        u32 qh = 0;
        if (FIVE) {
            u32 h[1];
            load_realigned<1>(b + QH, h, 4);
            qh = h[0];
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            q[i] = (lo[i] & 0x0f0f0f0fu) | fifth_bits(qh >> (4 * i));
            q[i + 4] = ((lo[i] >> 4) & 0x0f0f0f0fu) | fifth_bits(qh >> (16 + 4 * i));
        }
    }
    __device__ __forceinline__ void zero() {
#pragma unroll
        for (int i = 0; i < 8; ++i) q[i] = 0;
        d = m = 0.0f;
    }
    __device__ __forceinline__ float el(u32 v, int k) const {
        if (MIN) return fmaf(d, magic_byte(v, k) - 8388608.0f, m);
        return __fmul_rn(d, magic_byte(v, k) - 8388624.0f);
    }
    __device__ __forceinline__ float4 get4(int sub) const {
        const u32 v = q[sub];
        return make_float4(el(v, 0), el(v, 1), el(v, 2), el(v, 3));
    }
};
template <> struct Group<FMT_Q4_1> : GroupLegacy<20, true, false> {};
template <> struct Group<FMT_Q5_0> : GroupLegacy<22, false, true> {};
template <> struct Group<FMT_Q5_1> : GroupLegacy<24, true, true> {};

// ggml Q2_K: super-blocks of 256 elements (scales[16]: a 4-bit scale and
// min per 16 elements; qs[64]: 2-bit codes; f16 d, f16 dmin; 84 bytes,
// 2-byte aligned), read as groups of 32: group g is part j = g mod 8 of
// super-block g / 8, whose element l (< 32) is bits 2k, 2k + 1 (k = j mod
// 4) of qs[32 (j / 4) + l], its first 16 elements under scale byte 2j, the
// last 16 under 2j + 1. Element = dl · code − ml with dl = d · (sc & 15)
// and ml = dmin · (sc >> 4) rounded to f32, as ggml forms them; dl · code
// is exact, so the one rounding is the subtraction's.
template <> struct Group<FMT_Q2_K> {
    u32 q[8];
    float dl[2], ml[2];
    // For the 8-bit-activation path: d, dmin and the two scale bytes
    // (scale in the low nibble, min in the high one).
    float d, dmin;
    u32 sc;
    __device__ __forceinline__ void load(const u8* row, u32 g, u32, float) {
        const u8* b = row + (u64)(g / 8) * 84;
        const u32 j = g % 8;
        u32 w[8];
        load_realigned<8>(b + 16 + 32 * (j / 4), w, 32);
        const u32 sh = 2 * (j % 4);
#pragma unroll
        for (int i = 0; i < 8; ++i) q[i] = (w[i] >> sh) & 0x03030303u;
        sc = (u32)__ldg((const unsigned short*)(b + 2 * j));
        d = f16_bits_to_f32((u32)__ldg((const unsigned short*)(b + 80)));
        dmin = f16_bits_to_f32((u32)__ldg((const unsigned short*)(b + 82)));
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const u32 s = (sc >> (8 * h)) & 0xffu;
            dl[h] = __fmul_rn(d, (float)(s & 15u));
            ml[h] = __fmul_rn(dmin, (float)(s >> 4));
        }
    }
    __device__ __forceinline__ void zero() {
#pragma unroll
        for (int i = 0; i < 8; ++i) q[i] = 0;
        dl[0] = dl[1] = ml[0] = ml[1] = 0.0f;
        d = dmin = 0.0f;
        sc = 0;
    }
    __device__ __forceinline__ float4 get4(int sub) const {
        const float a = dl[sub / 4], m = ml[sub / 4];
        const u32 v = q[sub];
        return make_float4(fmaf(a, magic_byte(v, 0) - 8388608.0f, -m),
                           fmaf(a, magic_byte(v, 1) - 8388608.0f, -m),
                           fmaf(a, magic_byte(v, 2) - 8388608.0f, -m),
                           fmaf(a, magic_byte(v, 3) - 8388608.0f, -m));
    }
};

// ggml Q3_K: super-blocks of 256 elements (hmask[32], qs[64]: 2-bit codes,
// 12 bytes of 16 packed 6-bit scales, f16 d; 110 bytes, 2-byte aligned),
// read as groups of 32: group g is part j = g mod 8 of super-block g / 8,
// whose element l (< 32) has the low bits 2k, 2k + 1 (k = j mod 4) of
// qs[32 (j / 4) + l] and, as bit 2, bit j of hmask[l]; value = code − 4.
// Scale i (= 2j for the first 16 elements, 2j + 1 for the last) is the
// low (i < 8) or high nibble of byte i mod 8 under bits 2 (i / 4), +1 of
// byte 8 + i mod 4, minus 32. Element = (d · sc) · (code − 4), exact in
// f32 (11 + 6 + 3 significant bits).
template <> struct Group<FMT_Q3_K> {
    u32 q[8];
    float ds[2];
    float d;  // for the 8-bit-activation path: d and the two scales
    int sc[2];
    __device__ __forceinline__ void load(const u8* row, u32 g, u32, float) {
        const u8* b = row + (u64)(g / 8) * 110;
        const u32 j = g % 8;
        u32 lo[8], hm[8];
        load_realigned<8>(b + 32 + 32 * (j / 4), lo, 32);
        load_realigned<8>(b, hm, 32);
        const u32 sh = 2 * (j % 4);
#pragma unroll
        for (int i = 0; i < 8; ++i)
            q[i] = ((lo[i] >> sh) & 0x03030303u) | (((hm[i] >> j) & 0x01010101u) << 2);
        d = f16_bits_to_f32((u32)__ldg((const unsigned short*)(b + 108)));
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const u32 i = 2 * j + h;
            const u32 low = (u32)__ldg(b + 96 + i % 8) >> (4 * (i / 8)) & 15u;
            const u32 high = (u32)__ldg(b + 104 + i % 4) >> (2 * (i / 4)) & 3u;
            sc[h] = (int)(low | high << 4) - 32;
            ds[h] = __fmul_rn(d, (float)sc[h]);
        }
    }
    __device__ __forceinline__ void zero() {
#pragma unroll
        for (int i = 0; i < 8; ++i) q[i] = 0x04040404u;
        ds[0] = ds[1] = d = 0.0f;
        sc[0] = sc[1] = 0;
    }
    __device__ __forceinline__ float4 get4(int sub) const {
        const float a = ds[sub / 4];
        const u32 v = q[sub];
        return make_float4(__fmul_rn(a, magic_byte(v, 0) - 8388612.0f),
                           __fmul_rn(a, magic_byte(v, 1) - 8388612.0f),
                           __fmul_rn(a, magic_byte(v, 2) - 8388612.0f),
                           __fmul_rn(a, magic_byte(v, 3) - 8388612.0f));
    }
};

// ggml IQ4_NL (f16 d, 16 bytes of nibbles: 18 bytes, 2-byte aligned; Q4_0's
// nibble order) and IQ4_XS (super-blocks of 256: f16 d, u16 scales_h,
// scales_l[4], qs[128]; 136 bytes; group g is block ib = g mod 8 of
// super-block g / 8, its nibbles qs[16 ib ..], its 6-bit scale the nibble
// ib mod 2 of scales_l[ib / 2] under bits 2 ib, +1 of scales_h, minus 32).
// q holds the table values as signed bytes (^ 0x80, as Q8_0's). Element =
// dl · value with dl = d (IQ4_NL) or d · scale (IQ4_XS, exact); exact in
// f32 (11 + 6 + 7 significant bits).
template <bool XS> struct GroupIq4 {
    u32 q[8];
    float dl;
    float d;  // for the 8-bit-activation path: d and IQ4_XS's scale
    int ls;
    __device__ __forceinline__ void load(const u8* row, u32 g, u32, float) {
        const u8* b = XS ? row + (u64)(g / 8) * 136 : row + (u64)g * 18;
        d = f16_bits_to_f32((u32)__ldg((const unsigned short*)b));
        u32 w[4];
        if (XS) {
            const u32 ib = g % 8;
            load_realigned<4>(b + 8 + 16 * ib, w, 16);
            const u32 sh = (u32)__ldg((const unsigned short*)(b + 2));
            const u32 low = (u32)__ldg(b + 4 + ib / 2) >> (4 * (ib % 2)) & 15u;
            ls = (int)(low | (sh >> (2 * ib) & 3u) << 4) - 32;
            dl = __fmul_rn(d, (float)ls);
        } else {
            load_realigned<4>(b + 2, w, 16);
            dl = d;
            ls = 1;
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            q[i] = iq4_values(w[i] & 0x0f0f0f0fu) ^ 0x80808080u;
            q[i + 4] = iq4_values((w[i] >> 4) & 0x0f0f0f0fu) ^ 0x80808080u;
        }
    }
    __device__ __forceinline__ void zero() {
#pragma unroll
        for (int i = 0; i < 8; ++i) q[i] = 0x80808080u;
        dl = d = 0.0f;
        ls = 0;
    }
    __device__ __forceinline__ float4 get4(int sub) const {
        const u32 v = q[sub];
        return make_float4(__fmul_rn(dl, magic_byte(v, 0) - 8388736.0f),
                           __fmul_rn(dl, magic_byte(v, 1) - 8388736.0f),
                           __fmul_rn(dl, magic_byte(v, 2) - 8388736.0f),
                           __fmul_rn(dl, magic_byte(v, 3) - 8388736.0f));
    }
};
template <> struct Group<FMT_IQ4_NL> : GroupIq4<false> {};
template <> struct Group<FMT_IQ4_XS> : GroupIq4<true> {};

template <int FMT>
__device__ __forceinline__ u64 row_bytes(u32 cols) {
    switch (FMT) {
        case FMT_F32: return (u64)cols * 4;
        case FMT_F16:
        case FMT_BF16: return (u64)cols * 2;
        case FMT_F8E4M3: return (u64)cols;
        case FMT_Q8_0: return (u64)(cols / 32) * 34;
        case FMT_Q6_K: return (u64)(cols / 256) * 210;
        case FMT_Q4_K: return (u64)(cols / 256) * 144;
        case FMT_Q5_K: return (u64)(cols / 256) * 176;
        case FMT_Q4_1: return (u64)(cols / 32) * 20;
        case FMT_Q5_0: return (u64)(cols / 32) * 22;
        case FMT_Q5_1: return (u64)(cols / 32) * 24;
        case FMT_Q2_K: return (u64)(cols / 256) * 84;
        case FMT_Q3_K: return (u64)(cols / 256) * 110;
        case FMT_IQ4_XS: return (u64)(cols / 256) * 136;
        default: return (u64)(cols / 32) * 18;
    }
}

// Loads the groups of the tile at column c0 that this lane owns, for each
// of the M matrices (row bytes `rb`, FP8 scales at `s[m]`) and each of the
// warp's R rows from row0; rows past `rows` get zero groups.
//
// STRAIGHT (the 8-bit-activation core): without a branch. Every group is
// loaded from an index clamped into the matrix, then replaced by zeros
// where its row lies past the rows (a group past the row's end is a copy
// of its last group, never used: a round past the row is skipped, a lane's
// group past it predicated off). A quantized group's `load` decodes its
// words where it loads them (a funnel shift, the scale's widening), so
// inside a branch per group those uses sat between one group's loads and
// the next group's: each lane waited for one group to arrive before asking
// for the next (`cuobjdump --dump-sass`), eight round trips to memory one
// after another in a Q4_0 GLU launch. In one straight block ptxas issues
// every load first. (The float core keeps the branches: its f16/bf16/f32
// groups load lazily, and straight loads made ptxas spill in its FP8,
// Q8_0 and IQ4_NL launches.)
template <int FMT, int M, int J, int R, bool STRAIGHT = false, typename G>
__device__ __forceinline__ void mv_load_tile(G (&grp)[M][J][R], const u8* const (&w)[2],
                                             const float* const (&s)[2], u32 s_block, u32 s_cols,
                                             u64 rb, u32 row0, u32 rows, u32 cols, u32 c0) {
    const u32 lane = threadIdx.x & 31;
    const u32 ngroups = (cols + 31) / 32;
    if constexpr (STRAIGHT) {
#pragma unroll
        for (int jj = 0; jj < J; ++jj) {
            const u32 g = min(c0 / 32 + jj * 32 + lane, ngroups - 1);
            const u32 valid = min(32u, cols - g * 32);
#pragma unroll
            for (int m = 0; m < M; ++m)
#pragma unroll
                for (int r = 0; r < R; ++r)
                    grp[m][jj][r].load(w[m] + (u64)min(row0 + r, rows - 1) * rb, g, valid, 0.0f);
        }
#pragma unroll
        for (int jj = 0; jj < J; ++jj)
#pragma unroll
            for (int m = 0; m < M; ++m)
#pragma unroll
                for (int r = 0; r < R; ++r)
                    if (row0 + r >= rows) grp[m][jj][r].zero();
    } else {
#pragma unroll
        for (int jj = 0; jj < J; ++jj) {
            const u32 g = c0 / 32 + jj * 32 + lane;
            if (g < ngroups) {
                const u32 valid = min(32u, cols - g * 32);
#pragma unroll
                for (int m = 0; m < M; ++m) {
#pragma unroll
                    for (int r = 0; r < R; ++r) {
                        const u32 row = row0 + r;
                        if (row < rows) {
                            float scale = 0.0f;
                            if (FMT == FMT_F8E4M3) scale = s[m][(u64)(row / s_block) * s_cols + (g * 32) / s_block];
                            grp[m][jj][r].load(w[m] + (u64)row * rb, g, valid, scale);
                        } else {
                            grp[m][jj][r].zero();
                        }
                    }
                }
            }
        }
    }
}

// One block's share of one matrix (or of a GLU pair): rows bx·8R.. of the
// matrix at `w[0]` (FP8 scales at `s[0]`) for the `nt` ≤ NT tokens at `xm`,
// written to `ym`. Every launch shape below resolves its matrix and tokens
// and then runs exactly this, so they share every bit of arithmetic.
//
// R, the rows each warp owns, only decides which rows a warp computes, never
// how: a row's sum is formed by its lanes over its groups whatever R is.
//
// GLU: w[1] is a second matrix of the same shape (a gated MLP's up
// projection beside its gate); each row's two sums are formed exactly as
// two separate launches form them, and y = silu(gate) · up is written with
// the `swiglu` kernel's operations, so the fused launch gives its bits.
//
// xrows: token t is row xrows[t] of xm (x_tstride floats apart) instead of
// row t, when given (the table launch reading its tokens where they are).
//
// EARLY: the matrices are device constants (a plain launch's weights), so
// the first tile's groups are loaded before `pdl_entry()`, overlapping the
// previous kernel's tail; the caller of a launch that finds its matrices in
// memory written by an earlier launch (the expert tables) calls
// `pdl_entry()` itself first and passes EARLY = false.
template <int FMT, int NT, int R, bool EARLY, bool GLU>
__device__ __forceinline__ void matvec_core_f(u32 bx, const u8* __restrict__ w0,
                                              const float* __restrict__ s0,
                                              const u8* __restrict__ w1,
                                              const float* __restrict__ s1, u32 s_block,
                                              u32 s_cols, const float* __restrict__ xm,
                                              u32 x_tstride, const u32* __restrict__ xrows,
                                              float* __restrict__ ym, u32 y_tstride, u32 rows,
                                              u32 cols, u32 nt) {
    constexpr int M = GLU ? 2 : 1;
    // f16/bf16 groups in registers (GroupSel): a plain launch of one token.
    constexpr bool REG = NT == 1 && EARLY && MV_HALF(FMT);
    constexpr u32 TILE = REG ? 2048 : MV_TILE_FOR(FMT, NT);
    constexpr int J = TILE / 1024;
    constexpr u32 XS = TILE + TILE / 8;
    __shared__ __align__(16) float xs[NT][XS];
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 row0 = bx * (MV_WARPS * R) + warp * R;
    const u64 rb = row_bytes<FMT>(cols);
    const u32 ngroups = (cols + 31) / 32;
    // One token's row is staged a float4 at a time when it starts 16-byte
    // aligned and the columns come in fours (then a float4 at col < cols
    // lies inside the row); the same values either way. (Several tokens
    // keep the scalar staging, as does f32: the wider one made ptxas spill
    // there.)
    const bool x_vec = NT == 1 && FMT != FMT_F32 && ((u64)xm & 15) == 0 && (x_tstride & 3) == 0 && (cols & 3) == 0;
    const u8* const w[2] = {w0, w1};  // only the first M are used
    const float* const s[2] = {s0, s1};

    float acc[M][R][NT];
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int t = 0; t < NT; ++t) acc[m][r][t] = 0.0f;

    // Every group of a tile that this lane owns is loaded first, then used
    // in increasing order.
    typename GroupSel<FMT, REG>::T grp[M][J][R];
    if (EARLY) {
        mv_load_tile<FMT, M, J, R>(grp, w, s, s_block, s_cols, rb, row0, rows, cols, 0);
        pdl_entry();
    }

    // One token of Q8_0/Q4_0 (groups loaded whole into registers): each
    // tile's weights are requested before x is staged, so their latency
    // overlaps the staging (what EARLY does for a plain launch's first
    // tile). f16/bf16 groups load as they are used; FP8's GLU launch
    // spilled (ptxas) with its groups live across the staging.
    constexpr bool LOAD_FIRST = NT == 1 && (FMT == FMT_Q8_0 || FMT == FMT_Q4_0 || FMT == FMT_Q6_K ||
                                            FMT == FMT_Q4_K || FMT == FMT_Q5_K || REG);
    for (u32 c0 = 0; c0 < cols; c0 += TILE) {
        __syncthreads();
        if (LOAD_FIRST && (!EARLY || c0 != 0))
            mv_load_tile<FMT, M, J, R>(grp, w, s, s_block, s_cols, rb, row0, rows, cols, c0);
        if (NT == 1 && FMT != FMT_F32 && x_vec) {
            // Four columns per thread and step (a float4 never straddles a
            // padded group of 32).
            for (u32 i = threadIdx.x; i < NT * TILE / 4; i += MV_THREADS) {
                const u32 t = i / (TILE / 4), j = 4 * (i % (TILE / 4)), col = c0 + j;
                const u64 xr = xrows != nullptr && t < nt ? xrows[t] : t;
                const float4 v = (t < nt && col < cols) ? *(const float4*)(xm + xr * x_tstride + col)
                                                        : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                *(float4*)&xs[t][j + (j >> 5) * 4] = v;
            }
        } else {
            for (u32 i = threadIdx.x; i < NT * TILE; i += MV_THREADS) {
                const u32 t = i / TILE, j = i % TILE, col = c0 + j;
                const u64 xr = xrows != nullptr && t < nt ? xrows[t] : t;
                xs[t][j + (j >> 5) * 4] = (t < nt && col < cols) ? xm[xr * x_tstride + col] : 0.0f;
            }
        }
        __syncthreads();
        if (!LOAD_FIRST && (!EARLY || c0 != 0))
            mv_load_tile<FMT, M, J, R>(grp, w, s, s_block, s_cols, rb, row0, rows, cols, c0);
#pragma unroll
        for (int jj = 0; jj < J; ++jj) {
            const u32 g = c0 / 32 + jj * 32 + lane;
            if (g < ngroups) {
                const float* xl = &xs[0][(jj * 32 + lane) * 36];
#pragma unroll
                for (int sub = 0; sub < 8; ++sub) {
                    float4 xv[NT];
#pragma unroll
                    for (int t = 0; t < NT; ++t) xv[t] = *(const float4*)(xl + t * XS + sub * 4);
#pragma unroll
                    for (int m = 0; m < M; ++m) {
#pragma unroll
                        for (int r = 0; r < R; ++r) {
                            const float4 wv = grp[m][jj][r].get4(sub);
#pragma unroll
                            for (int t = 0; t < NT; ++t) {
                                float a = acc[m][r][t];
                                a = fmaf(wv.x, xv[t].x, a);
                                a = fmaf(wv.y, xv[t].y, a);
                                a = fmaf(wv.z, xv[t].z, a);
                                a = fmaf(wv.w, xv[t].w, a);
                                acc[m][r][t] = a;
                            }
                        }
                    }
                }
            }
        }
    }

#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            float v = warp_sum(acc[0][r][t]);
            if (GLU) v = __fmul_rn(silu_f32(v), warp_sum(acc[M - 1][r][t]));
            const u32 row = row0 + r;
            if (lane == (u32)((r * NT + t) & 31) && row < rows && (u32)t < nt)
                ym[(u64)t * y_tstride + row] = v;
        }
    }
}

// ---------------------------------------------------------------------------
// Q4_0 and Q8_0 with 8-bit activations (FMT_Q4_0_Q8, FMT_Q8_0_Q8): the CPU
// tier's default arithmetic (model/src/kernels/q4_0.rs `dot_q4_0_q8`,
// q8act.rs `dot_q8_0_q8`), bit for bit.
//
//   * Each token's input is quantized per block of 32 as
//     `Q8Activation::quantize` does: d = amax / 127, q = round(x · (1/d))
//     (half away from zero, clamped to ±127; 1/d = 0 for an all-zero block).
//   * Block b of a row gives the scale d_b = f16(w.d_b) · x.d_b (one f32
//     rounding) and K exact integer sums s_{b,k} (DP4A): Q4_0 one,
//     Σ (code − 8) · q; Q8_0 eight, Σ w · q over elements 4k .. 4k + 3 (the
//     AVX2 kernel's eight i32 lanes).
//   * d_b · s_{b,k} is added by one fused multiply-add into accumulator
//     (b mod A, k), blocks in increasing order: Q4_0 has A = 4, and its
//     result is (a0 + a2) + (a1 + a3); Q8_0 has A = 2, and its result is
//     hsum8 of the eight lanes acc[0][k] + acc[1][k].
//   * Q4_K and Q5_K (FMT_Q4_K_Q8, FMT_Q5_K_Q8; q4_k.rs) have a min as well
//     as a scale per block: their Q8Dot forms block b's finished f32 term
//     t_b itself (Q8DotK4), and the chain adds it with one rounded
//     addition, as the CPU's acc[b mod 4] += t_b does (A = 4, K = 1).
//
// The lanes form (d_b, s_{b,k}) (or t_b) for their groups in parallel as the float
// path does; the C = A·K accumulator chains of a token then run in lanes
// C·j + K·a + k (j: the token within a pass of 32 / C tokens) over the
// round's 32 groups, read back through shared memory; a butterfly over
// the C lanes gives the CPU's final sums (chain_sum). So the bits depend on
// `cols` alone, as the float path's do: not on the batch, the placement or
// the launch shape.

// Σ of the four signed byte products of a and b, plus c (exact).
__device__ __forceinline__ int dp4a_s8(u32 a, u32 b, int c) {
    int d;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// A tile of TILE columns of NT tokens, quantized: per block of 32, its
// first 16 quants as 4 words in `lo`, its last 16 in `hi` (the bytes Q4_0's
// low and high nibbles multiply), its scale and 8 · Σ q.
template <int NT, u32 TILE>
struct Q8Tile {
    u32 lo[NT][TILE / 8];
    u32 hi[NT][TILE / 8];
    float d[NT][TILE / 32];
    int z[NT][TILE / 32];
};

// Four signed bytes in a word, byte i from the low byte of q[i].
__device__ __forceinline__ u32 pack_s8(int q0, int q1, int q2, int q3) {
    return __byte_perm(__byte_perm((u32)q0, (u32)q1, 0x0040), __byte_perm((u32)q2, (u32)q3, 0x0040), 0x5410);
}

// Quantizes columns [c0, c0 + TILE) of the nt tokens into `s` (zeros past
// the row or the tokens). Eight columns per thread and step; the 4
// threads of a block are 4 consecutive lanes of one warp, which combine
// their maxima and sums by butterflies (exact: max and integer addition).
template <int NT, u32 TILE, bool SKIP_DEAD>
__device__ __forceinline__ void q8_stage(Q8Tile<NT, TILE>& s, const float* __restrict__ xm,
                                         u32 x_tstride, const u32* __restrict__ xrows, u32 nt,
                                         u32 c0, u32 cols) {
    // Whole warps take a step or skip it (the butterflies need all 32
    // lanes): every thread takes every step, or (a one-token tile of 1024)
    // the first warps do.
    static_assert((NT * TILE / 8) % 32 == 0, "whole warps per step");
    for (u32 i = threadIdx.x; i < NT * TILE / 8; i += MV_THREADS) {
        const u32 t = i / (TILE / 8), j = 8 * (i % (TILE / 8)), col = c0 + j;
        const u32 blk = j / 32, k = (j % 32) / 8;  // k: which 8 of the block
        // SKIP_DEAD (the table launches): a warp whose columns all lie past
        // the row or the tokens stores the zeros the steps below would
        // compute (d = 0, every quant 0) without computing them, as in a
        // down projection's 768-column tile. No faster in the decode, but
        // without it ptxas spilled in the Q4_0 GLU launch on sm_80 (and
        // with it in the plain launches).
        if (SKIP_DEAD && __all_sync(FULL_MASK, t >= nt || col >= cols)) {
            if (k < 2) {
                *(uint2*)&s.lo[t][blk * 4 + 2 * k] = make_uint2(0u, 0u);
            } else {
                *(uint2*)&s.hi[t][blk * 4 + 2 * (k - 2)] = make_uint2(0u, 0u);
            }
            if (k == 0) {
                s.d[t][blk] = 0.0f;
                s.z[t][blk] = 0;
            }
            continue;
        }
        float4 a = make_float4(0.0f, 0.0f, 0.0f, 0.0f), b = a;
        if (t < nt && col < cols) {
            const u64 xr = xrows != nullptr ? xrows[t] : t;
            const float* p = xm + xr * x_tstride + col;  // cols % 32 == 0: p[7] is in the row
            if (((u64)p & 15) == 0) {
                a = *(const float4*)p;
                b = *(const float4*)(p + 4);
            } else {
                a = make_float4(p[0], p[1], p[2], p[3]);
                b = make_float4(p[4], p[5], p[6], p[7]);
            }
        }
        float amax = fmaxf(fmaxf(fmaxf(fabsf(a.x), fabsf(a.y)), fmaxf(fabsf(a.z), fabsf(a.w))),
                           fmaxf(fmaxf(fabsf(b.x), fabsf(b.y)), fmaxf(fabsf(b.z), fabsf(b.w))));
        amax = fmaxf(0.0f, amax);  // NaNs are skipped, as f32::max skips them
        amax = fmaxf(amax, __shfl_xor_sync(FULL_MASK, amax, 1));
        amax = fmaxf(amax, __shfl_xor_sync(FULL_MASK, amax, 2));
        const float d = div127(amax);
        const float id = d > 0.0f ? __frcp_rn(d) : 0.0f;
        const int q0 = q8_of(a.x, id), q1 = q8_of(a.y, id), q2 = q8_of(a.z, id), q3 = q8_of(a.w, id);
        const int q4 = q8_of(b.x, id), q5 = q8_of(b.y, id), q6 = q8_of(b.z, id), q7 = q8_of(b.w, id);
        int sum = ((q0 + q1) + (q2 + q3)) + ((q4 + q5) + (q6 + q7));
        sum += __shfl_xor_sync(FULL_MASK, sum, 1);
        sum += __shfl_xor_sync(FULL_MASK, sum, 2);
        const uint2 words = make_uint2(pack_s8(q0, q1, q2, q3), pack_s8(q4, q5, q6, q7));
        if (k < 2) {
            *(uint2*)&s.lo[t][blk * 4 + 2 * k] = words;
        } else {
            *(uint2*)&s.hi[t][blk * 4 + 2 * (k - 2)] = words;
        }
        if (k == 0) {
            s.d[t][blk] = d;
            s.z[t][blk] = 8 * sum;
        }
    }
}

// One token's columns [c0, c0 + TILE) into `s` from its Q8 row (common.cuh:
// quantized once by the kernel that produced x, the bits q8_stage would
// give), zeros past the row. One step: a block's lo and hi words are one
// 16-byte load each, its scale and sum one word each.
template <u32 TILE>
__device__ __forceinline__ void q8_copy(Q8Tile<1, TILE>& s, const u8* __restrict__ row, u32 c0,
                                        u32 cols) {
    constexpr u32 NB = TILE / 32;  // blocks per tile
    static_assert(3 * NB <= MV_THREADS, "one step");
    const u32 i = threadIdx.x;
    if (i < 3 * NB) {
        const u32 part = i / NB, blk = i % NB, b = c0 / 32 + blk;
        const bool in = b < cols / 32;
        if (part < 2) {
            const uint4 v = in ? *(const uint4*)(row + part * (cols / 2) + 16 * b) : make_uint4(0u, 0u, 0u, 0u);
            *(uint4*)(part == 0 ? &s.lo[0][4 * blk] : &s.hi[0][4 * blk]) = v;
        } else {
            s.d[0][blk] = in ? ((const float*)(row + cols))[b] : 0.0f;
            s.z[0][blk] = in ? ((const int*)(row + cols + cols / 8))[b] : 0;
        }
    }
}

// How the integer path meets one storage format: constructed from a
// lane's weight group (once per round, shared by the tokens), `sums`
// gives block b's K integer sums with token t's quants, which the core
// scales by d_b = G.d · x.d_b. A format whose block value is more than one
// scale times integers (TERM: Q4_K and Q5_K, whose min adds a second
// term) gives the finished f32 value of block b instead (`term`, K = 1),
// which the core adds into its chain as the CPU does.
template <int FMT> struct Q8Dot;

// Q4_0: one sum per block, accumulators by b mod 4 (`dot_q4_0_q8`).
template <> struct Q8Dot<FMT_Q4_0_Q8> {
    static constexpr int WFMT = FMT_Q4_0, A = 4, K = 1;
    static constexpr bool TERM = false;
    u32 lo[4], hi[4];  // the low and high nibbles, one per byte
    __device__ __forceinline__ explicit Q8Dot(const Group<FMT_Q4_0>& g) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            lo[i] = g.q[i] & 0x0f0f0f0fu;
            hi[i] = (g.q[i] >> 4) & 0x0f0f0f0fu;
        }
    }
    // Σ (code − 8) · q: DP4A on the codes, minus 8 · Σ q.
    template <int NT, u32 TILE>
    __device__ __forceinline__ void sums(const Q8Tile<NT, TILE>& xs, u32 t, u32 b,
                                         int (&s)[K]) const {
        const uint4 xl = *(const uint4*)&xs.lo[t][b * 4];
        const uint4 xh = *(const uint4*)&xs.hi[t][b * 4];
        int v = dp4a_s8(lo[0], xl.x, 0);
        v = dp4a_s8(lo[1], xl.y, v);
        v = dp4a_s8(lo[2], xl.z, v);
        v = dp4a_s8(lo[3], xl.w, v);
        v = dp4a_s8(hi[0], xh.x, v);
        v = dp4a_s8(hi[1], xh.y, v);
        v = dp4a_s8(hi[2], xh.z, v);
        v = dp4a_s8(hi[3], xh.w, v);
        s[0] = v - xs.z[t][b];
    }
};

// Q8_0: eight sums of four elements per block, accumulators by b mod 2
// (`dot_q8_0_q8`). Word i of the weights holds elements 4i .. 4i + 3, as
// does word i of the tile's `lo` (i < 4) or `hi` (i ≥ 4).
template <> struct Q8Dot<FMT_Q8_0_Q8> {
    static constexpr int WFMT = FMT_Q8_0, A = 2, K = 8;
    static constexpr bool TERM = false;
    u32 q[8];
    __device__ __forceinline__ explicit Q8Dot(const Group<FMT_Q8_0>& g) {
#pragma unroll
        for (int i = 0; i < 8; ++i) q[i] = g.q[i];
    }
    template <int NT, u32 TILE>
    __device__ __forceinline__ void sums(const Q8Tile<NT, TILE>& xs, u32 t, u32 b,
                                         int (&s)[K]) const {
        const uint4 xl = *(const uint4*)&xs.lo[t][b * 4];
        const uint4 xh = *(const uint4*)&xs.hi[t][b * 4];
        s[0] = dp4a_s8(q[0], xl.x, 0);
        s[1] = dp4a_s8(q[1], xl.y, 0);
        s[2] = dp4a_s8(q[2], xl.z, 0);
        s[3] = dp4a_s8(q[3], xl.w, 0);
        s[4] = dp4a_s8(q[4], xh.x, 0);
        s[5] = dp4a_s8(q[5], xh.y, 0);
        s[6] = dp4a_s8(q[6], xh.z, 0);
        s[7] = dp4a_s8(q[7], xh.w, 0);
    }
};

// Q4_K and Q5_K (`dot_q4_k_q8`, `dot_q5_k_q8` of model/src/kernels/q4_k.rs):
// block b (sub-block b mod 8 of super-block b / 8) gives the exact
// integers A_b = sc · Σ code · q (DP4A: the codes are below 32, so the same
// as signed bytes) and B_b = m · Σ q (the tile's z is 8 · Σ q, exact), and
// t_b = fmaf(d · x.d_b, A_b, −((dmin · x.d_b) · B_b)) (both integers are
// below 2^24: exact in f32), added into accumulator b mod 4; the result is
// (a0 + a2) + (a1 + a3), as Q4_0's.
template <int WF> struct Q8DotK4 {
    static constexpr int WFMT = WF, A = 4, K = 1;
    static constexpr bool TERM = true;
    u32 q[8];
    float d, dmin;
    // sc | m << 16: one register fewer than two (q4_kq8_table_t2 spilled
    // 8 bytes on sm_90 with sc and m apart).
    u32 scm;
    __device__ __forceinline__ explicit Q8DotK4(const Group<WF>& g) {
#pragma unroll
        for (int i = 0; i < 8; ++i) q[i] = g.q[i];
        d = g.d;
        dmin = g.dmin;
        scm = (u32)g.sc | (u32)g.m << 16;
    }
    template <int NT, u32 TILE>
    __device__ __forceinline__ float term(const Q8Tile<NT, TILE>& xs, u32 t, u32 b) const {
        const uint4 xl = *(const uint4*)&xs.lo[t][b * 4];
        const uint4 xh = *(const uint4*)&xs.hi[t][b * 4];
        int u = dp4a_s8(q[0], xl.x, 0);
        u = dp4a_s8(q[1], xl.y, u);
        u = dp4a_s8(q[2], xl.z, u);
        u = dp4a_s8(q[3], xl.w, u);
        u = dp4a_s8(q[4], xh.x, u);
        u = dp4a_s8(q[5], xh.y, u);
        u = dp4a_s8(q[6], xh.z, u);
        u = dp4a_s8(q[7], xh.w, u);
        const float xd = xs.d[t][b];
        const int ia = (int)(scm & 0xffffu) * u, ib = (int)(scm >> 16) * (xs.z[t][b] / 8);
        return fmaf(__fmul_rn(d, xd), (float)ia, -__fmul_rn(__fmul_rn(dmin, xd), (float)ib));
    }
};
template <> struct Q8Dot<FMT_Q4_K_Q8> : Q8DotK4<FMT_Q4_K> {
    __device__ __forceinline__ explicit Q8Dot(const Group<FMT_Q4_K>& g) : Q8DotK4<FMT_Q4_K>(g) {}
};
template <> struct Q8Dot<FMT_Q5_K_Q8> : Q8DotK4<FMT_Q5_K> {
    __device__ __forceinline__ explicit Q8Dot(const Group<FMT_Q5_K>& g) : Q8DotK4<FMT_Q5_K>(g) {}
};

// The seven formats below meet the activations as the CPU's integer
// kernels do (model/src/kernels/legacy_q8.rs, low_k.rs): every block of 32
// gives exact integers (DP4A), then the f32 steps of the CPU's reference in
// its order, into accumulator b mod 4 (A = 4, K = 1), reduced as Q4_0's.
// A group's q[8] holds its 32 codes as bytes, element 4i + e in byte e of
// word i (the first 16 meet the tile's `lo`, the last 16 its `hi`).

// Σ code · q over a block's first 16 elements (`lo`) and its last 16
// (`hi`), the codes as signed bytes.
template <int NT, u32 TILE>
__device__ __forceinline__ int2 dp4a_halves(const u32 (&q)[8], const Q8Tile<NT, TILE>& xs, u32 t,
                                            u32 b) {
    const uint4 xl = *(const uint4*)&xs.lo[t][b * 4];
    const uint4 xh = *(const uint4*)&xs.hi[t][b * 4];
    int u = dp4a_s8(q[0], xl.x, 0);
    u = dp4a_s8(q[1], xl.y, u);
    u = dp4a_s8(q[2], xl.z, u);
    u = dp4a_s8(q[3], xl.w, u);
    int v = dp4a_s8(q[4], xh.x, 0);
    v = dp4a_s8(q[5], xh.y, v);
    v = dp4a_s8(q[6], xh.z, v);
    v = dp4a_s8(q[7], xh.w, v);
    return make_int2(u, v);
}

// Σ code · q over a block (exact whichever way it is summed).
template <int NT, u32 TILE>
__device__ __forceinline__ int dp4a_block(const u32 (&q)[8], const Q8Tile<NT, TILE>& xs, u32 t,
                                          u32 b) {
    const int2 h = dp4a_halves(q, xs, t, b);
    return h.x + h.y;
}

// Q4_1 and Q5_1 (`dot_q4_1_q8`, `dot_q5_1_q8`): A_b = Σ code · q (codes
// below 32) and B_b = Σ q (the tile's z / 8) give t_b = fmaf(d · x.d_b,
// A_b, (m · x.d_b) · B_b): the min is added (Q4_K's is subtracted).
template <int WF> struct Q8DotMin {
    static constexpr int WFMT = WF, A = 4, K = 1;
    static constexpr bool TERM = true;
    u32 q[8];
    float d, m;
    __device__ __forceinline__ explicit Q8DotMin(const Group<WF>& g) {
#pragma unroll
        for (int i = 0; i < 8; ++i) q[i] = g.q[i];
        d = g.d;
        m = g.m;
    }
    template <int NT, u32 TILE>
    __device__ __forceinline__ float term(const Q8Tile<NT, TILE>& xs, u32 t, u32 b) const {
        const int a = dp4a_block(q, xs, t, b);
        const float xd = xs.d[t][b];
        return fmaf(__fmul_rn(d, xd), (float)a, __fmul_rn(__fmul_rn(m, xd), (float)(xs.z[t][b] / 8)));
    }
};
template <> struct Q8Dot<FMT_Q4_1_Q8> : Q8DotMin<FMT_Q4_1> {
    __device__ __forceinline__ explicit Q8Dot(const Group<FMT_Q4_1>& g) : Q8DotMin<FMT_Q4_1>(g) {}
};
template <> struct Q8Dot<FMT_Q5_1_Q8> : Q8DotMin<FMT_Q5_1> {
    __device__ __forceinline__ explicit Q8Dot(const Group<FMT_Q5_1>& g) : Q8DotMin<FMT_Q5_1>(g) {}
};

// Q5_0 (`dot_q5_0_q8`): S_b = Σ (code − 16) · q = Σ code · q − 16 · Σ q
// (the tile's z is 8 · Σ q), scaled by f16(d) · x.d_b as Q4_0's.
template <> struct Q8Dot<FMT_Q5_0_Q8> {
    static constexpr int WFMT = FMT_Q5_0, A = 4, K = 1;
    static constexpr bool TERM = false;
    u32 q[8];
    __device__ __forceinline__ explicit Q8Dot(const Group<FMT_Q5_0>& g) {
#pragma unroll
        for (int i = 0; i < 8; ++i) q[i] = g.q[i];
    }
    template <int NT, u32 TILE>
    __device__ __forceinline__ void sums(const Q8Tile<NT, TILE>& xs, u32 t, u32 b,
                                         int (&s)[K]) const {
        s[0] = dp4a_block(q, xs, t, b) - 2 * xs.z[t][b];
    }
};

// IQ4_NL and IQ4_XS (`dot_iq4_nl_q8`, `dot_iq4_xs_q8`): S_b = ls · Σ v · q
// with v the table's signed values (IQ4_NL: ls = 1), scaled by f16(d) ·
// x.d_b (IQ4_XS: the super-block's d).
template <int WF> struct Q8DotIq4 {
    static constexpr int WFMT = WF, A = 4, K = 1;
    static constexpr bool TERM = false;
    u32 q[8];
    int ls;
    __device__ __forceinline__ explicit Q8DotIq4(const Group<WF>& g) {
#pragma unroll
        for (int i = 0; i < 8; ++i) q[i] = g.q[i] ^ 0x80808080u;  // the values again
        ls = g.ls;
    }
    template <int NT, u32 TILE>
    __device__ __forceinline__ void sums(const Q8Tile<NT, TILE>& xs, u32 t, u32 b,
                                         int (&s)[K]) const {
        s[0] = ls * dp4a_block(q, xs, t, b);
    }
};
template <> struct Q8Dot<FMT_IQ4_NL_Q8> : Q8DotIq4<FMT_IQ4_NL> {
    __device__ __forceinline__ explicit Q8Dot(const Group<FMT_IQ4_NL>& g) : Q8DotIq4<FMT_IQ4_NL>(g) {}
};
template <> struct Q8Dot<FMT_IQ4_XS_Q8> : Q8DotIq4<FMT_IQ4_XS> {
    __device__ __forceinline__ explicit Q8Dot(const Group<FMT_IQ4_XS>& g) : Q8DotIq4<FMT_IQ4_XS>(g) {}
};

// Q6_K and Q3_K (`dot_q6_k_q8`, `dot_q3_k_q8`): one sum per block as
// Q4_0's, of the signed codes (code − BIAS bytewise: Q6_K's −32..31,
// Q3_K's −4..3) by DP4A, each half of 16 times its sub-block scale,
// S_b = sc₀ · Σ₀ + sc₁ · Σ₁, scaled by f16(d) · x.d_b.
template <int WF, u32 BIAS> struct Q8DotHalves {
    static constexpr int WFMT = WF, A = 4, K = 1;
    static constexpr bool TERM = false;
    u32 q[8];
    int sc[2];
    __device__ __forceinline__ explicit Q8DotHalves(const Group<WF>& g) {
#pragma unroll
        for (int i = 0; i < 8; ++i) q[i] = __vsub4(g.q[i], BIAS);
        sc[0] = g.sc[0];
        sc[1] = g.sc[1];
    }
    template <int NT, u32 TILE>
    __device__ __forceinline__ void sums(const Q8Tile<NT, TILE>& xs, u32 t, u32 b,
                                         int (&s)[K]) const {
        const int2 h = dp4a_halves(q, xs, t, b);
        s[0] = sc[0] * h.x + sc[1] * h.y;
    }
};
template <> struct Q8Dot<FMT_Q6_K_Q8> : Q8DotHalves<FMT_Q6_K, 0x20202020u> {
    __device__ __forceinline__ explicit Q8Dot(const Group<FMT_Q6_K>& g)
        : Q8DotHalves<FMT_Q6_K, 0x20202020u>(g) {}
};
template <> struct Q8Dot<FMT_Q3_K_Q8> : Q8DotHalves<FMT_Q3_K, 0x04040404u> {
    __device__ __forceinline__ explicit Q8Dot(const Group<FMT_Q3_K>& g)
        : Q8DotHalves<FMT_Q3_K, 0x04040404u>(g) {}
};

// Q2_K (`dot_q2_k_q8`): codes 0..3 under a 4-bit scale and min per half
// of 16: A_b = sc₀ · Σ₀ code · q + sc₁ · Σ₁ code · q and B_b = m₀ · Σ₀ q +
// m₁ · Σ₁ q give t_b = fmaf(d · x.d_b, A_b, −((dmin · x.d_b) · B_b)), as
// Q4_K's.
template <> struct Q8Dot<FMT_Q2_K_Q8> {
    static constexpr int WFMT = FMT_Q2_K, A = 4, K = 1;
    static constexpr bool TERM = true;
    u32 q[8];
    float d, dmin;
    u32 sc;
    __device__ __forceinline__ explicit Q8Dot(const Group<FMT_Q2_K>& g) {
#pragma unroll
        for (int i = 0; i < 8; ++i) q[i] = g.q[i];
        d = g.d;
        dmin = g.dmin;
        sc = g.sc;
    }
    template <int NT, u32 TILE>
    __device__ __forceinline__ float term(const Q8Tile<NT, TILE>& xs, u32 t, u32 b) const {
        // B_b = Σ_l m(l) · q_l by DP4A with each half's min in every byte
        // (a half's Σ q alone would hold one more register).
        const u32 m0 = (sc >> 4 & 15u) * 0x01010101u, m1 = (sc >> 12 & 15u) * 0x01010101u;
        const uint4 xl = *(const uint4*)&xs.lo[t][b * 4];
        int u = dp4a_s8(q[0], xl.x, 0);
        u = dp4a_s8(q[1], xl.y, u);
        u = dp4a_s8(q[2], xl.z, u);
        u = dp4a_s8(q[3], xl.w, u);
        int ib = dp4a_s8(m0, xl.x, 0);
        ib = dp4a_s8(m0, xl.y, ib);
        ib = dp4a_s8(m0, xl.z, ib);
        ib = dp4a_s8(m0, xl.w, ib);
        const uint4 xh = *(const uint4*)&xs.hi[t][b * 4];
        int v = dp4a_s8(q[4], xh.x, 0);
        v = dp4a_s8(q[5], xh.y, v);
        v = dp4a_s8(q[6], xh.z, v);
        v = dp4a_s8(q[7], xh.w, v);
        ib = dp4a_s8(m1, xh.x, ib);
        ib = dp4a_s8(m1, xh.y, ib);
        ib = dp4a_s8(m1, xh.z, ib);
        ib = dp4a_s8(m1, xh.w, ib);
        const int ia = (int)(sc & 15u) * u + (int)(sc >> 8 & 15u) * v;
        const float xd = xs.d[t][b];
        return fmaf(__fmul_rn(d, xd), (float)ia, -__fmul_rn(__fmul_rn(dmin, xd), (float)ib));
    }
};

// The final sum of C accumulator chains held by C consecutive lanes (C a
// power of two; lane K·a + k holds chain (a, k)), in the CPU's order in the
// first lane: Q4_0 (C = 4): (a0 + a2) + (a1 + a3); Q8_0 (C = 16): acc[0][k]
// + acc[1][k] for each k, then hsum8's ((0 + 4) + (2 + 6)) + ((1 + 5) +
// (3 + 7)). The other lanes get the same sums with each addition's operands
// swapped: the same bits.
template <int C>
__device__ __forceinline__ float chain_sum(float v) {
#pragma unroll
    for (int o = C / 2; o > 0; o >>= 1) v = __fadd_rn(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

// Block b's values for token t, into a round's staging: the finished
// term at cs[0] (TERM), else d_b = G.d · x.d_b at cd[0] and the K integer
// sums at cs[32·k].
template <typename Dot, typename G, typename X>
__device__ __forceinline__ void stage_block(const Dot& dot, const G& g, const X& xs, u32 t, u32 b,
                                            float* cd, float* cs) {
    if constexpr (Dot::TERM) {
        cs[0] = dot.term(xs, t, b);
    } else {
        int si[Dot::K];
        dot.sums(xs, t, b, si);
        cd[0] = __fmul_rn(g.d, xs.d[t][b]);
#pragma unroll
        for (int k = 0; k < Dot::K; ++k) cs[32 * k] = (float)si[k];
    }
}

// One accumulator chain through a round: its L block values (d_b, s_b)
// at dp and sp in order, a = fmaf(d_b, s_b, a), or (TERM) the CPU's a +=
// t_b with one rounding. Value i is group g0 + A·i + ca of the row, in it
// when A·i < n (tested as A·i < n, a constant per FMA: the sum in every
// test made ptxas spill on sm_90).
template <bool TERM, int A, int L>
__device__ __forceinline__ float chain_round(const float* dp, const float* sp, int n, float a) {
#pragma unroll
    for (int i = 0; i < L; i += 4) {
        const float4 s4 = *(const float4*)(sp + i);
        const float sv[4] = {s4.x, s4.y, s4.z, s4.w};
        if constexpr (TERM) {
#pragma unroll
            for (int e = 0; e < 4; ++e)
                if (A * (i + e) < n) a = __fadd_rn(a, sv[e]);
        } else {
            const float4 d4 = *(const float4*)(dp + i);
            const float dv[4] = {d4.x, d4.y, d4.z, d4.w};
#pragma unroll
            for (int e = 0; e < 4; ++e)
                if (A * (i + e) < n) a = fmaf(dv[e], sv[e], a);
        }
    }
    return a;
}

// Asks L2 for this block's share of `bytes` at `p` (the matrices the next
// launch reads: a GLU launch's down projections), once `dep` (a word of
// this lane's first weight group) has arrived: the block's own weights are
// in, and the request overlaps its arithmetic instead of its loads. A hint:
// it changes no value.
__device__ __forceinline__ void l2_ahead_share(const u8* p, u64 bytes, u32 dep, u32 bx) {
    asm volatile("" ::"r"(dep));
    const u64 per = (bytes + gridDim.x - 1) / gridDim.x;
    const u64 lo = per * bx, hi = min(bytes, lo + per);
    for (u64 o = lo + (u64)threadIdx.x * 128; o < hi; o += (u64)MV_THREADS * 128)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(p + o));
}

// matvec_core for FMT_Q4_0_Q8 and FMT_Q8_0_Q8 (same contract; no FP8
// scales).
template <int FMT, int NT, int R, bool EARLY, bool GLU>
__device__ __forceinline__ void matvec_core_q8(u32 bx, const u8* __restrict__ w0,
                                               const u8* __restrict__ w1,
                                               const float* __restrict__ xm, u32 x_tstride,
                                               const u32* __restrict__ xrows,
                                               float* __restrict__ ym, u32 y_tstride, u32 rows,
                                               u32 cols, u32 nt, const u8* ahead,
                                               u64 ahead_bytes, const u8* __restrict__ xq) {
    using Dot = Q8Dot<FMT>;
    constexpr int WFMT = Dot::WFMT, A = Dot::A, K = Dot::K;
    static_assert(!Dot::TERM || K == 1, "a finished term per block");
    constexpr int C = A * K;                   // chains per token
    constexpr int L = 32 / A;                  // a chain's groups per round
    constexpr int TP = NT < 32 / C ? NT : 32 / C;  // tokens per pass
    constexpr int P = NT / TP;                 // passes
    static_assert(NT % TP == 0, "whole passes");
    constexpr int M = GLU ? 2 : 1;
    constexpr u32 TILE = MV_TILE_FOR(FMT, NT);
    constexpr int J = TILE / 1024;
    __shared__ __align__(16) Q8Tile<NT, TILE> xs;
    // Per warp and token of a pass, one round's d_b and s_{b,k}, group l at
    // (l mod A) · L + l / A: each chain's L values side by side (and the
    // lanes' stores in distinct banks).
    __shared__ __align__(16) float cd[MV_WARPS][TP][32];
    __shared__ __align__(16) float cs[MV_WARPS][TP][K * 32];
    // One token (BATCH): every (matrix, row) pair of the warp stages its
    // round at once, and the M·R·C chains then run side by side in lanes
    // C·(m·R + r) + K·a + k: one pass through shared memory per round
    // instead of one per pair (a Q4_0 GLU launch: 2 instead of 8 per
    // tile). The same chains in the same order: the same bits.
    constexpr bool BATCH = NT == 1 && M * R > 1 && C * M * R <= 32;
    constexpr int MR = BATCH ? M * R : 1;
    __shared__ __align__(16) float cdb[BATCH ? MV_WARPS : 1][MR][32];
    __shared__ __align__(16) float csb[BATCH ? MV_WARPS : 1][MR][BATCH ? K * 32 : 1];
    float accb = 0.0f;  // BATCH: lane C·(m·R + r) + K·a + k's chain
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 row0 = bx * (MV_WARPS * R) + warp * R;
    const u64 rb = row_bytes<WFMT>(cols);
    const u32 ngroups = cols / 32;
    const u8* const w[2] = {w0, w1};  // only the first M are used
    const float* const s[2] = {nullptr, nullptr};
    const u32 slot = (lane % A) * L + lane / A;
    // This lane's chain in the FMA phase: token j of the pass, (a, k).
    const u32 cj = lane / C, ca = (lane % C) / K, ck = lane % K;

    // Lane C·j + K·a + k (j < TP) keeps chain (a, k) of token p·TP + j in
    // acc[m][r][p]; the other lanes' values are never written out.
    float acc[M][R][P];
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int p = 0; p < P; ++p) acc[m][r][p] = 0.0f;

    // One token with xq (x's Q8 row, from the kernel that wrote x): the
    // tiles are copied from it, and its address takes x's place (one
    // pointer live across the loop, not two: with both, ptxas spilled a
    // one-token Q2_K launch on sm_86 and sm_89).
    const bool xcopy = NT == 1 && xq != nullptr;
    const float* const xsrc = xcopy ? (const float*)xq : xm;

    Group<WFMT> grp[M][J][R];
    if (EARLY) {
        mv_load_tile<WFMT, M, J, R, true>(grp, w, s, 1, 0, rb, row0, rows, cols, 0);
        pdl_entry_after(grp[0][0][0].q[0]);
    }

    for (u32 c0 = 0; c0 < cols; c0 += TILE) {
        __syncthreads();
        // One token: the tile's weights are requested before x is staged,
        // so their latency overlaps the quantization (as EARLY does for
        // the first tile of a plain launch).
        if (NT == 1 && (!EARLY || c0 != 0))
            mv_load_tile<WFMT, M, J, R, true>(grp, w, s, 1, 0, rb, row0, rows, cols, c0);
        if constexpr (NT == 1) {
            if (xcopy)
                q8_copy<TILE>(xs, (const u8*)xsrc, c0, cols);
            else
                q8_stage<NT, TILE, !EARLY>(xs, xsrc, x_tstride, xrows, nt, c0, cols);
        } else {
            q8_stage<NT, TILE, !EARLY>(xs, xsrc, x_tstride, xrows, nt, c0, cols);
        }
        __syncthreads();
        if (NT != 1 && (!EARLY || c0 != 0))
            mv_load_tile<WFMT, M, J, R, true>(grp, w, s, 1, 0, rb, row0, rows, cols, c0);
        if (NT == 1 && c0 == 0 && ahead != nullptr) l2_ahead_share(ahead, ahead_bytes, grp[0][0][0].q[0], bx);
#pragma unroll
        for (int jj = 0; jj < J; ++jj) {
            const u32 b = jj * 32 + lane;       // this lane's group in the tile
            const u32 g0 = c0 / 32 + jj * 32;   // the round's first group
            // A round past the row's last group adds nothing (every FMA
            // below is predicated off): skip its sums and barriers. Uniform
            // over the block (a down projection's 24 groups fill one of a
            // one-token tile's two rounds).
            if (g0 >= ngroups) break;
            if constexpr (BATCH) {
#pragma unroll
                for (int m = 0; m < M; ++m) {
#pragma unroll
                    for (int r = 0; r < R; ++r) {
                        const Group<WFMT>& G = grp[m][jj][r];
                        const Dot dot(G);
                        const int mr = m * R + r;
                        stage_block(dot, G, xs, 0, b, &cdb[warp][mr][slot], &csb[warp][mr][slot]);
                    }
                }
                __syncwarp();
                if (lane < C * M * R) {
                    const u32 mr = lane / C;
                    const float* dp = &cdb[warp][mr][ca * L];
                    const float* sp = &csb[warp][mr][ck * 32 + ca * L];
                    accb = chain_round<Dot::TERM, A, L>(dp, sp, (int)ngroups - (int)(g0 + ca), accb);
                }
                __syncwarp();
            } else {
#pragma unroll
                for (int m = 0; m < M; ++m) {
#pragma unroll
                    for (int r = 0; r < R; ++r) {
                        const Group<WFMT>& G = grp[m][jj][r];
                        const Dot dot(G);
#pragma unroll
                        for (int p = 0; p < P; ++p) {
                            // (Four tokens at a time: all eight of a Q4_0
                            // table launch's made ptxas spill.)
#pragma unroll 4
                            for (int j = 0; j < TP; ++j) {
                                stage_block(dot, G, xs, p * TP + j, b, &cd[warp][j][slot], &cs[warp][j][slot]);
                            }
                            __syncwarp();
                            if (lane < C * TP) {
                                const float* dp = &cd[warp][cj][ca * L];
                                const float* sp = &cs[warp][cj][ck * 32 + ca * L];
                                acc[m][r][p] = chain_round<Dot::TERM, A, L>(
                                    dp, sp, (int)ngroups - (int)(g0 + ca), acc[m][r][p]);
                            }
                            __syncwarp();
                        }
                    }
                }
            }
        }
    }

    if constexpr (BATCH) {
        // Lane C·mr holds pair mr's sum; a GLU row's up sum is R·C lanes on.
        const float v = chain_sum<C>(accb);
        const float up = GLU ? __shfl_down_sync(FULL_MASK, v, R * C) : v;
        const float out = GLU ? __fmul_rn(silu_f32(v), up) : v;
        const u32 mr = lane / C, row = row0 + mr;
        if (lane % C == 0 && mr < (u32)R && row < rows && nt > 0) ym[row] = out;
    } else {
#pragma unroll
        for (int r = 0; r < R; ++r) {
#pragma unroll
            for (int p = 0; p < P; ++p) {
                float v[M];
#pragma unroll
                for (int m = 0; m < M; ++m) v[m] = chain_sum<C>(acc[m][r][p]);
                const float out = GLU ? __fmul_rn(silu_f32(v[0]), v[M - 1]) : v[0];
                const u32 row = row0 + r, t = p * TP + cj;
                if (lane % C == 0 && lane < C * TP && row < rows && t < nt)
                    ym[(u64)t * y_tstride + row] = out;
            }
        }
    }
}

// Every launch shape's arithmetic: the float path of matvec_core_f, or
// the 8-bit-activation path of matvec_core_q8.
template <int FMT, int NT, int R, bool EARLY, bool GLU>
__device__ __forceinline__ void matvec_core(u32 bx, const u8* __restrict__ w0,
                                            const float* __restrict__ s0,
                                            const u8* __restrict__ w1,
                                            const float* __restrict__ s1, u32 s_block, u32 s_cols,
                                            const float* __restrict__ xm, u32 x_tstride,
                                            const u32* __restrict__ xrows,
                                            float* __restrict__ ym, u32 y_tstride, u32 rows,
                                            u32 cols, u32 nt, const u8* ahead = nullptr,
                                            u64 ahead_bytes = 0, const u8* xq = nullptr) {
    if constexpr (FMT_INT_ACT(FMT)) {
        matvec_core_q8<FMT, NT, R, EARLY, GLU>(bx, w0, w1, xm, x_tstride, xrows, ym, y_tstride,
                                               rows, cols, nt, ahead, ahead_bytes, xq);
    } else {
        matvec_core_f<FMT, NT, R, EARLY, GLU>(bx, w0, s0, w1, s1, s_block, s_cols, xm, x_tstride,
                                              xrows, ym, y_tstride, rows, cols, nt);
    }
}

// Rows per warp of the strided-group launch: 1 for one token, 4 for
// several. A decode matvec is latency-bound (ncu on the H200: a 512 × 2048
// Q4_0 matrix took 7.5 µs at 2% of DRAM bandwidth with 32 blocks of 2 rows
// per warp): one row per warp gives each lane half the serial work and
// the chip twice the blocks (f32 keeps 2: at 1, ptxas spills its
// single-token kernel). The host sizes the grid to match
// (cuda/src/ops.rs).
#define MV_PLAIN_ROWS_PER_WARP(FMT, NT) ((NT) == 1 ? ((FMT) == FMT_F32 ? 2 : 1) : 4)


// Strided group: matrix z is at w + z·w_mstride and reads its ntok tokens
// at x + z·x_mstride, writing y + z·y_mstride. xq: when given (the host
// gives it for one token of one matrix), x quantized (a Q8 row,
// common.cuh), which the 8-bit-activation formats copy instead of
// quantizing x in every block; the same bits.
template <int FMT, int NT>
__device__ __forceinline__ void matvec_body(const u8* __restrict__ w, u64 w_mstride,
                                            const float* __restrict__ scales, u64 s_mstride,
                                            u32 s_block, u32 s_cols, const float* __restrict__ x,
                                            u64 x_mstride, u32 x_tstride, float* __restrict__ y,
                                            u64 y_mstride, u32 y_tstride, u32 rows, u32 cols,
                                            u32 ntok, const u8* __restrict__ xq) {
    const u64 z = blockIdx.z;
    const u32 t0 = blockIdx.y * NT;
    const u32 nt = min((u32)NT, ntok - t0);
    const float* sz = scales == nullptr ? nullptr : scales + z * s_mstride;
    constexpr bool EARLY = MV_EARLY(FMT, NT);
    if (!EARLY) pdl_entry();
    matvec_core<FMT, NT, MV_PLAIN_ROWS_PER_WARP(FMT, NT), EARLY, false>(
        blockIdx.x, w + z * w_mstride, sz, nullptr, nullptr, s_block, s_cols,
        x + z * x_mstride + (u64)t0 * x_tstride, x_tstride, nullptr,
        y + z * y_mstride + (u64)t0 * y_tstride,
        y_tstride, rows, cols, nt, nullptr, 0, xq);
}

// Up to three matrices of the same width and format applied to the same
// token (a layer's q, k and v projections in one launch): blocks
// [0, b1) serve matrix 0, [b1, b2) matrix 1, [b2, grid) matrix 2, each
// exactly as its own one-token plain launch would (b1, b2: the host's
// block counts of matrices 0 and 1 at MV_PLAIN_ROWS_PER_WARP(FMT, 1) rows
// per warp).
template <int FMT>
__device__ __forceinline__ void matvec_seg_body(
    const u8* w0, const float* s0, float* y0, u32 rows0, const u8* w1, const float* s1, float* y1,
    u32 rows1, const u8* w2, const float* s2, float* y2, u32 rows2, u32 b1, u32 b2, u32 s_block,
    u32 s_cols, const float* __restrict__ x, u32 cols) {
    const u32 bx = blockIdx.x;
    const u32 seg = bx < b1 ? 0 : bx < b2 ? 1 : 2;
    const u8* w = seg == 0 ? w0 : seg == 1 ? w1 : w2;
    const float* s = seg == 0 ? s0 : seg == 1 ? s1 : s2;
    float* y = seg == 0 ? y0 : seg == 1 ? y1 : y2;
    const u32 rows = seg == 0 ? rows0 : seg == 1 ? rows1 : rows2;
    const u32 local = seg == 0 ? bx : seg == 1 ? bx - b1 : bx - b2;
    constexpr bool EARLY = MV_EARLY(FMT, 1);
    if (!EARLY) pdl_entry();
    matvec_core<FMT, 1, MV_PLAIN_ROWS_PER_WARP(FMT, 1), EARLY, false>(
        local, w, s, nullptr, nullptr, s_block, s_cols, x, 0, nullptr, y, 0, rows, cols, 1);
}

// The table launch keeps three more 64-bit values live (its matrix, scale
// and token addresses come from memory, not from parameters the compiler
// can recompute), which made ptxas spill at 4 rows per warp for several
// tokens; 2 rows per warp there, and 1 for one token but f32 (as the plain
// launch: more blocks for a layer's few experts; the same arithmetic, see
// matvec_core). The GLU launch computes two matrices per row: 1 row per
// warp, and only for one or two tokens per block (at 4, ptxas spills; a
// larger batch runs the gate and up launches and `swiglu`).
// (FMT_Q4_0_Q8 keeps 2 for one token: its expert matrices' short rows — a
// down projection's 24 groups — left a warp too little to load; ncu on the
// H200: 11.7 → 11.0 µs for a layer's 8 down projections; 4 rows per warp
// was slower in the decode graph (+0.4 µs per layer). FMT_Q8_0_Q8 does the
// same, by analogy: not measured.)
// FMT_Q4_0_Q8's GLU launch takes 2 rows per warp: a decode layer's 8
// experts at 1 were 768 blocks, 1.45 waves at the 4 blocks of 58 registers
// an SM holds; at 2 they are 384 blocks of 71 registers, one wave (the
// 48-layer decode graph on the H200: 2.759 → 2.712 ms per token).
#define MV_TABLE_ROWS_PER_WARP(FMT, NT) \
    ((NT) == 1 && (FMT) != FMT_F32 && (FMT) != FMT_Q4_0_Q8 && (FMT) != FMT_Q8_0_Q8 ? 1 : 2)
#define MV_GLU_ROWS_PER_WARP(FMT) ((FMT) == FMT_Q4_0_Q8 ? 2 : 1)

// One entry of a launch table written by an earlier launch, read-only for
// this one (volatile: kept in the order written).
__device__ __forceinline__ u32 ld_table(const u32* p) {
    u32 v;
    asm volatile("ld.global.nc.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ u64 ld_table(const u64* p) {
    u64 v;
    asm volatile("ld.global.nc.u64 %0, [%1];" : "=l"(v) : "l"(p));
    return v;
}

// Pointer table: matrix z is wherever w_ptrs[z] says (the experts of one
// layer, scattered over VRAM cache and staging slots) and is applied to
// its own tok_cnt[z] token rows starting at row tok_off[z] of x and y (the
// rows that chose it, packed by expert). Blocks past a matrix's tokens
// leave at once (uniformly, before any barrier). GLU: w2_ptrs[z] (scales
// s2_ptrs[z]) is the up projection paired with gate w_ptrs[z]. x_rows:
// when given, the token of pair row p is row x_rows[p − x_row0] of x (the
// pair rows of this launch start at x_row0) instead of row p, so the
// tokens need not be gathered first. ahead_ptrs: when given, a one-token
// GLU launch with 8-bit activations asks L2 for the ahead_bytes at
// ahead_ptrs[z] (expert z's down projection, which the next launch reads),
// each block its share, once its own weights are in (l2_ahead_share).
template <int FMT, int NT, bool GLU>
__device__ __forceinline__ void matvec_table_body(const u64* __restrict__ w_ptrs,
                                                  const u64* __restrict__ s_ptrs,
                                                  const u64* __restrict__ w2_ptrs,
                                                  const u64* __restrict__ s2_ptrs, u32 s_block,
                                                  u32 s_cols, const float* __restrict__ x,
                                                  u32 x_tstride, const u32* __restrict__ x_rows,
                                                  u32 x_row0, const u32* __restrict__ tok_off,
                                                  const u32* __restrict__ tok_cnt,
                                                  float* __restrict__ y, u32 y_tstride, u32 rows,
                                                  u32 cols, const u64* __restrict__ ahead_ptrs,
                                                  u64 ahead_bytes) {
    // The tables are written by an earlier launch (the device routing plan).
    // The count and the matrix addresses are requested at once and tested
    // together: tested one by one, ptxas moved each load past the test
    // before it, and the weights waited for three round trips to L2 (count,
    // offset, address) instead of one. (A matrix with tokens never has a
    // null address; the test leaves such a block idle rather than faulting.)
    // (One token of a format but f32 only: elsewhere the addresses held
    // across the test made ptxas spill on some of sm_80–sm_90.)
    pdl_entry();
    const u32 z = blockIdx.z;
    const u32 t0 = blockIdx.y * NT;
    u32 cnt;
    u64 wp, w2p, ap = 0;
    if (NT == 1 && FMT != FMT_F32) {
        cnt = ld_table(tok_cnt + z);
        wp = ld_table(w_ptrs + z);
        w2p = GLU ? ld_table(w2_ptrs + z) : 0;
        if (GLU && (FMT == FMT_Q4_0_Q8 || FMT == FMT_Q8_0_Q8) && ahead_ptrs != nullptr)
            ap = ld_table(ahead_ptrs + z);
        if (t0 >= cnt || wp == 0 || (GLU && w2p == 0)) return;
    } else {
        cnt = tok_cnt[z];
        if (t0 >= cnt) return;
        wp = w_ptrs[z];
        w2p = GLU ? w2_ptrs[z] : 0;
    }
    const u64 first = (u64)tok_off[z] + t0;
    constexpr int R = GLU ? MV_GLU_ROWS_PER_WARP(FMT) : MV_TABLE_ROWS_PER_WARP(FMT, NT);
    matvec_core<FMT, NT, R, false, GLU>(
        blockIdx.x, (const u8*)wp, s_ptrs == nullptr ? nullptr : (const float*)s_ptrs[z],
        (const u8*)w2p, (GLU && s2_ptrs != nullptr) ? (const float*)s2_ptrs[z] : nullptr,
        s_block, s_cols,
        x_rows != nullptr ? x : x + first * x_tstride, x_tstride,
        x_rows != nullptr ? x_rows + (first - x_row0) : nullptr, y + first * y_tstride, y_tstride,
        rows, cols, min((u32)NT, cnt - t0), (const u8*)ap, ahead_bytes);
}

#define MATVEC_KERNEL(NAME, FMT, NT)                                                              \
    extern "C" __global__ void __launch_bounds__(MV_THREADS)                                    \
        NAME(const u8* __restrict__ w, u64 w_mstride, const float* __restrict__ scales,         \
             u64 s_mstride, u32 s_block, u32 s_cols, const float* __restrict__ x, u64 x_mstride, \
             u32 x_tstride, float* __restrict__ y, u64 y_mstride, u32 y_tstride, u32 rows,       \
             u32 cols, u32 ntok, const u8* __restrict__ xq) {                                   \
        /* pdl_entry(): in matvec_core, after the first tile's weights */                       \
        matvec_body<FMT, NT>(w, w_mstride, scales, s_mstride, s_block, s_cols, x, x_mstride,    \
                             x_tstride, y, y_mstride, y_tstride, rows, cols, ntok, xq);         \
    }

#define MATVEC_SEG_KERNEL(NAME, FMT)                                                              \
    extern "C" __global__ void __launch_bounds__(MV_THREADS)                                    \
        NAME(const u8* __restrict__ w0, const float* __restrict__ s0, float* __restrict__ y0,    \
             u32 rows0, const u8* __restrict__ w1, const float* __restrict__ s1,                 \
             float* __restrict__ y1, u32 rows1, const u8* __restrict__ w2,                       \
             const float* __restrict__ s2, float* __restrict__ y2, u32 rows2, u32 b1, u32 b2,     \
             u32 s_block, u32 s_cols, const float* __restrict__ x, u32 cols) {                   \
        /* pdl_entry(): in matvec_core, after the first tile's weights */                       \
        matvec_seg_body<FMT>(w0, s0, y0, rows0, w1, s1, y1, rows1, w2, s2, y2, rows2, b1, b2,    \
                             s_block, s_cols, x, cols);                                          \
    }

#define MATVEC_TABLE_KERNEL(NAME, FMT, NT, GLU)                                                   \
    extern "C" __global__ void __launch_bounds__(MV_THREADS)                                    \
        NAME(const u64* __restrict__ w_ptrs, const u64* __restrict__ s_ptrs,                     \
             const u64* __restrict__ w2_ptrs, const u64* __restrict__ s2_ptrs, u32 s_block,      \
             u32 s_cols, const float* __restrict__ x, u32 x_tstride,                             \
             const u32* __restrict__ x_rows, u32 x_row0, const u32* __restrict__ tok_off,        \
             const u32* __restrict__ tok_cnt, float* __restrict__ y, u32 y_tstride, u32 rows,    \
             u32 cols, const u64* __restrict__ ahead_ptrs, u64 ahead_bytes) {                    \
        /* pdl_entry(): first thing in matvec_table_body */                                     \
        matvec_table_body<FMT, NT, GLU>(w_ptrs, s_ptrs, w2_ptrs, s2_ptrs, s_block, s_cols, x,    \
                                        x_tstride, x_rows, x_row0, tok_off, tok_cnt, y,          \
                                        y_tstride, rows, cols, ahead_ptrs, ahead_bytes);         \
    }

// One token through a tall f16/bf16 matrix (an LM head: 10^5 rows of a
// few thousand columns): a persistent grid of MV_STREAM_BLOCKS_PER_SM
// blocks per multiprocessor. A block stages x once; each warp then walks
// rows w, w + W, w + 2W, ... (W: the grid's warps), a row in units of 2048
// columns (two groups per lane), and loads the next unit's 64-byte groups
// into registers before it computes the current one, so every warp keeps
// loads in flight while it computes. The plain launch gives such a matrix
// a block per 8 rows (~19,000 blocks for a 151,936-row head), each
// staging x again and holding no loads while it computes and retires.
//
// The arithmetic is the plain launch's, bit for bit: lane l takes the row's
// groups l, l + 32, ... in increasing order, each group's elements in
// increasing order, one fmaf each; then warp_sum. Only whole, 16-byte
// aligned groups (cols a multiple of 32, the matrix and x 16-byte aligned,
// cols ≤ MV_STREAM_MAX_COLS): the host checks that and otherwise launches
// the plain kernel.
#define MV_STREAM_MAX_COLS 8192
#define MV_STREAM_BLOCKS_PER_SM 2

template <bool BF>
struct StreamUnit {
    uint4 q[2][4];  // this lane's two groups of the unit (jj = 0, 1)
    // Loads unit `t` (columns 2048·t ..) of `row`; groups past the row are
    // not loaded (and not used).
    __device__ __forceinline__ void load(const u8* __restrict__ w, u64 rb, u32 row, u32 t,
                                         u32 ngroups, u32 lane) {
#pragma unroll
        for (int jj = 0; jj < 2; ++jj) {
            const u32 g = t * 64 + jj * 32 + lane;
            if (g < ngroups) {
                const uint4* p = (const uint4*)(w + (u64)row * rb + (u64)g * 64);
#pragma unroll
                for (int i = 0; i < 4; ++i) q[jj][i] = __ldg(p + i);
            }
        }
    }
    // Adds the unit's products to `acc` in the plain launch's order.
    __device__ __forceinline__ void fma_into(float& acc, const float* __restrict__ xs, u32 t,
                                             u32 ngroups, u32 lane) const {
#pragma unroll
        for (int jj = 0; jj < 2; ++jj) {
            const u32 g = t * 64 + jj * 32 + lane;
            if (g < ngroups) {
                const float* xl = xs + g * 36;
#pragma unroll
                for (int sub = 0; sub < 8; ++sub) {
                    const float4 xv = *(const float4*)(xl + sub * 4);
                    const float4 wv = half_group4<BF>(q[jj], sub);
                    acc = fmaf(wv.x, xv.x, acc);
                    acc = fmaf(wv.y, xv.y, acc);
                    acc = fmaf(wv.z, xv.z, acc);
                    acc = fmaf(wv.w, xv.w, acc);
                }
            }
        }
    }
};

// A warp's walk over its units: (row, t) → the next one.
__device__ __forceinline__ void stream_next(u32& row, u32& t, u32 units, u32 stride) {
    if (++t == units) {
        t = 0;
        row += stride;
    }
}

// One step of the walk: loads the unit after (row, t) into `nxt`, adds
// `cur` (unit (row, t)) to acc, stores a finished row; advances (row, t).
template <bool BF>
__device__ __forceinline__ void stream_step(const StreamUnit<BF>& cur, StreamUnit<BF>& nxt,
                                            const u8* __restrict__ w, u64 rb,
                                            const float* __restrict__ xs, float* __restrict__ y,
                                            u32 rows, u32 ngroups, u32 units, u32 stride,
                                            u32 lane, u32& row, u32& t, float& acc) {
    u32 nrow = row, nt = t;
    stream_next(nrow, nt, units, stride);
    if (nrow < rows) nxt.load(w, rb, nrow, nt, ngroups, lane);
    cur.fma_into(acc, xs, t, ngroups, lane);
    if (t + 1 == units) {
        const float v = warp_sum(acc);
        if (lane == 0) y[row] = v;
        acc = 0.0f;
    }
    row = nrow;
    t = nt;
}

template <bool BF>
__device__ __forceinline__ void matvec_stream_body(const u8* __restrict__ w,
                                                   const float* __restrict__ x,
                                                   float* __restrict__ y, u32 rows, u32 cols) {
    __shared__ __align__(16) float xs[MV_STREAM_MAX_COLS + MV_STREAM_MAX_COLS / 8];
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 stride = gridDim.x * MV_WARPS;
    const u64 rb = (u64)cols * 2;
    const u32 ngroups = cols / 32, units = (ngroups + 63) / 64;
    u32 row = blockIdx.x * MV_WARPS + warp, t = 0;
    StreamUnit<BF> a, b;
    // The weights are device constants: the first unit loads before the wait.
    if (row < rows) a.load(w, rb, row, 0, ngroups, lane);
    pdl_entry();
    for (u32 i = threadIdx.x; i < cols / 4; i += MV_THREADS) {
        const u32 j = 4 * i;
        *(float4*)&xs[j + (j >> 5) * 4] = *(const float4*)(x + j);
    }
    __syncthreads();
    float acc = 0.0f;
    // Two steps per iteration, so the units trade places without copies.
    while (row < rows) {
        stream_step<BF>(a, b, w, rb, xs, y, rows, ngroups, units, stride, lane, row, t, acc);
        if (row >= rows) break;
        stream_step<BF>(b, a, w, rb, xs, y, rows, ngroups, units, stride, lane, row, t, acc);
    }
}

#define MATVEC_STREAM_KERNEL(NAME, BF)                                                           \
    extern "C" __global__ void __launch_bounds__(MV_THREADS, MV_STREAM_BLOCKS_PER_SM)           \
        NAME(const u8* __restrict__ w, const float* __restrict__ x, float* __restrict__ y,      \
             u32 rows, u32 cols) {                                                              \
        /* pdl_entry(): in matvec_stream_body, after the first unit's weights */               \
        matvec_stream_body<BF>(w, x, y, rows, cols);                                           \
    }

MATVEC_STREAM_KERNEL(matvec_f16_stream_t1, false)
MATVEC_STREAM_KERNEL(matvec_bf16_stream_t1, true)

#define MATVEC_FORMAT(NAME, FMT)                          \
    MATVEC_KERNEL(NAME##_t1, FMT, 1)                      \
    MATVEC_KERNEL(NAME##_t2, FMT, 2)                      \
    MATVEC_KERNEL(NAME##_t4, FMT, 4)                      \
    MATVEC_KERNEL(NAME##_t8, FMT, 8)                      \
    MATVEC_SEG_KERNEL(NAME##_seg_t1, FMT)                 \
    MATVEC_TABLE_KERNEL(NAME##_table_t1, FMT, 1, false)   \
    MATVEC_TABLE_KERNEL(NAME##_table_t2, FMT, 2, false)   \
    MATVEC_TABLE_KERNEL(NAME##_table_t4, FMT, 4, false)   \
    MATVEC_TABLE_KERNEL(NAME##_table_t8, FMT, 8, false)   \
    MATVEC_TABLE_KERNEL(NAME##_table_glu_t1, FMT, 1, true) \
    MATVEC_TABLE_KERNEL(NAME##_table_glu_t2, FMT, 2, true)

MATVEC_FORMAT(matvec_f32, FMT_F32)
MATVEC_FORMAT(matvec_f16, FMT_F16)
MATVEC_FORMAT(matvec_bf16, FMT_BF16)
MATVEC_FORMAT(matvec_f8e4m3, FMT_F8E4M3)
MATVEC_FORMAT(matvec_q8_0, FMT_Q8_0)
MATVEC_FORMAT(matvec_q4_0, FMT_Q4_0)
MATVEC_FORMAT(matvec_q4_0q8, FMT_Q4_0_Q8)
MATVEC_FORMAT(matvec_q8_0q8, FMT_Q8_0_Q8)
MATVEC_FORMAT(matvec_q6_k, FMT_Q6_K)
MATVEC_FORMAT(matvec_q6_kq8, FMT_Q6_K_Q8)
MATVEC_FORMAT(matvec_q4_k, FMT_Q4_K)
MATVEC_FORMAT(matvec_q4_kq8, FMT_Q4_K_Q8)
MATVEC_FORMAT(matvec_q5_k, FMT_Q5_K)
MATVEC_FORMAT(matvec_q5_kq8, FMT_Q5_K_Q8)
MATVEC_FORMAT(matvec_q4_1, FMT_Q4_1)
MATVEC_FORMAT(matvec_q5_0, FMT_Q5_0)
MATVEC_FORMAT(matvec_q5_1, FMT_Q5_1)
MATVEC_FORMAT(matvec_q2_k, FMT_Q2_K)
MATVEC_FORMAT(matvec_q3_k, FMT_Q3_K)
MATVEC_FORMAT(matvec_iq4_nl, FMT_IQ4_NL)
MATVEC_FORMAT(matvec_iq4_xs, FMT_IQ4_XS)
MATVEC_FORMAT(matvec_q4_1q8, FMT_Q4_1_Q8)
MATVEC_FORMAT(matvec_q5_0q8, FMT_Q5_0_Q8)
MATVEC_FORMAT(matvec_q5_1q8, FMT_Q5_1_Q8)
MATVEC_FORMAT(matvec_q2_kq8, FMT_Q2_K_Q8)
MATVEC_FORMAT(matvec_q3_kq8, FMT_Q3_K_Q8)
MATVEC_FORMAT(matvec_iq4_nlq8, FMT_IQ4_NL_Q8)
MATVEC_FORMAT(matvec_iq4_xsq8, FMT_IQ4_XS_Q8)
