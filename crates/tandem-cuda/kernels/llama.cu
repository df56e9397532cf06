// tandem's CUDA kernels for the Llama-family forward pass, compiled at start-up by NVRTC for the
// device's compute capability. The host prepends the model's shape as #defines:
//   HEAD_DIM   width of one attention head (a multiple of 16)
//   GQA        query heads per key/value head
//   KV_BLOCK   tokens per paged KV block
//   DEC_PART   keys per split of the decode attention (flash-decoding partition)
//   DS_KEYS    most keys per split of the small-batch decode attention
//   GV_U, GV_MINB  GEMV tuning: chunks per row a lane loads per step; blocks per SM to fit
//   GV_MMA     1: the packed GGUF GEMVs run on the tensor cores (gv_octet); 0: on the FP32 lanes
//   GV_FORMATS weight formats whose GEMVs are compiled (a bit mask; bf16 always)
//   KV_FP8     1: the KV cache holds FP8 E4M3 codes of value / KV_SCALE (one byte an element), 0: bf16
//   KV_SCALE   the per-tensor scale of FP8 KV codes (a float literal)
// bf16 values travel as raw 16-bit patterns (no header dependency); arithmetic is in fp32.
//
// Paged KV layout per layer: block b holds [K|V][kv_head][slot][HEAD_DIM] contiguously, the layout the
// CPU backend and the KV transfer use. A "slot" below is block * KV_BLOCK + offset.

typedef unsigned short bf16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define NEG_INF (-__int_as_float(0x7f800000))

__device__ __forceinline__ float bf2f(bf16 v) { return __uint_as_float(((u32)v) << 16); }

// Round to nearest even: the same rounding as PyTorch's bf16 casts (one cvt instruction on sm_80+).
__device__ __forceinline__ bf16 f2bf(float f) {
#if __CUDA_ARCH__ >= 800
    bf16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
#else
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
#endif
}

__device__ __forceinline__ float round_bf(float f) { return bf2f(f2bf(f)); }

__device__ __forceinline__ u32 pack_bf2(float lo, float hi) {
#if __CUDA_ARCH__ >= 800
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
#else
    return (u32)f2bf(lo) | ((u32)f2bf(hi) << 16);
#endif
}

// 2^x in one MUFU instruction (flushes denormal results to zero: probabilities that small are 0 in
// bf16 anyway).
__device__ __forceinline__ float fast_exp2(float x) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}

// The 8 bf16 values of a 16-byte load as floats, by bit operations (keeps everything in registers).
__device__ __forceinline__ void unpack8(const uint4& v, float* f) {
    f[0] = __uint_as_float(v.x << 16); f[1] = __uint_as_float(v.x & 0xffff0000u);
    f[2] = __uint_as_float(v.y << 16); f[3] = __uint_as_float(v.y & 0xffff0000u);
    f[4] = __uint_as_float(v.z << 16); f[5] = __uint_as_float(v.z & 0xffff0000u);
    f[6] = __uint_as_float(v.w << 16); f[7] = __uint_as_float(v.w & 0xffff0000u);
}

// ---- KV cache elements: bf16, or FP8 E4M3 codes (KV_FP8) at half the bytes to hold, read and move. ----
// Every kernel touches the cache through these: kv_row addresses an element, kv8_load / kv8_unpack
// read a thread's 8 consecutive elements (16 bytes of bf16 or 8 of codes) as floats, kv_bf16x8 turns
// such 8 into 8 bf16 (the tensor-core prefill's shared-memory tiles), kv_of encodes one value.
#if KV_FP8
typedef unsigned char kv_t;
typedef uint2 kv8_t;
#else
typedef bf16 kv_t;
typedef uint4 kv8_t;
#endif
#define KV_BYTES ((int)sizeof(kv_t))

// An E4M3 code's 7 exponent/mantissa bits at float bits 26..20 and its sign at bit 31 make a float
// that is the code's value times 2^-120 (normal and subnormal codes alike; see unpack16_e4m3), so one
// multiply by 2^120 * KV_SCALE gives the scaled value. Codes 0x7f/0xff (NaN) are never written.
__device__ __forceinline__ float kv_e4m3(u32 c) {
    return __uint_as_float(((c & 0x7fu) << 20) | ((c & 0x80u) << 24)) * (0x1p120f * KV_SCALE);
}

__device__ __forceinline__ kv8_t kv8_load(const kv_t* p) { return *(const kv8_t*)p; }

__device__ __forceinline__ void kv8_unpack(const kv8_t& v, float* f) {
#if KV_FP8
#pragma unroll
    for (int i = 0; i < 4; i++) {
        f[i] = kv_e4m3(v.x >> (8 * i));
        f[4 + i] = kv_e4m3(v.y >> (8 * i));
    }
#else
    unpack8(v, f);
#endif
}

// The E4M3 code of f (round to nearest even, saturating at +-448; f is finite): the encoding
// `quant_fp8` writes, the OCP FP8 format of HF FP8 checkpoints.
__device__ unsigned char e4m3_of(float f) {
    const u32 sign = f < 0.f ? 0x80u : 0u;
    const float a = fabsf(f);
    if (!(a < 464.f)) return (unsigned char)(sign | 0x7e);  // rounds past 448 (or NaN): saturate
    if (a < 0.015625f) {
        // Subnormal: m x 2^-9, m in 0..8 (8 is the smallest normal, 0x08).
        return (unsigned char)(sign | (u32)rintf(a * 512.f));
    }
    int e;
    const float mant = frexpf(a, &e);  // a = mant x 2^e, mant in [0.5, 1)
    u32 m = (u32)rintf((mant * 2.f - 1.f) * 8.f);
    int ex = e - 1 + 7;
    if (m == 8) {
        m = 0;
        ex += 1;
    }
    u32 code = ((u32)ex << 3) | m;
    if (code > 0x7e) code = 0x7e;
    return (unsigned char)(sign | code);
}

// 8 elements as 8 bf16 (the prefill's tensor-core tiles): bf16's own bits, or each code's value
// times KV_SCALE rounded to bf16 (exact when KV_SCALE is a power of two).
__device__ __forceinline__ uint4 kv_bf16x8(const kv8_t& v) {
#if KV_FP8
    float f[8];
    kv8_unpack(v, f);
    return make_uint4(pack_bf2(f[0], f[1]), pack_bf2(f[2], f[3]), pack_bf2(f[4], f[5]), pack_bf2(f[6], f[7]));
#else
    return v;
#endif
}

// The cache element of a value (already rounded to bf16 by the caller, as HF rounds k and v).
__device__ __forceinline__ kv_t kv_of(float v) {
#if KV_FP8
    return e4m3_of(v / KV_SCALE);
#else
    return f2bf(v);
#endif
}

// One element as a float (the reference attention kernel).
__device__ __forceinline__ float kv_f(kv_t v) {
#if KV_FP8
    return kv_e4m3(v);
#else
    return bf2f(v);
#endif
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over a block of up to 1024 threads; `red` holds 32 floats of shared memory.
__device__ float block_sum(float v, float* red) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    int nw = (blockDim.x + 31) >> 5;
    v = lane < nw ? red[lane] : 0.f;
    return warp_sum(v);
}

// Programmatic dependent launch (sm_90): a kernel launched with programmatic stream serialisation
// may start while its predecessor still runs. pdl_wait() blocks until the predecessor has finished
// and its writes are visible, so everything before it may only read what no earlier kernel of the
// step writes (weights); pdl_trigger() lets the next kernel start launching. Both are no-ops for a
// plain launch. Every kernel the host may launch that way calls pdl_wait() before its first
// dependent read.
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_trigger() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// ---------------------------------------------------------------------------------------------------
// Elementwise and normalisation

// Deterministic uniform bf16 values in [-scale, scale) from a hash of (seed, index): random weights
// generated on the device for speed runs, with no file behind them.
extern "C" __global__ void init_uniform(bf16* out, u64 n, u64 seed, float scale) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        u64 x = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
        x ^= x >> 33; x *= 0xff51afd7ed558ccdull; x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ull; x ^= x >> 33;
        float u = (float)(x >> 40) * (1.0f / 16777216.0f);
        out[i] = f2bf((2.f * u - 1.f) * scale);
    }
}

extern "C" __global__ void fill_bf16(bf16* out, u64 n, float value) {
    bf16 v = f2bf(value);
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        out[i] = v;
}

// x[t] = embed[tokens[t]] * scale, rounded to bf16 (one block per token; scale 1 copies exactly;
// Gemma scales by sqrt(hidden)).
extern "C" __global__ void embed_gather(const bf16* __restrict__ embed, const int* __restrict__ tokens,
                                        bf16* __restrict__ x, int hidden, float scale) {
    const bf16* src = embed + (u64)tokens[blockIdx.x] * hidden;
    bf16* dst = x + (u64)blockIdx.x * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) dst[i] = f2bf(bf2f(src[i]) * scale);
}

// residual += delta (rounded to bf16, as a bf16 model adds), then out = RMSNorm(residual) * w with
// HF's rounding: normalise in fp32, round to bf16, multiply by the bf16 weight, round again.
// delta may be null (the first layer's norm). With `post` (Gemma's post-attention and post-MLP
// norms) the delta is first normalised itself: RMSNorm(delta) * post, in fp32 and rounded once (as
// Gemma's norm rounds). One block per row; each thread keeps its (at most NORM_CHUNKS) 16-byte
// chunks of the row in registers between the passes. hidden % 8 == 0 and
// hidden <= 8 * NORM_CHUNKS * blockDim.x (checked by the host).
#define NORM_CHUNKS 2
extern "C" __global__ void add_rmsnorm(bf16* __restrict__ residual, const bf16* __restrict__ delta,
                                       const bf16* __restrict__ w, bf16* __restrict__ out, int hidden,
                                       float eps, const bf16* __restrict__ post) {
    __shared__ float red[32];
    pdl_wait();
    pdl_trigger();
    bf16* r = residual + (u64)blockIdx.x * hidden;
    const bf16* d = delta ? delta + (u64)blockIdx.x * hidden : 0;
    bf16* o = out + (u64)blockIdx.x * hidden;
    float v[NORM_CHUNKS][8];
    float dv[NORM_CHUNKS][8];
    float post_inv = 1.f;
    if (d && post) {
        float dss = 0.f;
#pragma unroll
        for (int c = 0; c < NORM_CHUNKS; c++) {
            const int k = (threadIdx.x + c * blockDim.x) * 8;
            if (k < hidden) {
                unpack8(*(const uint4*)(d + k), dv[c]);
#pragma unroll
                for (int e = 0; e < 8; e++) dss += dv[c][e] * dv[c][e];
            }
        }
        dss = block_sum(dss, red);
        post_inv = rsqrtf(dss / (float)hidden + eps);
    }
    float ss = 0.f;
#pragma unroll
    for (int c = 0; c < NORM_CHUNKS; c++) {
        const int k = (threadIdx.x + c * blockDim.x) * 8;
        if (k < hidden) {
            unpack8(*(const uint4*)(r + k), v[c]);
            if (d) {
                if (post) {
                    float g[8];
                    unpack8(*(const uint4*)(post + k), g);
#pragma unroll
                    for (int e = 0; e < 8; e++) dv[c][e] = round_bf(dv[c][e] * post_inv * g[e]);
                } else {
                    unpack8(*(const uint4*)(d + k), dv[c]);
                }
#pragma unroll
                for (int e = 0; e < 8; e++) v[c][e] = round_bf(v[c][e] + dv[c][e]);
                uint4 pk;
                pk.x = pack_bf2(v[c][0], v[c][1]);
                pk.y = pack_bf2(v[c][2], v[c][3]);
                pk.z = pack_bf2(v[c][4], v[c][5]);
                pk.w = pack_bf2(v[c][6], v[c][7]);
                *(uint4*)(r + k) = pk;
            }
#pragma unroll
            for (int e = 0; e < 8; e++) ss += v[c][e] * v[c][e];
        }
    }
    ss = block_sum(ss, red);
    const float inv = rsqrtf(ss / (float)hidden + eps);
#pragma unroll
    for (int c = 0; c < NORM_CHUNKS; c++) {
        const int k = (threadIdx.x + c * blockDim.x) * 8;
        if (k < hidden) {
            float g[8];
            unpack8(*(const uint4*)(w + k), g);
            uint4 pk;
            pk.x = pack_bf2(round_bf(v[c][0] * inv) * g[0], round_bf(v[c][1] * inv) * g[1]);
            pk.y = pack_bf2(round_bf(v[c][2] * inv) * g[2], round_bf(v[c][3] * inv) * g[3]);
            pk.z = pack_bf2(round_bf(v[c][4] * inv) * g[4], round_bf(v[c][5] * inv) * g[5]);
            pk.w = pack_bf2(round_bf(v[c][6] * inv) * g[6], round_bf(v[c][7] * inv) * g[7]);
            *(uint4*)(o + k) = pk;
        }
    }
}

// out[i] = x[rows[i]]: the rows that want logits, gathered before the output head.
extern "C" __global__ void gather_rows(const bf16* __restrict__ x, const int* __restrict__ rows,
                                       bf16* __restrict__ out, int width) {
    pdl_wait();
    pdl_trigger();
    const bf16* src = x + (u64)rows[blockIdx.x] * width;
    bf16* dst = out + (u64)blockIdx.x * width;
    for (int i = threadIdx.x; i < width; i += blockDim.x) dst[i] = src[i];
}

// act = silu(gate) * up (gelu != 0: GELU with the tanh approximation, Gemma's) over `rows` rows of
// [gate | up] (each ffn wide), rounded like HF's bf16 MLP.
// grid = (column blocks, row blocks): blocks stride over the rows, since a grid's y is at most 65,535
// and a large prefill's expert rows (tokens x top-k) can be more; eight columns per thread with
// 16-byte loads (ffn % 8 == 0, checked by the host), no 64-bit index division.
extern "C" __global__ void silu_mul(const bf16* __restrict__ gu, bf16* __restrict__ act, int ffn, int rows,
                                    int gelu) {
    for (int row = blockIdx.y; row < rows; row += gridDim.y) {
        const bf16* g = gu + (u64)row * 2 * ffn;
        const bf16* u = g + ffn;
        bf16* o = act + (u64)row * ffn;
        for (int c = 8 * (blockIdx.x * blockDim.x + threadIdx.x); c < ffn; c += 8 * gridDim.x * blockDim.x) {
            float gf[8], uf[8], r[8];
            unpack8(*(const uint4*)(g + c), gf);
            unpack8(*(const uint4*)(u + c), uf);
#pragma unroll
            for (int e = 0; e < 8; e++) {
                const float x = gf[e];
                const float a = gelu ? 0.5f * x * (1.f + tanhf(0.7978845608f * (x + 0.044715f * x * x * x)))
                                     : x / (1.f + __expf(-x));
                r[e] = round_bf(a) * uf[e];
            }
            uint4 pk;
            pk.x = pack_bf2(r[0], r[1]);
            pk.y = pack_bf2(r[2], r[3]);
            pk.z = pack_bf2(r[4], r[5]);
            pk.w = pack_bf2(r[6], r[7]);
            *(uint4*)(o + c) = pk;
        }
    }
}

// Per token: optional q/k/v biases, RoPE on q (in place) and k, then k and v into the paged cache at
// slots[t]. qkv rows are [q | k | v] (n_heads, n_kv, n_kv heads). cos/sin tables are [pos][HEAD_DIM/2].
// neox != 0 rotates (i, i + d/2) pairs (HF weights), else adjacent pairs (GGUF's permuted weights).
// Rounding mirrors HF: cos and sin in bf16, each product and the sum rounded to bf16.
extern "C" __global__ void rope_kv_write(bf16* __restrict__ qkv, const bf16* __restrict__ bias,
                                         const int* __restrict__ positions, const int* __restrict__ slots,
                                         const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                                         kv_t* __restrict__ cache, int n_heads, int n_kv, int neox) {
    const int t = blockIdx.x;
    const int half = HEAD_DIM / 2;
    const int width = (n_heads + 2 * n_kv) * HEAD_DIM;
    bf16* row = qkv + (u64)t * width;
    const int pos = positions[t];
    const int slot = slots[t];
    const u64 blk = slot / KV_BLOCK, off = slot % KV_BLOCK;
    const float* cs = cos_t + (u64)pos * half;
    const float* sn = sin_t + (u64)pos * half;
    // Rotated pairs of q and k heads.
    const int pairs = (n_heads + n_kv) * half;
    for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
        int head = p / half, i = p % half;
        int i0 = neox ? i : 2 * i;
        int i1 = neox ? i + half : 2 * i + 1;
        int base = head * HEAD_DIM;
        float x0 = bf2f(row[base + i0]), x1 = bf2f(row[base + i1]);
        if (bias) {
            x0 = round_bf(x0 + bf2f(bias[base + i0]));
            x1 = round_bf(x1 + bf2f(bias[base + i1]));
        }
        float c = round_bf(cs[i]), s = round_bf(sn[i]);
        bf16 y0 = f2bf(round_bf(x0 * c) - round_bf(x1 * s));
        bf16 y1 = f2bf(round_bf(x1 * c) + round_bf(x0 * s));
        if (head < n_heads) {
            row[base + i0] = y0;
            row[base + i1] = y1;
        } else {
            int kh = head - n_heads;
            kv_t* dst = cache + ((blk * 2 + 0) * n_kv + kh) * (u64)KV_BLOCK * HEAD_DIM + off * HEAD_DIM;
            dst[i0] = kv_of(bf2f(y0));
            dst[i1] = kv_of(bf2f(y1));
        }
    }
    // v, copied (with its bias) into the V plane.
    const int vbase = (n_heads + n_kv) * HEAD_DIM;
    for (int e = threadIdx.x; e < n_kv * HEAD_DIM; e += blockDim.x) {
        int kh = e / HEAD_DIM, d = e % HEAD_DIM;
        float v = bf2f(row[vbase + e]);
        if (bias) v = round_bf(v + bf2f(bias[vbase + e]));
        cache[((blk * 2 + 1) * n_kv + kh) * (u64)KV_BLOCK * HEAD_DIM + off * HEAD_DIM + d] = kv_of(round_bf(v));
    }
}

// x = cap * tanh(x / cap) over n fp32 logits, in place (final-logit soft-capping).
extern "C" __global__ void softcap(float* __restrict__ x, u64 n, float cap) {
    pdl_wait();
    pdl_trigger();
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        x[i] = cap * tanhf(x[i] / cap);
}

// Per-head RMSNorm of q and k before RoPE (Qwen3's q_norm / k_norm), in place in the qkv rows: one warp
// per (token, head); heads below n_heads take qw, the n_kv after them kw (HEAD_DIM weights each). Rounding
// as HF's: the normalised value rounded to bf16, then times the weight.
extern "C" __global__ void qk_norm(bf16* __restrict__ qkv, const bf16* __restrict__ qw, const bf16* __restrict__ kw,
                                   int n_heads, int n_kv, float eps) {
    constexpr int PER_LANE = (HEAD_DIM + 31) / 32;
    const int head = blockIdx.y * (blockDim.x / 32) + threadIdx.x / 32;
    if (head >= n_heads + n_kv) return;
    const int lane = threadIdx.x & 31;
    bf16* x = qkv + (u64)blockIdx.x * (n_heads + 2 * n_kv) * HEAD_DIM + (u64)head * HEAD_DIM;
    const bf16* w = head < n_heads ? qw : kw;
    float v[PER_LANE];
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < PER_LANE; i++) {
        const int d = lane + 32 * i;
        v[i] = d < HEAD_DIM ? bf2f(x[d]) : 0.f;
        ss += v[i] * v[i];
    }
    const float inv = rsqrtf(warp_sum(ss) / (float)HEAD_DIM + eps);
#pragma unroll
    for (int i = 0; i < PER_LANE; i++) {
        const int d = lane + 32 * i;
        if (d < HEAD_DIM) x[d] = f2bf(round_bf(v[i] * inv) * bf2f(w[d]));
    }
}

// (best, idx) over the block: the largest value, the smallest index on ties; every thread gets it.
// `bv`, `bi` hold 32 entries of shared memory.
__device__ __forceinline__ void block_argmax(float& best, int& idx, float* bv, int* bi) {
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, best, o);
        int oi = __shfl_xor_sync(0xffffffffu, idx, o);
        if (ov > best || (ov == best && oi < idx)) { best = ov; idx = oi; }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) { bv[warp] = best; bi[warp] = idx; }
    __syncthreads();
    const int nw = blockDim.x >> 5;
    best = lane < nw ? bv[lane] : NEG_INF;
    idx = lane < nw ? bi[lane] : 0x7fffffff;
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, best, o);
        int oi = __shfl_xor_sync(0xffffffffu, idx, o);
        if (ov > best || (ov == best && oi < idx)) { best = ov; idx = oi; }
    }
}

// Index of each row's largest logit (greedy sampling on the device). One block per row.
extern "C" __global__ void argmax_rows(const float* __restrict__ logits, int vocab, int* __restrict__ out) {
    __shared__ float bv[32];
    __shared__ int bi[32];
    pdl_wait();
    pdl_trigger();
    const float* r = logits + (u64)blockIdx.x * vocab;
    float best = NEG_INF;
    int idx = 0x7fffffff;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        float v = r[i];
        if (v > best) { best = v; idx = i; }
    }
    block_argmax(best, idx, bv, bi);
    if (threadIdx.x == 0) out[blockIdx.x] = idx;
}

// ---- Sampling on the device: temperature, top-k, top-p, min-p, then one draw, per row. ----
// The filters (the host sampler's order: top-k, then top-p over the top-k set, then min-p against
// the top token) become one threshold on the logit; a token survives when its logit is at or above
// it. Top-k's threshold is the k-th largest logit, found by a radix select over the logits' order-
// preserving 32-bit keys (four 8-bit digits, a 256-bin histogram each); top-p's is found the same
// way over the kept tokens' probability mass (exp((l - max) / T) in 2^-40 fixed point, so the sums
// are exact and the result does not depend on the order of the atomics). The draw is a Gumbel-max:
// argmax over the kept tokens of l / T - log(-log u_i), with u_i a hash of (row seed, token) — an
// exact sample of the renormalised distribution with no sort and no prefix sum. One block of 1024
// threads per row; the logits stay on the device.
struct SampleParams {
    float temperature;  // <= 0: greedy
    float top_p;        // >= 1: off
    float min_p;        // <= 0: off
    int top_k;          // <= 0 or >= vocab: off
    u64 seed;           // this row's draw (the request's generator at this output index)
};

// Order-preserving key of a float (larger float, larger key; NaN aside).
__device__ __forceinline__ u32 fkey(float f) {
    const u32 u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ u64 mix64(u64 x) {
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

// Uniform in (0, 1), never 0 or 1: 23 bits of a hash of (seed, i), plus one half (exact in a float:
// with 24 bits the top value rounded to 1.0, whose Gumbel key is infinite — the on-device sampler
// check caught that as a 0.8% excess of tail tokens).
__device__ __forceinline__ float uniform01(u64 seed, u32 i) {
    const u64 h = mix64(seed ^ mix64((u64)i + 0x9e3779b97f4a7c15ull));
    return ((float)(h >> 41) + 0.5f) * (1.0f / 8388608.0f);
}

// The largest key t such that the elements with key >= t and key >= floor weigh at least `target`
// (weights: counts when `mass` is false, fixed-point probabilities when true). Every thread gets it.
__device__ u32 radix_find(const float* __restrict__ row, int vocab, u32 floor, u64 target, bool mass, float lmax,
                          float inv_t, u64* hist) {
    __shared__ u32 s_prefix;
    __shared__ u64 s_above;
    u32 prefix = 0, mask = 0;
    u64 above = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int d = threadIdx.x; d < 256; d += blockDim.x) hist[d] = 0;
        __syncthreads();
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            const float l = row[i];
            const u32 k = fkey(l);
            if ((k & mask) == prefix && k >= floor) {
                const u64 w = mass ? (u64)(exp2f((l - lmax) * inv_t * 1.4426950408889634f) * 1099511627776.0f) : 1;
                atomicAdd((unsigned long long*)&hist[(k >> shift) & 255], (unsigned long long)w);
            }
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            u32 sel = 0;
            for (int d = 255; d >= 0; d--) {
                if (above + hist[d] >= target) {
                    sel = d;
                    break;
                }
                above += hist[d];
            }
            s_prefix = prefix | (sel << shift);
            s_above = above;
        }
        __syncthreads();
        prefix = s_prefix;
        above = s_above;
        mask |= 255u << shift;
    }
    return prefix;
}

extern "C" __global__ void __launch_bounds__(1024) sample_rows(const float* __restrict__ logits, int vocab,
                                                               const SampleParams* __restrict__ params,
                                                               int* __restrict__ out) {
    __shared__ float bv[32];
    __shared__ int bi[32];
    __shared__ u64 hist[256];
    const float* row = logits + (u64)blockIdx.x * vocab;
    const SampleParams p = params[blockIdx.x];
    float lmax = NEG_INF;
    int imax = 0x7fffffff;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float v = row[i];
        if (v > lmax) { lmax = v; imax = i; }
    }
    block_argmax(lmax, imax, bv, bi);
    if (p.temperature <= 1e-5f || p.top_k == 1) {
        if (threadIdx.x == 0) out[blockIdx.x] = imax;
        return;
    }
    const float inv_t = 1.f / p.temperature;
    u32 thr = 0;
    if (p.top_k > 0 && p.top_k < vocab) thr = radix_find(row, vocab, 0, (u64)p.top_k, false, lmax, inv_t, hist);
    if (p.top_p < 1.f) {
        // Mass of the top-k set, then the key where the descending cumulative mass reaches top_p of it.
        u64 local = 0;
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            const float l = row[i];
            if (fkey(l) >= thr) local += (u64)(exp2f((l - lmax) * inv_t * 1.4426950408889634f) * 1099511627776.0f);
        }
        __shared__ u64 s_total;
        if (threadIdx.x == 0) s_total = 0;
        __syncthreads();
        atomicAdd((unsigned long long*)&s_total, (unsigned long long)local);
        __syncthreads();
        const u64 target = (u64)((double)fmaxf(p.top_p, 0.f) * (double)s_total);
        thr = max(thr, radix_find(row, vocab, thr, max(target, (u64)1), true, lmax, inv_t, hist));
    }
    if (p.min_p > 0.f) thr = max(thr, fkey(lmax + p.temperature * logf(p.min_p)));
    float best = NEG_INF;
    int idx = 0x7fffffff;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float l = row[i];
        if (fkey(l) >= thr) {
            const float g = l * inv_t - logf(-logf(uniform01(p.seed, (u32)i)));
            if (g > best) { best = g; idx = i; }
        }
    }
    block_argmax(best, idx, bv, bi);
    if (threadIdx.x == 0) out[blockIdx.x] = idx < vocab ? idx : imax;
}

// Guided decoding: a row whose mask index is not negative keeps only the tokens its mask allows (bit
// t % 32 of word t / 32), the others become -inf before the token choice. One block per row.
extern "C" __global__ void mask_rows(float* __restrict__ logits, int vocab, const u32* __restrict__ bits, int words,
                                     const int* __restrict__ row_mask) {
    const int m = row_mask[blockIdx.x];
    if (m < 0) return;
    float* row = logits + (u64)blockIdx.x * vocab;
    const u32* w = bits + (u64)m * words;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        if (!((w[i >> 5] >> (i & 31)) & 1u)) row[i] = NEG_INF;
    }
}

// ---------------------------------------------------------------------------------------------------
// Attention. Sequences are described by small device arrays filled by the host planner:
//   seq_qrow  first row of the sequence's new tokens in the batch
//   seq_nq    number of new tokens
//   seq_pos   tokens already cached before them (the first new token's position)
//   seq_bt    offset of the sequence's block table in bt
// q rows live in the qkv buffer (row stride qkv_width); out is [tokens][n_heads * HEAD_DIM].

__device__ __forceinline__ const kv_t* kv_row(const kv_t* cache, const int* bt, int key, int plane, int n_kv,
                                              int kvh) {
    u64 blk = (u64)bt[key / KV_BLOCK];
    return cache + ((blk * 2 + plane) * n_kv + kvh) * (u64)KV_BLOCK * HEAD_DIM + (u64)(key % KV_BLOCK) * HEAD_DIM;
}

// Reference attention: one warp per (token, head), keys one at a time with an online softmax. Slow;
// kept as the check the fast kernels are compared against on the device (--cuda-attention simple).
extern "C" __global__ void attn_simple(const bf16* __restrict__ qkv, int qkv_width, const int* __restrict__ seq_qrow,
                                       const int* __restrict__ seq_nq, const int* __restrict__ seq_pos,
                                       const int* __restrict__ seq_bt, const int* __restrict__ bt,
                                       const kv_t* __restrict__ cache, bf16* __restrict__ out, int n_heads,
                                       int n_kv, float scale, int window) {
    const int s = blockIdx.y;
    const int qi = blockIdx.x;
    const int h = threadIdx.y + blockDim.y * blockIdx.z;
    if (qi >= seq_nq[s] || h >= n_heads) return;
    const int lane = threadIdx.x;
    const int row = seq_qrow[s] + qi;
    const int kvh = h / GQA;
    const int* tbl = bt + seq_bt[s];
    const int last = seq_pos[s] + qi;
    const bf16* q = qkv + (u64)row * qkv_width + h * HEAD_DIM;
    const int PER = HEAD_DIM / 32 > 0 ? HEAD_DIM / 32 : 1;
    float qv[HEAD_DIM / 16 + 1], acc[HEAD_DIM / 16 + 1];
    for (int j = 0; j < PER; j++) {
        int d = lane + 32 * j;
        qv[j] = d < HEAD_DIM ? bf2f(q[d]) : 0.f;
        acc[j] = 0.f;
    }
    float m = NEG_INF, l = 0.f;
    for (int key = window > 0 ? max(0, last - window + 1) : 0; key <= last; key++) {
        const kv_t* k = kv_row(cache, tbl, key, 0, n_kv, kvh);
        float dot = 0.f;
        for (int j = 0; j < PER; j++) {
            int d = lane + 32 * j;
            if (d < HEAD_DIM) dot += qv[j] * kv_f(k[d]);
        }
        dot = warp_sum(dot) * scale;
        float mn = fmaxf(m, dot);
        float a = __expf(m - mn), p = __expf(dot - mn);
        l = l * a + p;
        const kv_t* v = kv_row(cache, tbl, key, 1, n_kv, kvh);
        for (int j = 0; j < PER; j++) {
            int d = lane + 32 * j;
            acc[j] = acc[j] * a + (d < HEAD_DIM ? p * kv_f(v[d]) : 0.f);
        }
        m = mn;
    }
    bf16* o = out + (u64)row * n_heads * HEAD_DIM + h * HEAD_DIM;
    for (int j = 0; j < PER; j++) {
        int d = lane + 32 * j;
        if (d < HEAD_DIM) o[d] = f2bf(acc[j] / l);
    }
}

// ---- Prefill: flash-attention style, tensor cores (mma.sync m16n8k16 bf16, fp32 accumulate). ----
// Block = 4 warps = 128 query rows of one sequence and one head; each warp owns 32 rows (two 16-row
// m-tiles, so that every K and V fragment read from shared memory feeds two MMAs: with one m-tile the
// kernel was bound by shared-memory bandwidth). The Q tile sits in shared memory; key/value tiles of
// 64 keys are copied from the paged cache into shared memory by cp.async, two stages deep (the next
// tile loads while this one is used); ldmatrix feeds Q, K, and V through its transposing form, to the
// tensor cores. Scores stay in registers and the online softmax rescales the output accumulators per
// tile. Causal: query i of the chunk sees keys 0..pos+i. Dynamic shared memory: PF_SMEM_BYTES.

#define PF_MT 2                  // 16-row m-tiles per warp
#define PF_ROWS (4 * 16 * PF_MT)  // query rows per block (4 warps)
#define PF_KEYS 64
#define K_PITCH (HEAD_DIM + 8)
#define PF_STAGE (2 * PF_KEYS * K_PITCH)  // bf16 elements of one stage: K tile, then V tile
#define PF_SMEM_BYTES ((2 * PF_STAGE + PF_ROWS * K_PITCH) * 2)

__device__ __forceinline__ void mma_bf16(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// 16 bytes global -> shared (a shared-space address) without passing through registers;
// zero-filled when !valid.
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}

// One thread's 8 KV elements (16 bytes of bf16, 8 of FP8 codes) global -> shared, zero-filled when
// !valid.
__device__ __forceinline__ void cp_async_kv(u32 dst, const kv_t* src, bool valid) {
#if KV_FP8
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 8 : 0));
#else
    cp_async16(dst, src, valid);
#endif
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Waits until at most one committed group is still in flight.
__device__ __forceinline__ void cp_async_wait1() { asm volatile("cp.async.wait_group 1;\n" ::); }

// Waits until every committed group has landed.
__device__ __forceinline__ void cp_async_wait0() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

// ldmatrix from shared-space addresses: callers add compile-time offsets to a per-lane base, which
// the instruction takes as an immediate (no address arithmetic in the inner loops).
__device__ __forceinline__ void ldsm_x4(u32& r0, u32& r1, u32& r2, u32& r3, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

__device__ __forceinline__ void ldsm_x4_t(u32& r0, u32& r1, u32& r2, u32& r3, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

__device__ __forceinline__ void st_shared16(u32 addr, const uint4& v) {
    asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};\n" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w));
}

// Queues the copy of keys k0..k0+PF_KEYS (K and V rows, row-major, bf16) into one stage; keys at or
// past n_keys are zero. Thread t copies 8-element chunk t % CH of keys t / CH + (128 / CH) * u: one
// block-table lookup per key serves its K and its V row. A bf16 cache is copied by cp.async (the
// next tile lands while this one is used); FP8 codes are loaded (all of the thread's first, so they
// are in flight together), widened to bf16 and stored, before the caller's barrier.
__device__ __forceinline__ void pf_load_tile(u32 stage, const kv_t* cache, const int* tbl, int k0, int n_keys,
                                             int n_kv, int kvh) {
    constexpr int CH = HEAD_DIM / 8;  // 8-element chunks per row
    constexpr int KS = 128 / CH;      // keys per pass of the block
    const int c = (threadIdx.x % CH) * 8;
    const u64 plane = (u64)n_kv * KV_BLOCK * HEAD_DIM;  // K plane to V plane of a block
#if KV_FP8
    kv8_t raw[PF_KEYS / KS][2];
#pragma unroll
    for (int u = 0; u < PF_KEYS / KS; u++) {
        const int key = k0 + threadIdx.x / CH + KS * u;
        raw[u][0] = raw[u][1] = kv8_t{};
        if (key < n_keys) {
            const kv_t* kr = kv_row(cache, tbl, key, 0, n_kv, kvh) + c;
            raw[u][0] = kv8_load(kr);
            raw[u][1] = kv8_load(kr + plane);
        }
    }
#pragma unroll
    for (int u = 0; u < PF_KEYS / KS; u++) {
        const int j = threadIdx.x / CH + KS * u;
        st_shared16(stage + 2 * (j * K_PITCH + c), kv_bf16x8(raw[u][0]));
        st_shared16(stage + 2 * ((PF_KEYS + j) * K_PITCH + c), kv_bf16x8(raw[u][1]));
    }
#else
#pragma unroll
    for (int u = 0; u < PF_KEYS / KS; u++) {
        const int j = threadIdx.x / CH + KS * u;
        const int key = k0 + j;
        const bool ok = key < n_keys;
        const kv_t* kr = kv_row(cache, tbl, ok ? key : 0, 0, n_kv, kvh) + c;  // any valid address when !ok
        cp_async16(stage + 2 * (j * K_PITCH + c), kr, ok);
        cp_async16(stage + 2 * ((PF_KEYS + j) * K_PITCH + c), kr + plane, ok);
    }
#endif
}

// One K/V tile of attn_prefill for one warp's 32 query rows: S = Q K^T, the online softmax (MASK:
// the tile crosses the warp's causal diagonal), O += P V. `qa_base`, `k_base`, `v_base` are this
// lane's ldmatrix addresses for the first fragment; every other fragment is a compile-time offset.
template <bool MASK>
__device__ __forceinline__ void pf_tile(float (&o)[PF_MT][HEAD_DIM / 8][4], float (&m_r)[PF_MT][2],
                                        float (&l_r)[PF_MT][2], u32 qa_base, u32 k_base, u32 v_base, int k0,
                                        int row_g, int pos, int nq, int tq, float scale_log2, int window) {
    // S = Q K^T for this warp's 32 rows x 64 keys: per k-step, A of both m-tiles from the Q tile and
    // B of two key blocks per ldmatrix.x4, each B used by both m-tiles.
    float sc[PF_MT][PF_KEYS / 8][4];
#pragma unroll
    for (int mt = 0; mt < PF_MT; mt++)
#pragma unroll
        for (int nt = 0; nt < PF_KEYS / 8; nt++) sc[mt][nt][0] = sc[mt][nt][1] = sc[mt][nt][2] = sc[mt][nt][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; kk++) {
        u32 qa[PF_MT][4];
#pragma unroll
        for (int mt = 0; mt < PF_MT; mt++)
            ldsm_x4(qa[mt][0], qa[mt][1], qa[mt][2], qa[mt][3], qa_base + 2 * (mt * 16 * K_PITCH + kk * 16));
#pragma unroll
        for (int nt = 0; nt < PF_KEYS / 8; nt += 2) {
            u32 b0, b1, b2, b3;
            ldsm_x4(b0, b1, b2, b3, k_base + 2 * (nt * 8 * K_PITCH + kk * 16));
#pragma unroll
            for (int mt = 0; mt < PF_MT; mt++) {
                mma_bf16(sc[mt][nt], qa[mt][0], qa[mt][1], qa[mt][2], qa[mt][3], b0, b1);
                mma_bf16(sc[mt][nt + 1], qa[mt][0], qa[mt][1], qa[mt][2], qa[mt][3], b2, b3);
            }
        }
    }
    // Online softmax over raw scores with the scale folded into the exponent (exp2(s * scale -
    // m * scale), one FMA per score); P = exp2(...) rounded to bf16 for the P V product (as flash
    // attention does).
    u32 pa[PF_MT][PF_KEYS / 16][4];
#pragma unroll
    for (int mt = 0; mt < PF_MT; mt++) {
        float tm[2] = {NEG_INF, NEG_INF};
#pragma unroll
        for (int nt = 0; nt < PF_KEYS / 8; nt++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                if (MASK) {
                    const int key = k0 + nt * 8 + tq * 2 + (e & 1);
                    const int lim = pos + min(row_g + mt * 16 + (e >> 1) * 8, nq - 1);
                    if (key > lim || (window > 0 && key <= lim - window)) sc[mt][nt][e] = NEG_INF;
                }
                tm[e >> 1] = fmaxf(tm[e >> 1], sc[mt][nt][e]);
            }
        }
        float ref[2];
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            tm[hf] = fmaxf(tm[hf], __shfl_xor_sync(0xffffffffu, tm[hf], 1));
            tm[hf] = fmaxf(tm[hf], __shfl_xor_sync(0xffffffffu, tm[hf], 2));
            const float mn = fmaxf(m_r[mt][hf], tm[hf]);
            // A fully masked row so far keeps -inf; use 0 as the reference so exp2 gives 0, not NaN.
            ref[hf] = mn == NEG_INF ? 0.f : mn * scale_log2;
            const float a = fast_exp2(m_r[mt][hf] * scale_log2 - ref[hf]);
            m_r[mt][hf] = mn;
            l_r[mt][hf] *= a;
#pragma unroll
            for (int i = 0; i < HEAD_DIM / 8; i++) {
                o[mt][i][hf * 2] *= a;
                o[mt][i][hf * 2 + 1] *= a;
            }
        }
#pragma unroll
        for (int nt = 0; nt < PF_KEYS / 8; nt++) {
            const float p0 = fast_exp2(fmaf(sc[mt][nt][0], scale_log2, -ref[0]));
            const float p1 = fast_exp2(fmaf(sc[mt][nt][1], scale_log2, -ref[0]));
            const float p2 = fast_exp2(fmaf(sc[mt][nt][2], scale_log2, -ref[1]));
            const float p3 = fast_exp2(fmaf(sc[mt][nt][3], scale_log2, -ref[1]));
            l_r[mt][0] += p0 + p1;
            l_r[mt][1] += p2 + p3;
            const int kk = nt >> 1, hi = nt & 1;
            pa[mt][kk][hi * 2 + 0] = pack_bf2(p0, p1);
            pa[mt][kk][hi * 2 + 1] = pack_bf2(p2, p3);
        }
    }
    // O += P V: A = P (registers), B = V (64 keys x HEAD_DIM) through ldmatrix.trans, two 8-wide
    // column blocks per load, each used by both m-tiles.
#pragma unroll
    for (int dn = 0; dn < HEAD_DIM / 8; dn += 2) {
#pragma unroll
        for (int kk = 0; kk < PF_KEYS / 16; kk++) {
            u32 b0, b1, b2, b3;
            ldsm_x4_t(b0, b1, b2, b3, v_base + 2 * (kk * 16 * K_PITCH + dn * 8));
#pragma unroll
            for (int mt = 0; mt < PF_MT; mt++) {
                mma_bf16(o[mt][dn], pa[mt][kk][0], pa[mt][kk][1], pa[mt][kk][2], pa[mt][kk][3], b0, b1);
                mma_bf16(o[mt][dn + 1], pa[mt][kk][0], pa[mt][kk][1], pa[mt][kk][2], pa[mt][kk][3], b2, b3);
            }
        }
    }
}

// tile_seq[i], tile_q0[i]: the sequence and first chunk row of query tile i. grid = (tiles, n_heads);
// tiles run last-first, so the longest (latest) tiles of a sequence start first.
extern "C" __global__ void __launch_bounds__(128, 2) attn_prefill(
    const bf16* __restrict__ qkv, int qkv_width, const int* __restrict__ tile_seq,
    const int* __restrict__ tile_q0, const int* __restrict__ seq_qrow, const int* __restrict__ seq_nq,
    const int* __restrict__ seq_pos, const int* __restrict__ seq_bt, const int* __restrict__ bt,
    const kv_t* __restrict__ cache, bf16* __restrict__ out, int n_heads, int n_kv, float scale_log2, int window) {
    extern __shared__ uint4 pf_smem[];
    // Shared-space byte addresses: two K/V stages, then the PF_ROWS query rows (pitch K_PITCH).
    const u32 stages = smem_addr(pf_smem);
    const u32 qs = stages + 2 * (2 * PF_STAGE);
    const int tile = gridDim.x - 1 - blockIdx.x;
    const int s = tile_seq[tile];
    const int q0 = tile_q0[tile];
    const int h = blockIdx.y;
    const int kvh = h / GQA;
    const int nq = seq_nq[s], pos = seq_pos[s], qrow0 = seq_qrow[s];
    const int* tbl = bt + seq_bt[s];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, tq = lane & 3;
    const int mi = lane >> 3, r8 = lane & 7;  // ldmatrix: which 8x8 matrix this lane addresses, and its row
    const int tile_end = min(q0 + PF_ROWS, nq);
    const int n_keys = pos + tile_end;  // keys any row of this tile may see
    const int n_tiles = (n_keys + PF_KEYS - 1) / PF_KEYS;
    // This warp's rows: m-tile mt holds chunk rows q0 + warp * 32 + mt * 16 + {g, g + 8}. Rows past the
    // chunk see the last row's keys and are never written, which keeps their softmax finite.
    const int row_g = q0 + warp * 16 * PF_MT + g;  // chunk row of (m-tile 0, fragment row g)
    // Keys up to this one are visible to every row of the warp: tiles below it need no mask.
    const int warp_min_lim = pos + min(q0 + warp * 16 * PF_MT, nq - 1);
    // A window (0: none) hides keys at or below each row's limit - window: tiles wholly below the
    // block's first row's visible keys are skipped, and tiles reaching below the warp's last row's
    // first visible key are masked.
    const int warp_max_lo = window > 0 ? pos + min(q0 + warp * 16 * PF_MT + 16 * PF_MT - 1, nq - 1) - window + 1 : 0;
    const int it0 = window > 0 ? max(0, pos + q0 - window + 1) / PF_KEYS : 0;

    // Q rows of the tile (clamped to the chunk's last row) and the first K/V tile.
    {
        const int CH = HEAD_DIM / 8;
        for (int e = threadIdx.x; e < PF_ROWS * CH; e += blockDim.x) {
            const int j = e / CH, c = (e % CH) * 8;
            const bf16* src = qkv + (u64)(qrow0 + min(q0 + j, nq - 1)) * qkv_width + h * HEAD_DIM + c;
            cp_async16(qs + 2 * (j * K_PITCH + c), src, true);
        }
    }
    pf_load_tile(stages + (it0 & 1) * (2 * PF_STAGE), cache, tbl, it0 * PF_KEYS, n_keys, n_kv, kvh);
    cp_async_commit();

    float o[PF_MT][HEAD_DIM / 8][4];
#pragma unroll
    for (int mt = 0; mt < PF_MT; mt++)
#pragma unroll
        for (int i = 0; i < HEAD_DIM / 8; i++) o[mt][i][0] = o[mt][i][1] = o[mt][i][2] = o[mt][i][3] = 0.f;
    float m_r[PF_MT][2], l_r[PF_MT][2];
#pragma unroll
    for (int mt = 0; mt < PF_MT; mt++) m_r[mt][0] = m_r[mt][1] = NEG_INF, l_r[mt][0] = l_r[mt][1] = 0.f;
    // This lane's ldmatrix addresses of the first Q, K and V fragments (the K and V ones in stage 0).
    const u32 qa_base = qs + 2 * ((warp * 16 * PF_MT + (mi & 1) * 8 + r8) * K_PITCH + (mi >> 1) * 8);
    const u32 k_lane = 2 * (((mi >> 1) * 8 + r8) * K_PITCH + (mi & 1) * 8);
    const u32 v_lane = 2 * ((PF_KEYS + (mi & 1) * 8 + r8) * K_PITCH + (mi >> 1) * 8);

    for (int it = it0; it < n_tiles; it++) {
        const int k0 = it * PF_KEYS;
        if (it + 1 < n_tiles)
            pf_load_tile(stages + ((it + 1) & 1) * (2 * PF_STAGE), cache, tbl, k0 + PF_KEYS, n_keys, n_kv, kvh);
        cp_async_commit();
        cp_async_wait1();
        __syncthreads();
        const u32 st = stages + (it & 1) * (2 * PF_STAGE);
        if (k0 + PF_KEYS - 1 > warp_min_lim || k0 < warp_max_lo)
            pf_tile<true>(o, m_r, l_r, qa_base, st + k_lane, st + v_lane, k0, row_g, pos, nq, tq, scale_log2, window);
        else
            pf_tile<false>(o, m_r, l_r, qa_base, st + k_lane, st + v_lane, k0, row_g, pos, nq, tq, scale_log2, window);
        __syncthreads();
    }
    const int stride = n_heads * HEAD_DIM;
#pragma unroll
    for (int mt = 0; mt < PF_MT; mt++) {
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            float l = l_r[mt][hf];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            const int r = q0 + warp * 16 * PF_MT + mt * 16 + g + hf * 8;
            if (r < nq) {
                bf16* dst = out + (u64)(qrow0 + r) * stride + h * HEAD_DIM + tq * 2;
                const float inv = 1.f / l;
#pragma unroll
                for (int dn = 0; dn < HEAD_DIM / 8; dn++)
                    *(u32*)(dst + dn * 8) = pack_bf2(o[mt][dn][hf * 2] * inv, o[mt][dn][hf * 2 + 1] * inv);
            }
        }
    }
}

// ---- Decode: one new token per sequence, split over key partitions (flash-decoding), GQA-aware. ----
// Block = (sequence, kv head, partition of part_len keys), 128 threads. All GQA query heads of the kv
// head are scored together, so each K/V byte is read once per step. Partial results (max, sum,
// unnormalised output) go to part_*; the last partition block to finish combines them (no second
// launch). Two kernels: attn_decode_small for small batches, whose partitions (at most DS_KEYS keys)
// are short enough that every thread issues all its K and V loads at once (one memory round trip:
// at batch 1 the step is a chain of latencies, not a bandwidth problem), and attn_decode for large
// batches, whose blocks loop over partitions of up to DEC_PART keys (enough blocks hide latency).
#define DEC_THREADS 128
#define TPK (HEAD_DIM / 8)                // threads per key in the scoring pass (8-element loads)
#define KPI (DEC_THREADS / TPK)           // keys scored per iteration
#define VCH (HEAD_DIM / 8)                // 8-element chunks per V row
#define VLANES (DEC_THREADS / VCH)        // keys accumulated in parallel in the V pass
#define DS_KL (DS_KEYS / KPI)             // K chunks each thread of attn_decode_small holds
#define DS_VL (DS_KEYS / VLANES)          // V chunks each thread of attn_decode_small holds

// Scores one key (this thread's 8 dims of it) against the GQA query heads; the TPK threads of the
// key reduce with shuffles and the first stores the score.
template <int P>
__device__ __forceinline__ void score_key(const kv8_t& raw, const float (&qf)[GQA][8], float (*sc)[P], int j, int n,
                                          int t) {
    float kf[8];
    kv8_unpack(raw, kf);
#pragma unroll
    for (int g = 0; g < GQA; g++) {
        float d = 0.f;
#pragma unroll
        for (int e = 0; e < 8; e++) d += qf[g][e] * kf[e];
#pragma unroll
        for (int o = TPK / 2; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
        if (t % TPK == 0 && j < n) sc[g][j] = d;
    }
}

// This thread's 8 dims of every GQA query head of the kv head, pre-scaled into the log2 domain.
__device__ __forceinline__ void dec_load_q(const bf16* __restrict__ qkv, int qkv_width, int row, int kvh, int c,
                                           float scale_log2, float (&qf)[GQA][8]) {
    const bf16* qbase = qkv + (u64)row * qkv_width + (kvh * GQA) * HEAD_DIM + c;
#pragma unroll
    for (int g = 0; g < GQA; g++) {
        unpack8(*(const uint4*)(qbase + g * HEAD_DIM), qf[g]);
#pragma unroll
        for (int e = 0; e < 8; e++) qf[g][e] *= scale_log2;
    }
}

// Softmax statistics of the partition's n scores per GQA head (warp w handles heads w, w + 4, ...):
// sc becomes exp2(sc - max); the max and the sum go to part_m / part_l at head_idx(g) = first + g.
template <int P>
__device__ __forceinline__ void dec_softmax(float (*sc)[P], int n, u64 first, int max_parts, float* __restrict__ part_m,
                                            float* __restrict__ part_l) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int g = warp; g < GQA; g += DEC_THREADS / 32) {
        float m = NEG_INF;
        for (int j = lane; j < n; j += 32) m = fmaxf(m, sc[g][j]);
        m = warp_max(m);
        float l = 0.f;
        for (int j = lane; j < n; j += 32) {
            float p = exp2f(sc[g][j] - m);
            sc[g][j] = p;
            l += p;
        }
        l = warp_sum(l);
        if (lane == 0) {
            part_m[first + (u64)g * max_parts] = m;
            part_l[first + (u64)g * max_parts] = l;
        }
    }
}

// Sums the V-pass accumulators over the VLANES key lanes into part_o, then the last partition of
// this (sequence, kv head) to finish combines all partitions into the output rows of its GQA heads.
// done[] counts finished partitions and is reset by that last block, so it is zero again for the
// next launch. Every thread of the block must call it.
__device__ __forceinline__ void dec_finish(const float (&acc)[GQA][8], float (*red)[GQA][HEAD_DIM], int i, int kvh,
                                           int part, int parts, int n_heads, int n_kv, int max_parts,
                                           const int* __restrict__ dec_row, float* __restrict__ part_m,
                                           float* __restrict__ part_l, float* __restrict__ part_o,
                                           int* __restrict__ done, bf16* __restrict__ out) {
    const int t = threadIdx.x;
    const int c8 = (t % VCH) * 8, vl = t / VCH;
#pragma unroll
    for (int g = 0; g < GQA; g++)
#pragma unroll
        for (int e = 0; e < 8; e++) red[vl][g][c8 + e] = acc[g][e];
    __syncthreads();
    const u64 first = ((u64)i * n_heads + kvh * GQA) * max_parts;
    for (int e = t; e < GQA * HEAD_DIM; e += DEC_THREADS) {
        int g = e / HEAD_DIM, d = e % HEAD_DIM;
        float s = 0.f;
#pragma unroll
        for (int v = 0; v < VLANES; v++) s += red[v][g][d];
        part_o[(first + (u64)g * max_parts + part) * HEAD_DIM + d] = s;
    }
    __shared__ int is_last;
    __threadfence();
    __syncthreads();
    if (t == 0) {
        int* cnt = done + i * n_kv + kvh;
        is_last = atomicAdd(cnt, 1) == parts - 1;
        if (is_last) *cnt = 0;
    }
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    // Warp w combines heads w, w + 4, ...: lanes stride over partitions for the max and the sum;
    // then partitions go 32 at a time, each lane holding one partition's weight (shuffled to the
    // others), and every lane accumulating HEAD_DIM / 32 output dims with its loads unrolled so that
    // several partitions are in flight at once.
    const int warp = t >> 5, lane = t & 31;
    constexpr int DPL = (HEAD_DIM + 31) / 32;
    for (int g = warp; g < GQA; g += DEC_THREADS / 32) {
        const u64 base = first + (u64)g * max_parts;
        float m = NEG_INF;
        for (int p = lane; p < parts; p += 32) m = fmaxf(m, __ldcg(part_m + base + p));
        m = warp_max(m);
        float l = 0.f;
        for (int p = lane; p < parts; p += 32) l += exp2f(__ldcg(part_m + base + p) - m) * __ldcg(part_l + base + p);
        l = warp_sum(l);
        float o[DPL];
#pragma unroll
        for (int j = 0; j < DPL; j++) o[j] = 0.f;
        for (int p0 = 0; p0 < parts; p0 += 32) {
            const float wl = p0 + lane < parts ? exp2f(__ldcg(part_m + base + p0 + lane) - m) : 0.f;
            const int cnt = min(32, parts - p0);
#pragma unroll 8
            for (int q = 0; q < cnt; q++) {
                const float w = __shfl_sync(0xffffffffu, wl, q);
                const float* po = part_o + (base + p0 + q) * HEAD_DIM;
#pragma unroll
                for (int j = 0; j < DPL; j++) {
                    const int d = lane + 32 * j;
                    if (d < HEAD_DIM) o[j] += w * __ldcg(po + d);
                }
            }
        }
        const float inv = 1.f / l;
        bf16* dst = out + (u64)dec_row[i] * n_heads * HEAD_DIM + (kvh * GQA + g) * HEAD_DIM;
#pragma unroll
        for (int j = 0; j < DPL; j++) {
            const int d = lane + 32 * j;
            if (d < HEAD_DIM) dst[d] = f2bf(o[j] * inv);
        }
    }
}

// The small-batch decode attention: part_len <= DS_KEYS. Everything before pdl_wait reads only what
// the host uploaded for the step (context lengths, block tables), so with PDL it overlaps the QKV
// kernel; K, V and q are read after it (the QKV kernel writes this step's key, value and query).
// The partition's K and V rows are copied to shared memory by cp.async, all at once, so the block
// pays one memory latency; each thread copies exactly the 16-byte chunks it later reads (the
// scoring and V passes map threads to (key, chunk) the same way: TPK == VCH). The query rows come
// the same way, in the same round trip.
#define DS_BUF_BYTES (2 * DS_KEYS * HEAD_DIM * 2 > VLANES * GQA * HEAD_DIM * 4 ? 2 * DS_KEYS * HEAD_DIM * 2 \
                                                                               : VLANES * GQA * HEAD_DIM * 4)
extern "C" __global__ void __launch_bounds__(DEC_THREADS) attn_decode_small(
    const bf16* __restrict__ qkv, int qkv_width, const int* __restrict__ dec_row, const int* __restrict__ dec_ctx,
    const int* __restrict__ dec_bt, const int* __restrict__ bt, const kv_t* __restrict__ cache,
    float* __restrict__ part_m, float* __restrict__ part_l, float* __restrict__ part_o, int* __restrict__ done,
    bf16* __restrict__ out, int n_heads, int n_kv, int max_parts, int part_len, float scale_log2, int window) {
    __shared__ float sc[GQA][DS_KEYS];
    // K rows, then V rows (DS_KEYS x HEAD_DIM each); after the V pass, dec_finish's partial sums.
    __shared__ __align__(16) unsigned char buf[DS_BUF_BYTES];
    __shared__ __align__(16) bf16 qs[GQA * HEAD_DIM];
    const int i = blockIdx.x, kvh = blockIdx.y, part = blockIdx.z;
    // Partitions cover the visible keys lo..ctx: all of them, or the last `window` (0: none).
    const int lo = window > 0 ? max(0, dec_ctx[i] - window) : 0;
    const int ctx = dec_ctx[i] - lo;
    const int start = part * part_len;
    if (start >= ctx) {
        // Graph launches cover every partition the context limit allows; the unused ones only let
        // the next kernel launch.
        pdl_trigger();
        return;
    }
    const int n = min(ctx - start, part_len);
    const int* tbl = bt + dec_bt[i];
    const bf16* qrow = qkv + (u64)dec_row[i] * qkv_width + kvh * GQA * HEAD_DIM;
    const int t = threadIdx.x;
    const int c = (t % TPK) * 8, kk = t / TPK;  // this thread's chunk and first key (TPK == VCH)
    // Row addresses of this thread's keys (block-table lookups), before the wait. Keys past the
    // partition copy nothing (zero fill) from key 0 of it (any valid address).
    const kv_t* kp[DS_KL];
#pragma unroll
    for (int u = 0; u < DS_KL; u++) {
        const int j = kk + KPI * u;
        kp[u] = kv_row(cache, tbl, lo + start + (j < n ? j : 0), 0, n_kv, kvh) + c;
    }
    const u64 plane = (u64)n_kv * KV_BLOCK * HEAD_DIM;  // K plane to V plane of a block
    const u32 ks = smem_addr(buf), vs = ks + DS_KEYS * HEAD_DIM * KV_BYTES;
    pdl_wait();
    pdl_trigger();
#pragma unroll
    for (int u = 0; u < DS_KL; u++) {
        const int j = kk + KPI * u;
        cp_async_kv(ks + KV_BYTES * (j * HEAD_DIM + c), kp[u], j < n);
        cp_async_kv(vs + KV_BYTES * (j * HEAD_DIM + c), kp[u] + plane, j < n);
    }
    // The GQA query rows too (every thread needs its chunk of each: a barrier follows).
    if (t < GQA * TPK)
        cp_async16(smem_addr(qs) + 2 * t * 8, qrow + t * 8, true);
    cp_async_commit();
    cp_async_wait0();
    __syncthreads();
    float qf[GQA][8];
#pragma unroll
    for (int g = 0; g < GQA; g++) {
        unpack8(*(const uint4*)(qs + g * HEAD_DIM + c), qf[g]);
#pragma unroll
        for (int e = 0; e < 8; e++) qf[g][e] *= scale_log2;
    }
    const kv_t* kbuf = (const kv_t*)buf;
    const kv_t* vbuf = kbuf + DS_KEYS * HEAD_DIM;
#pragma unroll
    for (int u = 0; u < DS_KL; u++) {
        const int j = kk + KPI * u;
        score_key<DS_KEYS>(kv8_load(kbuf + j * HEAD_DIM + c), qf, sc, j, n, t);
    }
    __syncthreads();
    const u64 first = ((u64)i * n_heads + kvh * GQA) * max_parts + part;
    dec_softmax<DS_KEYS>(sc, n, first, max_parts, part_m, part_l);
    __syncthreads();
    float acc[GQA][8];
#pragma unroll
    for (int g = 0; g < GQA; g++)
#pragma unroll
        for (int e = 0; e < 8; e++) acc[g][e] = 0.f;
#pragma unroll
    for (int u = 0; u < DS_VL; u++) {
        const int j = kk + VLANES * u;
        if (j < n) {
            float vf[8];
            kv8_unpack(kv8_load(vbuf + j * HEAD_DIM + c), vf);
#pragma unroll
            for (int g = 0; g < GQA; g++) {
                const float p = sc[g][j];
#pragma unroll
                for (int e = 0; e < 8; e++) acc[g][e] += p * vf[e];
            }
        }
    }
    __syncthreads();  // buf becomes dec_finish's partial sums
    dec_finish(acc, (float(*)[GQA][HEAD_DIM])buf, i, kvh, part, (ctx + part_len - 1) / part_len, n_heads, n_kv,
               max_parts, dec_row, part_m, part_l, part_o, done, out);
}

// The large-batch decode attention: block (i, kvh, z) takes partitions z, z + gridDim.z, ... of up
// to part_len (<= DEC_PART) keys of sequence i's context. An eager launch has a z for every partition
// the batch's longest context needs (one each); a captured graph, which must fit any later context up
// to the limit, has a fixed z and its blocks loop, so a step's cost follows its real context.
extern "C" __global__ void __launch_bounds__(DEC_THREADS) attn_decode(
    const bf16* __restrict__ qkv, int qkv_width, const int* __restrict__ dec_row, const int* __restrict__ dec_ctx,
    const int* __restrict__ dec_bt, const int* __restrict__ bt, const kv_t* __restrict__ cache,
    float* __restrict__ part_m, float* __restrict__ part_l, float* __restrict__ part_o, int* __restrict__ done,
    bf16* __restrict__ out, int n_heads, int n_kv, int max_parts, int part_len, float scale_log2, int window) {
    __shared__ float sc[GQA][DEC_PART];
    __shared__ float red[VLANES][GQA][HEAD_DIM];
    pdl_wait();
    pdl_trigger();
    const int i = blockIdx.x, kvh = blockIdx.y;
    // Partitions cover the visible keys lo..ctx: all of them, or the last `window` (0: none).
    const int lo = window > 0 ? max(0, dec_ctx[i] - window) : 0;
    const int ctx = dec_ctx[i] - lo;
    if ((int)blockIdx.z * part_len >= ctx) return;
    const int parts = (ctx + part_len - 1) / part_len;
    const int* tbl = bt + dec_bt[i];
    const int t = threadIdx.x;
    // Scoring: thread t covers dims (t % TPK) * 8 .. +8 of key (t / TPK) + KPI * iteration.
    const int c = (t % TPK) * 8, kk = t / TPK;
    float qf[GQA][8];
    dec_load_q(qkv, qkv_width, dec_row[i], kvh, c, scale_log2, qf);
    // The loop bound is block-uniform (ctx is the block's sequence's), so every barrier is reached.
    for (int part = blockIdx.z; part < parts; part += gridDim.z) {
        const int start = lo + part * part_len;
        const int n = min(ctx, part * part_len + part_len) - part * part_len;
        // Two keys per thread per iteration keep two 16-byte loads in flight. The loop bound is
        // block-uniform so that every lane reaches the shuffles; lanes past the end score a zero key
        // and do not store.
        for (int j0 = 0; j0 < n; j0 += 2 * KPI) {
            const int ja = j0 + kk, jb = ja + KPI;
            kv8_t ra{}, rb{};
            if (ja < n) ra = kv8_load(kv_row(cache, tbl, start + ja, 0, n_kv, kvh) + c);
            if (jb < n) rb = kv8_load(kv_row(cache, tbl, start + jb, 0, n_kv, kvh) + c);
            score_key<DEC_PART>(ra, qf, sc, ja, n, t);
            score_key<DEC_PART>(rb, qf, sc, jb, n, t);
        }
        __syncthreads();
        const u64 first = ((u64)i * n_heads + kvh * GQA) * max_parts + part;
        dec_softmax<DEC_PART>(sc, n, first, max_parts, part_m, part_l);
        __syncthreads();
        // V pass: thread t accumulates dims (t % VCH) * 8 .. +8 over keys (t / VCH) + VLANES * iteration.
        const int c8 = (t % VCH) * 8, vl = t / VCH;
        float acc[GQA][8];
#pragma unroll
        for (int g = 0; g < GQA; g++)
#pragma unroll
            for (int e = 0; e < 8; e++) acc[g][e] = 0.f;
        for (int j = vl; j < n; j += VLANES) {
            float vf[8];
            kv8_unpack(kv8_load(kv_row(cache, tbl, start + j, 1, n_kv, kvh) + c8), vf);
#pragma unroll
            for (int g = 0; g < GQA; g++) {
                float p = sc[g][j];
#pragma unroll
                for (int e = 0; e < 8; e++) acc[g][e] += p * vf[e];
            }
        }
        dec_finish(acc, red, i, kvh, part, parts, n_heads, n_kv, max_parts, dec_row, part_m, part_l, part_o, done,
                   out);
        __syncthreads();  // sc and red are rewritten by the next partition
    }
}

// ---- Small-batch GEMV: y[m][n] = sum_k x[m][k] w[n][k] for M <= 8 rows (decode). ----
// Decode streams every weight once per step, so this is where a step's time goes. A work item is a
// pair of weight rows and one of `ks` slices of K (split-K, for projections too short to put enough
// loads in flight); one warp streams its slice of both rows with 16-byte loads that skip L1, loading
// the next GV_U chunks of each row while the current ones are used. The ks warps of a pair sit in
// one block and add their partial sums in shared memory. A block takes group blockIdx.x of
// GV_WARPS items, then every gridDim.x-th group after it (`groups` in all): with a grid of one
// block per group each block does one; with a grid sized to what the GPU holds at once
// (persistent), a block's warps stream group after group, loading the next item's first chunks
// while they finish the current one, and the RMSNorm prologue runs once per block. The M
// activation rows come from L1 or, in the kernels with the prologue, from shared memory. Epilogues
// fuse the elementwise work that follows each projection of a step (residual add, SiLU·mul, bias +
// RoPE + the K/V write), so a decode layer is five launches.
// Two inner loops: `gv_pair` on the FP32 lanes (bf16 and FP8 weights: a warp's item is one row
// pair, a lane decodes a chunk of each row once and does the FMAs of every activation row), and for
// the packed GGUF formats with GV_MMA `gv_octet` on the tensor cores (a warp's item is 8 row pairs,
// a chunk of 16 rows against all 8 activation columns is two MMAs a half-chunk, whatever M is).
// A 4-bit chunk is 4x a bf16 chunk's values, so on the FP32 lanes each activation row cost 4x a
// bf16 row's loads, conversions and adds per weight byte (measured: 8 rows 4.2x a row's time on an
// H100); on the tensor cores the per-chunk work is fixed and the activations are read once per
// 16 weight rows.
#define GV_WARPS 8

extern __shared__ uint4 gv_smem[];

__device__ __forceinline__ uint4 ld_stream(const bf16* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}
__device__ __forceinline__ float2 ld_stream2(const float* p) {
    float2 v;
    asm("ld.global.nc.L1::no_allocate.v2.f32 {%0,%1}, [%2];" : "=f"(v.x), "=f"(v.y) : "l"(p));
    return v;
}

// A warp's work item: row pair `pair`, K slice `slice` = [kb, ke). ks divides GV_WARPS.
struct GvItem {
    int pair, slice, kb, ke;
};

// The item of warp `wib` of block-group `group` (slices start at multiples of the format's V).
template <class WT>
__device__ __forceinline__ GvItem gv_item(int group, int K, int ks) {
    GvItem it;
    const int w = group * GV_WARPS + (threadIdx.x >> 5);
    it.pair = w / ks;
    it.slice = w % ks;
    const int len = ((K + ks - 1) / ks + WT::V - 1) & ~(WT::V - 1);
    it.kb = min(K, it.slice * len);
    it.ke = min(K, it.kb + len);
    return it;
}

// One of the two factors that undo `unpack16_e4m3`'s 2^-120: 2^60.
#define FP8_UNSCALE 1152921504606846976.f

// The weight formats of the GEMV kernels. A 16-byte chunk holds V values; a lane takes one chunk
// of each of its rows per unrolled step, so a warp covers 32 * V values of K. VPT values share one
// element of T (two 4-bit codes a byte). WFp8: FP8 E4M3 codes with one fp32 scale per row and 128
// columns (`sc`, `kb` scales a row), the layout `quant_fp8` writes; a chunk never straddles a group
// (V divides 128). WQ4 / WQ8: GGUF weights packed at load (the crate's `packed` module): codes and
// one (scale, min) float pair per chunk, element = scale * code + min (`kb` = 2 * chunks a row).
// Each format decodes a chunk into V floats (`unpack`) and, unless PLAIN, gives the chunk's scale
// g and min h (`group`); a row's dot product over the chunk is then g * (sum f x) * POST + h * sum x.
struct WBf16 {
    typedef bf16 T;
    static constexpr int V = 8, VPT = 1;
    static constexpr bool PLAIN = true, MIN = false, MMA = false;
    static constexpr float POST = 1.f;
    const float* sc;
    int kb;
    static __device__ __forceinline__ void unpack(const uint4& c, float* f) { unpack8(c, f); }
    static __device__ __forceinline__ void group(const float*, int, float&, float&) {}
};
struct WFp8 {
    typedef unsigned char T;
    static constexpr int V = 16, VPT = 1;
    static constexpr bool PLAIN = false, MIN = false, MMA = false;
    static constexpr float POST = FP8_UNSCALE;
    const float* sc;
    int kb;
    static __device__ __forceinline__ void unpack(const uint4& c, float* f);
    static __device__ __forceinline__ void group(const float* s, int k, float& g, float&) {
        g = s[k >> 7] * POST;
    }
};
// WQ4 = WPacked<4>: 32 unsigned 4-bit codes a chunk, byte j holding element j (low nibble) and
// element j + 16 (high). WQ8 = WPacked<8>: 16 signed 8-bit codes a chunk. With GV_MMA the GEMVs
// take them through `gv_octet` (tensor cores, `frag`), else through `gv_pair` (`unpack`, `group`).
template <int BITS>
struct WPacked {
    typedef unsigned char T;
    static constexpr int V = 128 / BITS, VPT = 8 / BITS;
    static constexpr bool PLAIN = false, MIN = true, MMA = GV_MMA;
    static constexpr float POST = 1.f;
    const float* sc;
    int kb;
    static __device__ __forceinline__ void unpack(const uint4& c, float* f);
    static __device__ __forceinline__ void group(const float* s, int k, float& g, float& h) {
        const float2 p = *(const float2*)(s + 2 * (k / V));
        g = p.x;
        h = p.y;
    }
    static __device__ __forceinline__ void frag(u32 w, int half, u32& a01, u32& a23);
};
typedef WPacked<4> WQ4;
typedef WPacked<8> WQ8;

// Row r of a matrix of K values a row in format WT.
template <class WT>
__device__ __forceinline__ const typename WT::T* gv_row(const typename WT::T* w, int r, int K) {
    return w + (u64)r * K / WT::VPT;
}

// Sixteen E4M3 codes as floats times 2^-120, with integer ops only (no conversion instructions,
// whose pipe is a quarter of the integer one's: it bounded the FP8 GEMVs). A code's sign and 7
// exponent/mantissa bits placed at a float's sign and at bits 26..20 are that float exactly, scaled
// by 2^-120 (its 4 exponent bits are the low ones of the float's, biased by 127 instead of 7); the
// subnormal codes become float denormals, which the kernels keep (no flush to zero). Two codes a
// step: one byte permute puts them at bits 31..24 and 15..8, a shift and a mask move their 7 bits
// down by 4 (the upper code is then its float, the lower one a bf16, widened by a shift). The caller
// scales by 2^120, in two factors of 2^60 (`FP8_UNSCALE`) so that no product overflows.
__device__ __forceinline__ void unpack16_e4m3(const uint4& v, float* f) {
    const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
#pragma unroll
        for (int j = 0; j < 2; j++) {
            const u32 y = __byte_perm(w[i], 0, j ? 0x3424 : 0x1404);
            const u32 z = ((y >> 4) & 0x07f007f0u) | (y & 0x80008000u);
            f[i * 4 + j * 2] = __uint_as_float(z << 16);
            f[i * 4 + j * 2 + 1] = __uint_as_float(z & 0xffff0000u);
        }
    }
}


__device__ __forceinline__ void WFp8::unpack(const uint4& c, float* f) { unpack16_e4m3(c, f); }

// Small unsigned integers as floats without conversion instructions: a byte b placed in the low
// mantissa bits of 2^23 is the float 2^23 + b exactly (one byte permute and one subtraction).
#define MAGIC_2_23 8388608.f
__device__ __forceinline__ float byte_as_float(u32 w, int j) {
    return __uint_as_float(__byte_perm(w, 0x4b000000u, 0x7540 | j)) - MAGIC_2_23;
}

// A chunk's codes as V floats. 4-bit: word i's low nibbles are elements 4i..4i+3, its high ones
// 16 + 4i..; 8-bit: flipping each byte's sign bit makes it code + 128, unsigned.
template <int BITS>
__device__ __forceinline__ void WPacked<BITS>::unpack(const uint4& c, float* f) {
    const u32 w[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        if constexpr (BITS == 4) {
            const u32 lo = w[i] & 0x0f0f0f0fu, hi = (w[i] >> 4) & 0x0f0f0f0fu;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                f[4 * i + j] = byte_as_float(lo, j);
                f[16 + 4 * i + j] = byte_as_float(hi, j);
            }
        } else {
#pragma unroll
            for (int j = 0; j < 4; j++) {
                f[4 * i + j] = __uint_as_float(__byte_perm(w[i] ^ 0x80808080u, 0x4b000000u, 0x7540 | j)) -
                               (MAGIC_2_23 + 128.f);
            }
        }
    }
}

// Codes as bf16 pairs for the tensor cores, exactly (every code is a small integer), with integer
// ops and one bf16x2 FMA a pair: a byte b placed under the bf16 exponent byte 0x43 is 128 + b for b <
// 128. 4-bit: the nibbles (half 0: low, 1: high) minus 128. 8-bit: the low 7 bits, 128 + (c & 0x7f),
// minus 128 + (c & 0x80) (its sign bit placed the same way: 128 or 256), i.e. c. a01 holds the word's
// codes 0 and 1 of the half, a23 codes 2 and 3 (low half first).
__device__ __forceinline__ u32 bf2_sub(u32 a, u32 b) {
    u32 d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(b), "r"(0xbf80bf80u), "r"(a));  // a - b
    return d;
}
template <int BITS>
__device__ __forceinline__ void WPacked<BITS>::frag(u32 w, int half, u32& a01, u32& a23) {
    u32 v, s;
    if constexpr (BITS == 4) {
        v = (half ? w >> 4 : w) & 0x0f0f0f0fu;
        s = 0u;
    } else {
        v = w & 0x7f7f7f7fu;
        s = w & 0x80808080u;
    }
    a01 = bf2_sub(__byte_perm(v, 0x43434343u, 0x4140), __byte_perm(s, 0x43434343u, 0x4140));
    a23 = bf2_sub(__byte_perm(v, 0x43434343u, 0x4342), __byte_perm(s, 0x43434343u, 0x4342));
}

// Elements of K a warp covers per unrolled step: a chunk per lane (gv_pair), or 4 chunks of each of
// 16 rows (gv_octet: lane t of each quad takes chunk t).
template <class WT>
__device__ __forceinline__ constexpr int gv_step() {
    return (WT::MMA ? 4 : 32) * WT::V;
}
// The offset in K of this lane's chunk within a step.
template <class WT>
__device__ __forceinline__ int gv_lane_k() {
    return (WT::MMA ? threadIdx.x & 3 : threadIdx.x & 31) * WT::V;
}

// A lane's loads of one unrolled step: chunk k0 + u * gv_step (u < GV_U) of rows w0 and w1 (zero at
// or past ke), and in the tensor-core path the chunks' (scale, min) pairs (s0, s1: the rows' pairs).
template <class WT>
struct GvBuf {
    uint4 c0[GV_U], c1[GV_U];
    float2 p0[GV_U], p1[GV_U];
};
template <class WT>
__device__ __forceinline__ void gv_load(GvBuf<WT>& b, const typename WT::T* w0, const typename WT::T* w1,
                                        const float* s0, const float* s1, int k0, int ke) {
#pragma unroll
    for (int u = 0; u < GV_U; u++) {
        int k = k0 + u * gv_step<WT>();
        b.c0[u] = k < ke ? ld_stream((const bf16*)(w0 + k / WT::VPT)) : make_uint4(0, 0, 0, 0);
        b.c1[u] = k < ke ? ld_stream((const bf16*)(w1 + k / WT::VPT)) : make_uint4(0, 0, 0, 0);
        if constexpr (WT::MMA) {
            b.p0[u] = k < ke ? ld_stream2(s0 + 2 * (k / WT::V)) : make_float2(0.f, 0.f);
            b.p1[u] = k < ke ? ld_stream2(s1 + 2 * (k / WT::V)) : make_float2(0.f, 0.f);
        }
    }
}

// The next item a warp streams after the current one: its two rows (and their scales) and K slice
// (empty when none).
template <class WT>
struct GvNext {
    const typename WT::T* w0;
    const typename WT::T* w1;
    const float* s0;
    const float* s1;
    int kb, ke;
};

// Shared-memory activation rows are K + GV_XPAD values apart: with 16 values (32 bytes) of padding
// the tensor-core path's 8-byte reads of 8 rows (one per quad) hit distinct banks.
#define GV_XPAD 16

// The RMSNorm prologue: xs[m] = RMSNorm(res[m]) * nw into shared memory (rows K + GV_XPAD apart),
// rounded as add_rmsnorm rounds. Every thread of the block must call it.
template <int M>
__device__ __forceinline__ void gv_norm(const bf16* __restrict__ res, const bf16* __restrict__ nw, float eps, int K) {
    __shared__ float red[32];
    bf16* xs = (bf16*)gv_smem;
    float inv[M];
#pragma unroll
    for (int m = 0; m < M; m++) {
        float ss = 0.f;
        for (int k = threadIdx.x * 8; k < K; k += blockDim.x * 8) {
            float f[8];
            unpack8(*(const uint4*)(res + (u64)m * K + k), f);
#pragma unroll
            for (int e = 0; e < 8; e++) ss += f[e] * f[e];
        }
        inv[m] = rsqrtf(block_sum(ss, red) / (float)K + eps);
    }
#pragma unroll
    for (int m = 0; m < M; m++) {
        for (int k = threadIdx.x * 8; k < K; k += blockDim.x * 8) {
            float f[8], g[8];
            unpack8(*(const uint4*)(res + (u64)m * K + k), f);
            unpack8(*(const uint4*)(nw + k), g);
            uint4 o;
            o.x = pack_bf2(round_bf(f[0] * inv[m]) * g[0], round_bf(f[1] * inv[m]) * g[1]);
            o.y = pack_bf2(round_bf(f[2] * inv[m]) * g[2], round_bf(f[3] * inv[m]) * g[3]);
            o.z = pack_bf2(round_bf(f[4] * inv[m]) * g[4], round_bf(f[5] * inv[m]) * g[5]);
            o.w = pack_bf2(round_bf(f[6] * inv[m]) * g[6], round_bf(f[7] * inv[m]) * g[7]);
            *(uint4*)(xs + m * (K + GV_XPAD) + k) = o;
        }
    }
    __syncthreads();
}

// The FP32-lane path (bf16, FP8, and the packed formats without GV_MMA): a warp's item is one row
// pair. a0[m], a1[m] = dot(x[m], w0), dot(x[m], w1) over the item's K slice (x's rows xs values
// apart), summed over the warp and then over the ks warps of the pair: the result is valid in the
// slice-0 warp (every lane). Per chunk a lane unpacks its two rows' V codes to floats once, then
// for each of the M rows loads V activations (V / 8 16-byte loads, from L1 or shared memory),
// widens them to floats and does 2V FMAs (and, with a per-chunk min, V adds for the chunk's
// activation sum): the activation work grows with M, and for 4-bit codes it is 4x a bf16 row's per
// weight byte. b holds the item's first chunks on entry (loaded before any prologue, so that they
// are in flight while it runs) and the next item's first chunks on return: they are loaded in the
// last step, so the warp keeps loads in flight through its reductions and epilogue. Scaled formats
// read their group scales (s0, s1: the rows' scales) chunk by chunk. Every thread of the block must
// call it (it has barriers when ks > 1); the trip count is warp-uniform.
template <int M, bool SMEM_X, class WT>
__device__ __forceinline__ void gv_pair(const bf16* __restrict__ x, int xs, const typename WT::T* __restrict__ w0,
                                        const typename WT::T* __restrict__ w1, const float* s0, const float* s1,
                                        const GvItem& it, int ks, const GvNext<WT>& nx, GvBuf<WT>& b,
                                        float (&a0)[M], float (&a1)[M]) {
    constexpr int V = WT::V, STEP = 32 * V;
    uint4(&c0)[GV_U] = b.c0;
    uint4(&c1)[GV_U] = b.c1;
    __shared__ float part[GV_WARPS][2][M];
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int m = 0; m < M; m++) a0[m] = a1[m] = 0.f;
    for (int kw = it.kb; kw < it.ke; kw += STEP * GV_U) {
        GvBuf<WT> n;
        if (kw + STEP * GV_U < it.ke) gv_load<WT>(n, w0, w1, s0, s1, kw + STEP * GV_U + lane * V, it.ke);
        else gv_load<WT>(n, nx.w0, nx.w1, nx.s0, nx.s1, nx.kb + lane * V, nx.ke);
#pragma unroll
        for (int u = 0; u < GV_U; u++) {
            const int k = kw + lane * V + u * STEP;
            if (k < it.ke) {
                float f0[V], f1[V], g0 = 1.f, g1 = 1.f, h0 = 0.f, h1 = 0.f;
                WT::unpack(c0[u], f0);
                WT::unpack(c1[u], f1);
                WT::group(s0, k, g0, h0);
                WT::group(s1, k, g1, h1);
#pragma unroll
                for (int m = 0; m < M; m++) {
                    float xf[V];
#pragma unroll
                    for (int h = 0; h < V / 8; h++) {
                        if (SMEM_X) unpack8(*(const uint4*)(x + m * xs + k + 8 * h), xf + 8 * h);
                        else unpack8(__ldg((const uint4*)(x + (u64)m * xs + k + 8 * h)), xf + 8 * h);
                    }
                    if constexpr (WT::PLAIN) {
#pragma unroll
                        for (int e = 0; e < V; e++) {
                            a0[m] += f0[e] * xf[e];
                            a1[m] += f1[e] * xf[e];
                        }
                    } else {
                        float d0 = 0.f, d1 = 0.f;
#pragma unroll
                        for (int e = 0; e < V; e++) {
                            d0 += f0[e] * xf[e];
                            d1 += f1[e] * xf[e];
                        }
                        a0[m] += g0 * (d0 * WT::POST);
                        a1[m] += g1 * (d1 * WT::POST);
                        if constexpr (WT::MIN) {
                            float sx = 0.f;
#pragma unroll
                            for (int e = 0; e < V; e++) sx += xf[e];
                            a0[m] += h0 * sx;
                            a1[m] += h1 * sx;
                        }
                    }
                }
            }
        }
        b = n;
    }
    if (it.kb >= it.ke) gv_load<WT>(b, nx.w0, nx.w1, nx.s0, nx.s1, nx.kb + lane * V, nx.ke);  // an empty slice
#pragma unroll
    for (int m = 0; m < M; m++) {
        a0[m] = warp_sum(a0[m]);
        a1[m] = warp_sum(a1[m]);
    }
    if (ks > 1) {
        const int wb = threadIdx.x >> 5;
#pragma unroll
        for (int m = 0; m < M; m++) {
            if (lane == m) {
                part[wb][0][m] = a0[m];
                part[wb][1][m] = a1[m];
            }
        }
        __syncthreads();
        if (it.slice == 0) {
            for (int s = 1; s < ks; s++) {
#pragma unroll
                for (int m = 0; m < M; m++) {
                    a0[m] += part[wb + s][0][m];
                    a1[m] += part[wb + s][1][m];
                }
            }
        }
        __syncthreads();  // part is rewritten by the block's next group
    }
}

// A 4 x 4 transpose of 4-byte words across a quad (4 lanes): lane t holds chunk t of the quad's 4
// in v (its words 0..3) and gets y[j] = word t of chunk j. Two rounds of exchanges: 2 x 2 blocks
// with lane t ^ 2, then within them with lane t ^ 1 (2 shuffles and 6 selects a round).
__device__ __forceinline__ void quad_transpose(const uint4& v, u32 (&y)[4]) {
    const int t = threadIdx.x & 3;
    const bool b1 = t & 2, b0 = t & 1;
    u32 s0 = b1 ? v.x : v.z, s1 = b1 ? v.y : v.w;
    const u32 r0 = __shfl_xor_sync(~0u, s0, 2), r1 = __shfl_xor_sync(~0u, s1, 2);
    const u32 z0 = b1 ? r0 : v.x, z1 = b1 ? r1 : v.y, z2 = b1 ? v.z : r0, z3 = b1 ? v.w : r1;
    s0 = b0 ? z0 : z1;
    s1 = b0 ? z2 : z3;
    const u32 q0 = __shfl_xor_sync(~0u, s0, 1), q1 = __shfl_xor_sync(~0u, s1, 1);
    y[0] = b0 ? q0 : z0;
    y[1] = b0 ? z1 : q0;
    y[2] = b0 ? q1 : z2;
    y[3] = b0 ? z3 : q1;
}

// The tensor-core path of the packed formats (GV_MMA): a warp's item is 8 row pairs, and a chunk's
// dot products for all 16 rows and all M activation rows are MMAs (m16n8k16, bf16 in, fp32 out):
// the weight rows are the MMA's 16 rows (pair i's rows r0, r1 are rows i and i + 8), the
// activation rows its 8 columns (rows past M are zero). Lane (g, t) = (lane / 4, lane % 4) loads
// chunk t of each step's 4 from its pair g's rows r0 and r1, with the chunks' (scale, min) pairs;
// a quad transpose then gives it word t of each of the 4 chunks. Inside an MMA the order of K is
// free as long as both operands share it, so a lane's k slots 2t, 2t + 1, 2t + 8, 2t + 9 take the
// word's 4 codes of one half (4-bit: the low nibbles, elements 4t..4t+3, then the high ones,
// 16 + 4t..; 8-bit: one half, 4t..4t+3), and its activation operand is the 4 consecutive bf16
// values of row g at those elements: one 8-byte load, from L1 or shared memory, shared by all 16
// weight rows. Codes become bf16 exactly (`frag`), products are exact and sums are fp32, so a
// chunk's D = sum code * x, and one more MMA with all-ones weights gives sum x; then per chunk
// acc += scale * D + min * sum x, the same affine decode as gv_pair. Per chunk a lane does 2 word
// exchanges, 4 shuffles for the chunk's (scale, min) pairs, the code conversions (2 bf16x2 FMAs and
// 4 byte permutes per word and half), 1 8-byte activation load and 2 MMAs per half, and 8 FMAs;
// nothing grows with M (M = 1 pays for 8 columns). acc[0..1] are pair g's row r0 for activation
// rows 2t, 2t + 1, acc[2..3] its row r1; valid after the split-K sum in the slice-0 warp. Loads in
// flight and barriers as gv_pair.
template <int M, bool SMEM_X, class WT>
__device__ __forceinline__ void gv_octet(const bf16* __restrict__ x, int xs, const typename WT::T* __restrict__ w0,
                                         const typename WT::T* __restrict__ w1, const float* s0, const float* s1,
                                         const GvItem& it, int ks, const GvNext<WT>& nx, GvBuf<WT>& b,
                                         float (&acc)[4]) {
    constexpr int V = WT::V, STEP = gv_step<WT>(), HALVES = V / 16;
    constexpr u32 ONES = 0x3f803f80u;  // bf16 1.0, 1.0
    __shared__ float part[GV_WARPS][4][32];
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const bf16* xr = x + (u64)min(g, M - 1) * xs + 4 * t;
#pragma unroll
    for (int e = 0; e < 4; e++) acc[e] = 0.f;
    for (int kw = it.kb; kw < it.ke; kw += STEP * GV_U) {
        GvBuf<WT> n;
        if (kw + STEP * GV_U < it.ke) gv_load<WT>(n, w0, w1, s0, s1, kw + STEP * GV_U + t * V, it.ke);
        else gv_load<WT>(n, nx.w0, nx.w1, nx.s0, nx.s1, nx.kb + t * V, nx.ke);
#pragma unroll
        for (int u = 0; u < GV_U; u++) {
            const int kc = kw + u * STEP;
            if (kc < it.ke) {  // warp-uniform, as every condition around a shuffle or an MMA here
                u32 q0[4], q1[4];
                quad_transpose(b.c0[u], q0);
                quad_transpose(b.c1[u], q1);
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    const int k = kc + j * V;
                    if (k < it.ke) {
                        const int src = (lane & ~3) | j;
                        const float g0 = __shfl_sync(~0u, b.p0[u].x, src), h0 = __shfl_sync(~0u, b.p0[u].y, src);
                        const float g1 = __shfl_sync(~0u, b.p1[u].x, src), h1 = __shfl_sync(~0u, b.p1[u].y, src);
                        float d[4] = {0.f, 0.f, 0.f, 0.f}, sx[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                        for (int h = 0; h < HALVES; h++) {
                            uint2 xv = make_uint2(0u, 0u);
                            if (g < M) {
                                if constexpr (SMEM_X) xv = *(const uint2*)(xr + k + 16 * h);
                                else xv = __ldg((const uint2*)(xr + k + 16 * h));
                            }
                            u32 a01, a23, b01, b23;
                            WT::frag(q0[j], h, a01, a23);
                            WT::frag(q1[j], h, b01, b23);
                            mma_bf16(d, a01, b01, a23, b23, xv.x, xv.y);
                            mma_bf16(sx, ONES, ONES, ONES, ONES, xv.x, xv.y);
                        }
                        acc[0] += g0 * d[0];
                        acc[0] += h0 * sx[0];
                        acc[1] += g0 * d[1];
                        acc[1] += h0 * sx[1];
                        acc[2] += g1 * d[2];
                        acc[2] += h1 * sx[0];
                        acc[3] += g1 * d[3];
                        acc[3] += h1 * sx[1];
                    }
                }
            }
        }
        b = n;
    }
    if (it.kb >= it.ke) gv_load<WT>(b, nx.w0, nx.w1, nx.s0, nx.s1, nx.kb + t * V, nx.ke);  // an empty slice
    if (ks > 1) {
        const int wb = threadIdx.x >> 5;
#pragma unroll
        for (int e = 0; e < 4; e++) part[wb][e][lane] = acc[e];
        __syncthreads();
        if (it.slice == 0) {
            for (int s = 1; s < ks; s++) {
#pragma unroll
                for (int e = 0; e < 4; e++) acc[e] += part[wb + s][e][lane];
            }
        }
        __syncthreads();  // part is rewritten by the block's next group
    }
}

// The item a lane's rows and epilogue see: the warp's item, or in the tensor-core path its pair
// 8 * item + lane / 4.
template <class WT>
__device__ __forceinline__ GvItem gv_lane_item(GvItem it) {
    if constexpr (WT::MMA) it.pair = it.pair * 8 + ((threadIdx.x & 31) >> 2);
    return it;
}

// Whether this lane's epilogue writes activation row m: lane m (gv_pair's sums are in every lane),
// or in the tensor-core path the lanes whose t holds row m (rows 2t and 2t + 1).
template <class WT>
__device__ __forceinline__ bool gv_owns(int m) {
    return WT::MMA ? (int)(threadIdx.x & 3) == (m >> 1) : (int)(threadIdx.x & 31) == m;
}

// Streams the block's groups: rows(it, r0, r1) maps an item (gv_lane_item's) to its two weight rows
// (clamped into the matrix), xof(it) to its M activation rows (the tensor-core path, whose warp
// takes 8 items' rows at once, needs them shared by the warp's items: the dense projections),
// epi(it, r0, r1, a0, a1) consumes the sums (in the slice-0 warp; row m where gv_owns(m)). The
// prologue, if any, runs between the first loads and the first item. `wf` is the weights' format
// (and a scaled matrix's scales). Activation rows in shared memory (SMEM_X) are K + GV_XPAD apart.
template <int M, bool SMEM_X, class WT, class Rows, class XOf, class Prologue, class Epi>
__device__ __forceinline__ void gv_run_x(const typename WT::T* __restrict__ w, WT wf, int K, int ks, int groups,
                                         Rows rows, XOf xof, Prologue prologue, Epi epi) {
    const int xs = SMEM_X ? K + GV_XPAD : K;
    auto scales = [&](int r) -> const float* { return wf.sc ? wf.sc + (u64)r * wf.kb : nullptr; };
    int g = blockIdx.x;
    GvItem it = gv_item<WT>(g, K, ks);
    int r0, r1;
    rows(gv_lane_item<WT>(it), r0, r1);
    GvBuf<WT> b;
    gv_load<WT>(b, gv_row<WT>(w, r0, K), gv_row<WT>(w, r1, K), scales(r0), scales(r1), it.kb + gv_lane_k<WT>(),
                it.ke);
    pdl_wait();
    pdl_trigger();
    prologue();
    while (true) {
        const int gn = g + gridDim.x;
        const GvItem ni = gv_item<WT>(gn, K, ks);
        int n0, n1;
        rows(gv_lane_item<WT>(ni), n0, n1);
        const GvNext<WT> nx{gv_row<WT>(w, n0, K), gv_row<WT>(w, n1, K), scales(n0), scales(n1), ni.kb,
                            gn < groups ? ni.ke : ni.kb};
        float a0[M], a1[M];
        if constexpr (WT::MMA) {
            float acc[4];
            gv_octet<M, SMEM_X, WT>(xof(it), xs, gv_row<WT>(w, r0, K), gv_row<WT>(w, r1, K), scales(r0),
                                    scales(r1), it, ks, nx, b, acc);
#pragma unroll
            for (int m = 0; m < M; m++) {
                a0[m] = acc[m & 1];
                a1[m] = acc[2 + (m & 1)];
            }
        } else {
            gv_pair<M, SMEM_X, WT>(xof(it), xs, gv_row<WT>(w, r0, K), gv_row<WT>(w, r1, K), scales(r0), scales(r1),
                                   it, ks, nx, b, a0, a1);
        }
        if (it.slice == 0) epi(gv_lane_item<WT>(it), r0, r1, a0, a1);
        if (gn >= groups) break;
        g = gn;
        it = ni;
        r0 = n0;
        r1 = n1;
    }
}

// gv_run_x with the same activation rows x for every item (the dense projections).
template <int M, bool SMEM_X, class WT, class Rows, class Prologue, class Epi>
__device__ __forceinline__ void gv_run(const bf16* __restrict__ x, const typename WT::T* __restrict__ w, WT wf, int K,
                                       int ks, int groups, Rows rows, Prologue prologue, Epi epi) {
    gv_run_x<M, SMEM_X, WT>(
        w, wf, K, ks, groups, rows, [x](const GvItem&) { return x; }, prologue, epi);
}

// The rows of item p of the plain and residual-add GEMVs: 2p and 2p + 1, clamped into the N rows.
struct GvAdjacentRows {
    int N;
    __device__ __forceinline__ void operator()(const GvItem& it, int& r0, int& r1) const {
        r0 = min(2 * it.pair, N - 1);
        r1 = min(r0 + 1, N - 1);
    }
};

// Plain GEMV: rows 2p and 2p + 1 of y (bf16, or fp32 for logits).
template <int M, class WT>
__device__ __forceinline__ void gemv_body(const bf16* __restrict__ x, const typename WT::T* __restrict__ w, WT wf,
                                          void* __restrict__ y, int N, int K, int f32_out, int ks, int groups) {
    gv_run<M, false, WT>(
        x, w, wf, K, ks, groups,
        GvAdjacentRows{N}, [] {},
        [&](const GvItem& it, int r0, int r1, float (&a0)[M], float (&a1)[M]) {
            if (2 * it.pair >= N) return;
#pragma unroll
            for (int m = 0; m < M; m++) {
                if (gv_owns<WT>(m)) {
                    if (f32_out) {
                        ((float*)y)[(u64)m * N + r0] = a0[m];
                        if (r1 != r0) ((float*)y)[(u64)m * N + r1] = a1[m];
                    } else {
                        ((bf16*)y)[(u64)m * N + r0] = f2bf(a0[m]);
                        if (r1 != r0) ((bf16*)y)[(u64)m * N + r1] = f2bf(a1[m]);
                    }
                }
            }
        });
}

// res[m][n] += y[m][n] (y rounded to bf16 first, as a bf16 model adds): the output projection and
// the down projection add straight into the residual stream.
template <int M, class WT>
__device__ __forceinline__ void gemv_add_body(const bf16* __restrict__ x, const typename WT::T* __restrict__ w, WT wf,
                                              bf16* __restrict__ res, int N, int K, int ks, int groups) {
    gv_run<M, false, WT>(
        x, w, wf, K, ks, groups,
        GvAdjacentRows{N}, [] {},
        [&](const GvItem& it, int r0, int r1, float (&a0)[M], float (&a1)[M]) {
            if (2 * it.pair >= N) return;
#pragma unroll
            for (int m = 0; m < M; m++) {
                if (gv_owns<WT>(m)) {
                    bf16* r = res + (u64)m * N;
                    r[r0] = f2bf(bf2f(r[r0]) + round_bf(a0[m]));
                    if (r1 != r0) r[r1] = f2bf(bf2f(r[r1]) + round_bf(a1[m]));
                }
            }
        });
}

// act[m][j] = silu(gate) * up with gate = row j and up = row ffn + j of [gate; up], over
// RMSNorm(res) * nw: the FFN's norm, gate/up projection and activation in one pass. Dynamic shared
// memory M * K * 2 bytes.
template <int M, class WT>
__device__ __forceinline__ void gemv_silu_body(const bf16* __restrict__ res, const bf16* __restrict__ nw, float eps,
                                               const typename WT::T* __restrict__ w, WT wf, bf16* __restrict__ act,
                                               int ffn, int K, int ks, int groups) {
    gv_run<M, true, WT>(
        (const bf16*)gv_smem, w, wf, K, ks, groups,
        [&](const GvItem& it, int& r0, int& r1) {
            r0 = min(it.pair, ffn - 1);
            r1 = ffn + r0;
        },
        [&] { gv_norm<M>(res, nw, eps, K); },
        [&](const GvItem& it, int, int, float (&a0)[M], float (&a1)[M]) {
            const int j = it.pair;
            if (j >= ffn) return;
#pragma unroll
            for (int m = 0; m < M; m++) {
                if (gv_owns<WT>(m)) {
                    float g = round_bf(a0[m]), u = round_bf(a1[m]);
                    act[(u64)m * ffn + j] = f2bf(round_bf(g / (1.f + __expf(-g))) * u);
                }
            }
        });
}

// The attention input of a layer in one pass: RMSNorm(res) * nw, the fused [q; k; v] projection,
// the optional bias, RoPE on q and k, q into its qkv row and k, v into the paged cache at slots[m].
// Pair p < (n_heads + n_kv) * HEAD_DIM / 2 is one rotated pair of a q or k head, the rest are two
// adjacent v rows. Rounding as rope_kv_write. Dynamic shared memory M * K * 2 bytes.
template <int M, class WT>
__device__ __forceinline__ void gemv_qkv_body(const bf16* __restrict__ res, const bf16* __restrict__ nw, float eps,
                                              const typename WT::T* __restrict__ w, WT wf,
                                              const bf16* __restrict__ bias,
                                              const int* __restrict__ positions, const int* __restrict__ slots,
                                              const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                                              kv_t* __restrict__ cache, bf16* __restrict__ qkv, int n_heads, int n_kv,
                                              int neox, int K, int ks, int groups) {
    const int half = HEAD_DIM / 2;
    const int pairs = (n_heads + n_kv) * half;
    const int total = pairs + n_kv * half;
    const int width = (n_heads + 2 * n_kv) * HEAD_DIM;
    gv_run<M, true, WT>(
        (const bf16*)gv_smem, w, wf, K, ks, groups,
        [&](const GvItem& it, int& r0, int& r1) {
            const int ww = min(it.pair, total - 1);
            if (ww < pairs) {
                const int head = ww / half, i = ww % half;
                r0 = head * HEAD_DIM + (neox ? i : 2 * i);
                r1 = head * HEAD_DIM + (neox ? i + half : 2 * i + 1);
            } else {
                r0 = (n_heads + n_kv) * HEAD_DIM + 2 * (ww - pairs);
                r1 = r0 + 1;
            }
        },
        [&] { gv_norm<M>(res, nw, eps, K); },
        [&](const GvItem& it, int r0, int r1, float (&a0)[M], float (&a1)[M]) {
            if (it.pair >= total) return;
            const int head = it.pair < pairs ? it.pair / half : -1, i = it.pair % half;
#pragma unroll
            for (int m = 0; m < M; m++) {
                if (gv_owns<WT>(m)) {
                    float x0 = round_bf(a0[m]), x1 = round_bf(a1[m]);
                    if (bias) {
                        x0 = round_bf(x0 + bf2f(bias[r0]));
                        x1 = round_bf(x1 + bf2f(bias[r1]));
                    }
                    const int slot = slots[m];
                    const u64 blk = slot / KV_BLOCK, off = slot % KV_BLOCK;
                    if (head >= 0) {
                        const int pos = positions[m];
                        float c = round_bf(cos_t[(u64)pos * half + i]), s = round_bf(sin_t[(u64)pos * half + i]);
                        bf16 y0 = f2bf(round_bf(x0 * c) - round_bf(x1 * s));
                        bf16 y1 = f2bf(round_bf(x1 * c) + round_bf(x0 * s));
                        if (head < n_heads) {
                            qkv[(u64)m * width + r0] = y0;
                            qkv[(u64)m * width + r1] = y1;
                        } else {
                            const int kh = head - n_heads;
                            kv_t* dst =
                                cache + ((blk * 2 + 0) * n_kv + kh) * (u64)KV_BLOCK * HEAD_DIM + off * HEAD_DIM;
                            dst[r0 - head * HEAD_DIM] = kv_of(bf2f(y0));
                            dst[r1 - head * HEAD_DIM] = kv_of(bf2f(y1));
                        }
                    } else {
                        const int e = r0 - (n_heads + n_kv) * HEAD_DIM;
                        const int kh = e / HEAD_DIM, d = e % HEAD_DIM;
                        kv_t* dst =
                            cache + ((blk * 2 + 1) * n_kv + kh) * (u64)KV_BLOCK * HEAD_DIM + off * HEAD_DIM + d;
                        dst[0] = kv_of(x0);
                        dst[1] = kv_of(x1);
                    }
                }
            }
        });
}

// One format's four GEMV kernels of MM rows: `gemv_<P>MM`, `gemv_add_<P>MM`, ... with P empty for
// bf16 weights, `f8_` for FP8 and `q4_` / `q8_` for packed GGUF weights (the same parameters:
// `scale` and `kb` are the format's per-row group parameters, unused for bf16).
#define GEMV_FMT(MM, P, WT) \
    extern "C" __global__ void __launch_bounds__(32 * GV_WARPS, GV_MINB) gemv_##P##MM( \
        const bf16* __restrict__ x, const void* __restrict__ w, const float* __restrict__ scale, int kb, \
        void* __restrict__ y, int N, int K, int f32_out, int ks, int groups) { \
        gemv_body<MM, WT>(x, (const WT::T*)w, WT{scale, kb}, y, N, K, f32_out, ks, groups); \
    } \
    extern "C" __global__ void __launch_bounds__(32 * GV_WARPS, GV_MINB) gemv_add_##P##MM( \
        const bf16* __restrict__ x, const void* __restrict__ w, const float* __restrict__ scale, int kb, \
        bf16* __restrict__ res, int N, int K, int ks, int groups) { \
        gemv_add_body<MM, WT>(x, (const WT::T*)w, WT{scale, kb}, res, N, K, ks, groups); \
    } \
    extern "C" __global__ void __launch_bounds__(32 * GV_WARPS, GV_MINB) gemv_silu_##P##MM( \
        const bf16* __restrict__ res, const bf16* __restrict__ nw, float eps, const void* __restrict__ w, \
        const float* __restrict__ scale, int kb, bf16* __restrict__ act, int ffn, int K, int ks, int groups) { \
        gemv_silu_body<MM, WT>(res, nw, eps, (const WT::T*)w, WT{scale, kb}, act, ffn, K, ks, groups); \
    } \
    extern "C" __global__ void __launch_bounds__(32 * GV_WARPS, GV_MINB) gemv_qkv_##P##MM( \
        const bf16* __restrict__ res, const bf16* __restrict__ nw, float eps, const void* __restrict__ w, \
        const float* __restrict__ scale, int kb, const bf16* __restrict__ bias, const int* __restrict__ positions, \
        const int* __restrict__ slots, const float* __restrict__ cos_t, const float* __restrict__ sin_t, \
        kv_t* __restrict__ cache, bf16* __restrict__ qkv, int n_heads, int n_kv, int neox, int K, int ks, \
        int groups) { \
        gemv_qkv_body<MM, WT>(res, nw, eps, (const WT::T*)w, WT{scale, kb}, bias, positions, slots, cos_t, sin_t, \
                              cache, qkv, n_heads, n_kv, neox, K, ks, groups); \
    }
// GV_FORMATS (bit 1 FP8, 2 packed 4-bit, 3 packed 8-bit) says which formats besides bf16 the model
// uses; the others are not compiled.
#if GV_FORMATS & 2
#define GEMV_F8(MM) GEMV_FMT(MM, f8_, WFp8)
#else
#define GEMV_F8(MM)
#endif
#if GV_FORMATS & 4
#define GEMV_Q4(MM) GEMV_FMT(MM, q4_, WQ4)
#else
#define GEMV_Q4(MM)
#endif
#if GV_FORMATS & 8
#define GEMV_Q8(MM) GEMV_FMT(MM, q8_, WQ8)
#else
#define GEMV_Q8(MM)
#endif
#define GEMV(MM) GEMV_FMT(MM, , WBf16) GEMV_F8(MM) GEMV_Q4(MM) GEMV_Q8(MM)
GEMV(1)
GEMV(2)
GEMV(3)
GEMV(4)
GEMV(5)
GEMV(6)
GEMV(7)
GEMV(8)

// ---- FP8 (E4M3) weights: quantization at load and the bf16 tiles of large-batch steps. ----

// Rows of a bf16 matrix x [M x K] as E4M3 codes with one fp32 scale per row and 128-value group of
// columns (its largest magnitude / 448, 1 when all zero): group g of row m at m * groups + g
// (`row_major` 0) or g * M + m (1). One warp per (row, group), four values a lane; every thread of
// the grid calls it.
__device__ __forceinline__ void quant_rows_fp8(const bf16* __restrict__ x, unsigned char* __restrict__ q,
                                               float* __restrict__ scale, int M, int K, int row_major) {
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    const int groups = (K + 127) / 128;
    if (warp >= M * groups) return;
    const int m = warp / groups, g = warp % groups;
    const int k0 = g * 128 + lane * 4;
    float v[4], amax = 0.f;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        v[i] = k0 + i < K ? bf2f(x[(u64)m * K + k0 + i]) : 0.f;
        amax = fmaxf(amax, fabsf(v[i]));
    }
    amax = warp_max(amax);
    const float s = amax > 0.f ? amax / 448.f : 1.f;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        if (k0 + i < K) q[(u64)m * K + k0 + i] = e4m3_of(v[i] / s);
    }
    if (lane == 0) scale[row_major ? (u64)g * M + m : (u64)m * groups + g] = s;
}

// Quantizes a projection matrix w [N x K] (bf16) at load: E4M3 codes with one fp32 scale per row
// and 128 columns, row by row (scale[n * kb + k / 128]), the layout the GEMVs and `dequant_fp8`
// read. Finer than 128 x 128 blocks: a row's outliers no longer coarsen its 127 neighbours' codes.
extern "C" __global__ void quant_fp8(const bf16* __restrict__ w, unsigned char* __restrict__ q,
                                     float* __restrict__ scale, int N, int K) {
    quant_rows_fp8(w, q, scale, N, K, 0);
}

// The activations x [M x K] (bf16) as E4M3 codes for the FP8 tensor-core GEMMs, with one scale per
// token and 128-value group; `row_major` 1 puts the tokens of one group next to each other (the
// outer-dimension-major order cuBLASLt's VEC128 scales take).
extern "C" __global__ void quant_act_fp8(const bf16* __restrict__ x, unsigned char* __restrict__ q,
                                         float* __restrict__ scale, int M, int K, int row_major) {
    quant_rows_fp8(x, q, scale, M, K, row_major);
}

// w[n][k] = bf16(code x scale) of an FP8 matrix (the bf16 tile steps of more rows than the GEMV
// kernels take hand to cuBLAS): 16 codes a thread, K a multiple of 16.
extern "C" __global__ void dequant_fp8(const unsigned char* __restrict__ q, const float* __restrict__ scale,
                                       bf16* __restrict__ w, int N, int K) {
    const int kb = (K + 127) / 128;
    const u64 chunks = (u64)N * (K / 16);
    for (u64 c = (u64)blockIdx.x * blockDim.x + threadIdx.x; c < chunks; c += (u64)gridDim.x * blockDim.x) {
        const u64 n = c / (K / 16), k = (c % (K / 16)) * 16;
        float f[16];
        unpack16_e4m3(*(const uint4*)(q + n * K + k), f);
        const float s = scale[n * kb + (k >> 7)] * FP8_UNSCALE;
        uint4 o[2];
        u32* ow = (u32*)o;
#pragma unroll
        for (int e = 0; e < 8; e++) {
            ow[e] = pack_bf2(f[2 * e] * FP8_UNSCALE * s, f[2 * e + 1] * FP8_UNSCALE * s);
        }
        *(uint4*)(w + n * K + k) = o[0];
        *(uint4*)(w + n * K + k + 8) = o[1];
    }
}

// w[n][k] = bf16(scale * code + min) of a packed GGUF matrix (WQ4 or WQ8: one (scale, min) pair per
// 16-byte chunk of codes, chunks row after row), for the cuBLAS steps. One thread a chunk.
template <class WT>
__device__ __forceinline__ void dequant_packed(const uint4* __restrict__ q, const float2* __restrict__ params,
                                               bf16* __restrict__ out, u64 chunks) {
    constexpr int V = WT::V;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < chunks; i += (u64)gridDim.x * blockDim.x) {
        float f[V];
        WT::unpack(q[i], f);
        const float2 p = params[i];
        uint4* o = (uint4*)(out + i * V);
#pragma unroll
        for (int c = 0; c < V / 8; c++) {
            uint4 v;
            v.x = pack_bf2(p.x * f[8 * c + 0] + p.y, p.x * f[8 * c + 1] + p.y);
            v.y = pack_bf2(p.x * f[8 * c + 2] + p.y, p.x * f[8 * c + 3] + p.y);
            v.z = pack_bf2(p.x * f[8 * c + 4] + p.y, p.x * f[8 * c + 5] + p.y);
            v.w = pack_bf2(p.x * f[8 * c + 6] + p.y, p.x * f[8 * c + 7] + p.y);
            o[c] = v;
        }
    }
}
extern "C" __global__ void dequant_q4(const uint4* __restrict__ q, const float2* __restrict__ params,
                                      bf16* __restrict__ out, u64 chunks) {
    dequant_packed<WQ4>(q, params, out, chunks);
}
extern "C" __global__ void dequant_q8(const uint4* __restrict__ q, const float2* __restrict__ params,
                                      bf16* __restrict__ out, u64 chunks) {
    dequant_packed<WQ8>(q, params, out, chunks);
}

// Bulk KV movement for P/D transfers: whole blocks of one layer between the paged cache and a
// contiguous buffer, one CUDA block per KV block, 16-byte accesses (a block is a multiple of 16
// bytes: KV_BLOCK * HEAD_DIM bf16 per head). `block_vecs` is the block's size in 16-byte words,
// `ids[i]` the cache block of buffer slot i; the layer's base is folded into `cache` by the host.
// One launch per layer keeps each layer's copy ordered before its own event, so the receiving side
// can take layer 0 while later layers are still being gathered.
extern "C" __global__ void kv_gather(const uint4* __restrict__ cache, const int* __restrict__ ids,
                                     uint4* __restrict__ out, u64 block_vecs) {
    const uint4* src = cache + (u64)ids[blockIdx.x] * block_vecs;
    uint4* dst = out + (u64)blockIdx.x * block_vecs;
    for (u64 i = threadIdx.x; i < block_vecs; i += blockDim.x) dst[i] = src[i];
}

// The inverse of kv_gather: buffer slot i overwrites cache block ids[i].
extern "C" __global__ void kv_scatter(uint4* __restrict__ cache, const int* __restrict__ ids,
                                      const uint4* __restrict__ in, u64 block_vecs) {
    uint4* dst = cache + (u64)ids[blockIdx.x] * block_vecs;
    const uint4* src = in + (u64)blockIdx.x * block_vecs;
    for (u64 i = threadIdx.x; i < block_vecs; i += blockDim.x) dst[i] = src[i];
}
