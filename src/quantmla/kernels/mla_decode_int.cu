// Absorbed-MLA decode over the paged integer cache, few heads (<= 16 per CTA), mma.sync with the integer
// codes turned straight into tensor-core operand registers. Launcher and contract: mla_decode_cuda.py.
//
// Compile-time config (-D): CB, RB (content / rope bits: 4 or 2), DC, DR (dims), RG (rope group).
// The content group is 64 channels. One CTA = (split, sequence, head block of 16), NWARPS warps, tiles of
// NT = 64 tokens (one block-table entry each: the page is a multiple of 64).
//
// Per tile:
//   scores  S[16 heads, 64 tokens]: the channel (K) dimension split over the NWARPS warps (warp w: content
//           channels [SLICE w, SLICE (w+1)); rope k16 step w mod (DR/16) for a share of the token n8-tiles).
//           B operands are the raw
//           codes as bf16 128 + code (lop3 into the mantissa of 128.0, exact); one mma chain per 64-channel
//           group, then S += scale * acc + (zero - 128 scale) * sum(q over the group)  (fp32, exact scale).
//           A dot product does not care how k is ordered, so the k slots of a fragment are assigned to
//           channels that make each thread's codes whole 32-bit words; q's A fragments use the same map.
//   softmax the warps' partial scores are summed through shared memory (each warp sums 64/NWARPS tokens), the
//           tile max per head is exchanged, P (bf16) goes to shared memory.
//   values  O[16, DC] += P c: the channel (N) dimension split over the warps (warp w: its SLICE channels).
//           B operands are again 128 + code (two tokens' bytes side by side by one prmt); the per-token,
//           per-group scale moves into A: P'_g = P * scale[., g]; then O -= 136 * sum_n P'_g (an mma with
//           a constant B) and O += sum_n P * (zero + 8 scale) (an mma with B = the centred zeros, hi + lo).
// Protected BF16 rows (sink + recent window) are read straight from global memory by one extra split per
// sequence (split index nsb), through the same fragment maps (scale 1, zero 0).
// Codes of body tiles are staged in shared memory by cp.async (STAGES deep); the scales and zeros of the next
// tile are loaded into registers one tile ahead and converted when stored to shared memory.
//
// Status (H200, benchmarks/results/decode_kernel_cuda.md): correct, but slower than the Triton kernel
// (INT4/INT4, 16 heads: 0.54-0.84x the bf16 kernel at >= 16K); latency- and instruction-bound (~160 warp
// instructions per cached token, a third of them address arithmetic of the staging loops). Opt-in.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#ifndef CB
#define CB 4
#endif
#ifndef RB
#define RB 4
#endif
#ifndef DC
#define DC 512
#endif
#ifndef DR
#define DR 64
#endif
#ifndef RG
#define RG 64
#endif

#ifndef NWARPS
#define NWARPS 4     // 4 or 8 (8: DC a multiple of 512)
#endif
#ifndef STAGES
#define STAGES 3     // shared-memory stages of codes (cp.async ring)
#endif
#define NT 64        // tokens per tile
#define NTHREADS (32 * NWARPS)

constexpr int CPW_C = 32 / CB;            // codes per 32-bit word
constexpr int CPW_R = 32 / RB;
constexpr int CROWB = DC * CB / 8;        // code bytes of one token
constexpr int RROWB = DR * RB / 8;
constexpr int CRS = CROWB + 16;           // shared-memory row strides: +16 B keeps the reads conflict-free
constexpr int RRS = RROWB + 16;
constexpr int SLICE = DC / NWARPS;        // content channels of one warp
constexpr int GPW = SLICE / 64;           // content groups of one warp
constexpr int NGC = DC / 64;              // content groups
constexpr int NGR = DR / RG;              // rope groups
constexpr int WPG = 64 / CPW_C;           // words per content group (int4 8, int2 4)
constexpr int NWC = WPG / 4;              // words per thread per group in the scores
constexpr int SPW_C = CPW_C / 4;          // k16 steps per word
constexpr int WR = DR / CPW_R;            // rope words per token
constexpr int NWR = WR / 4;
constexpr int SPW_R = CPW_R / 4;
constexpr int KSC = GPW * NWC * SPW_C;    // content k16 steps of one warp (= SLICE / 16)
constexpr int KSR = NWR * SPW_R;          // rope k16 steps (= DR / 16)
constexpr int TPW = NT / 8 / NWARPS;      // score n8 tiles each warp owns in the softmax
constexpr int RWG = NWARPS / KSR;         // warps sharing one rope k16 step (they split the token tiles)
constexpr int PS = NT + 8;                // row stride (elements) of the score / P / scale buffers
constexpr int SZS = NT + 4;               // row stride of the per-group scale buffers
constexpr uint32_t KMID = (0x4300u | (1u << (CB - 1))) * 0x00010001u;  // bf16x2 (128 + mid, 128 + mid)

static_assert(GPW >= 1 && SLICE % 64 == 0, "content: DC/NWARPS must be a multiple of the 64-channel group");
static_assert(TPW >= 1 && STAGES >= 2, "tile / warp layout");
static_assert(NWARPS % KSR == 0 && (NT / 8) % RWG == 0, "rope: DR / 16 must divide the warp count");
static_assert(NWR >= 1 && WR % 4 == 0, "rope: DR * RB must be a multiple of 128 bits");
static_assert(RG % (4 * CPW_R) == 0 && DR % RG == 0, "rope group: a multiple of 4 words' channels");
static_assert(KSC * 16 == SLICE && KSR * 16 == DR, "fragment map");

struct Smem {
  uint8_t cc[STAGES][NT * CRS];           // content codes, token rows
  uint8_t rc[STAGES][NT * RRS];           // rope codes
  float cs_f[2][NGC * SZS];               // scores: content scale, fp32 [group][token]
  float cz_f[2][NGC * SZS];               //         zero - 128 * scale
  float rs_f[2][NGR * SZS];               //         rope scale
  float rz_f[2][NGR * SZS];               //         rope zero - 128 * scale
  __nv_bfloat16 cs_b[2][NGC * SZS];       // values: content scale (bf16)
  __nv_bfloat16 czh[2][NGC * SZS];        //         centred zero z + mid * scale, hi part
  __nv_bfloat16 czl[2][NGC * SZS];        //         and lo part
  float red[NWARPS][16 * PS];             // per-warp partial scores
  __nv_bfloat16 p[16 * PS];               // P of the tile, [head][token]
  float mx[NWARPS][16];                   // per-warp tile max per head
  float lsum[NWARPS][16];
};

// sizeof(Smem), read by the launcher (the dynamic shared memory of a CTA).
extern "C" __device__ int kSmemBytes = sizeof(Smem);

// ---- small device helpers ------------------------------------------------------------------------------

__device__ __forceinline__ uint32_t lop3_and_or(uint32_t a, uint32_t mask, uint32_t magic) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(mask), "r"(magic));  // (a & mask) | magic
  return d;
}

// Codes at bits [sh, sh + bits) and [16 + sh, ...) of y -> bf16x2 (128 + lo code, 128 + hi code), exact.
template <int BITS>
__device__ __forceinline__ uint32_t codes2(uint32_t y, int sh) {
  constexpr uint32_t m = ((1u << BITS) - 1) * 0x00010001u;
  return lop3_and_or(y >> sh, m, 0x43004300u);
}

__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

__device__ __forceinline__ uint32_t bmul2(uint32_t a, uint32_t b) {
  __nv_bfloat162 r = __hmul2(*reinterpret_cast<__nv_bfloat162*>(&a), *reinterpret_cast<__nv_bfloat162*>(&b));
  return *reinterpret_cast<uint32_t*>(&r);
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_u32(dst)), "l"(src));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

__device__ __forceinline__ float ld_half(const __half* p) { return __half2float(__ldg(p)); }

__device__ __forceinline__ uint4 ld_u4(const void* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }

// Element e of a row of bf16 held in 32-bit words, as the low or high half selector of prmt.
__device__ __forceinline__ uint32_t pair_bf16(uint32_t a_word, uint32_t b_word, int e) {
  return __byte_perm(a_word, b_word, (e & 1) ? 0x7632 : 0x5410);
}

// ---- the fragment maps ---------------------------------------------------------------------------------
// Scores, content: k16 step ks = (gi, mm, sl) of warp w; thread t's word is wi = WPG*gi + t + 4*mm of the
// warp's slice (byte 4*wi of the slice); pair p of a word = (code p, code p + CPW/2); b01 = pair 2*sl
// (k = 2t, 2t+1), b23 = pair 2*sl + 1 (k = 2t+8, 2t+9).
__device__ __forceinline__ int qc_channel(int w, int ks, int t, int k_in_pair, int hi) {
  const int gi = ks / (NWC * SPW_C), mm = (ks / SPW_C) % NWC, sl = ks % SPW_C;
  const int wi = WPG * gi + t + 4 * mm;
  const int p = 2 * sl + hi;
  return w * SLICE + wi * CPW_C + p + k_in_pair * (CPW_C / 2);
}
// Scores, rope: step ks = (mm, sl); word t + 4*mm of the token's rope row.
__device__ __forceinline__ int qr_channel(int ks, int t, int k_in_pair, int hi) {
  const int mm = ks / SPW_R, sl = ks % SPW_R;
  const int wi = t + 4 * mm;
  return wi * CPW_R + 2 * sl + hi + k_in_pair * (CPW_R / 2);
}
// Values: tile j of warp group gi, column n (= lane's g) holds channel w*SLICE + 64*gi + 8*n + j.

template <bool V>
struct Tag { static constexpr bool value = V; };
using Body = Tag<false>;  // quantized pool tiles, codes staged in shared memory
using Prot = Tag<true>;   // protected bf16 rows, read from global memory

// ---- the kernel ----------------------------------------------------------------------------------------

extern "C" __global__ void __launch_bounds__(NTHREADS, 2) mla_decode_int(
    const void* __restrict__ qn_ptr, const void* __restrict__ qp_ptr, int q_f32,
    const uint8_t* __restrict__ cc_ptr, const __half* __restrict__ cs_ptr, const __half* __restrict__ cz_ptr,
    const uint8_t* __restrict__ rc_ptr, const __half* __restrict__ rs_ptr, const __half* __restrict__ rz_ptr,
    const __nv_bfloat16* __restrict__ pc_ptr, const __nv_bfloat16* __restrict__ pr_ptr,
    const int* __restrict__ bt_ptr, int bt_stride, const int* __restrict__ lens_ptr,
    const int* __restrict__ slots_ptr, float* __restrict__ po_ptr, float* __restrict__ plse_ptr,
    int H, int nsb, int nst, float qk_scale, long long c_row, long long c_sz_row, long long r_row,
    long long r_sz_row, int page, int sink, int window) {
  extern __shared__ __align__(16) uint8_t smem_raw[];
  Smem& sm = *reinterpret_cast<Smem*>(smem_raw);

  const int split = blockIdx.x, b = blockIdx.y, hb = blockIdx.z;
  const int tid = threadIdx.x, w = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int h0 = hb * 16;

  // Work: body tiles (positions [sink, q_hi), tiles of NT aligned to position 0) split over nsb splits;
  // split nsb (present when window > 0) takes the protected rows [0, min(L, window)).
  const int L = lens_ptr[b];
  const int n_q = max(L - window, 0);
  const int q_hi = sink + n_q;
  const int t_lo = sink / NT;
  const int nt_q = n_q > 0 ? (q_hi + NT - 1) / NT - t_lo : 0;
  const bool prot_split = split >= nsb;
  int tb, te;
  if (!prot_split) {
    const int per = (nt_q + nsb - 1) / nsb;
    tb = split * per;
    te = min(tb + per, nt_q);
  } else {
    tb = 0;
    te = (min(L, window) + NT - 1) / NT;
  }

  // q as A fragments (bf16), with the fragment maps above; sums of q over each group (fp32).
  // The rope is split by k16 step and token tile: warp w computes step RK = w % KSR of the rope scores for
  // the token n8-tiles j with j % RWG == w / KSR.
  const int RK = w % KSR, mm_r = RK / SPW_R, sl_r = RK % SPW_R, wi_r = t + 4 * mm_r;
  const int rg_r = (4 * mm_r * CPW_R) / RG;
  uint32_t qa_c[KSC][4], qa_r[4];
  float qsum_c[GPW][2], qsum_r[2] = {0.f, 0.f};
#pragma unroll
  for (int i = 0; i < GPW; ++i) qsum_c[i][0] = qsum_c[i][1] = 0.f;
  {
    auto ldq = [&](const void* base, int dim, int h, int ch) -> float {
      if (h0 + h >= H) return 0.f;
      const long long off = ((long long)b * H + h0 + h) * dim + ch;
      float v = q_f32 ? reinterpret_cast<const float*>(base)[off]
                      : __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(base)[off]);
      return __bfloat162float(__float2bfloat16_rn(v));  // the value the tensor cores see
    };
#pragma unroll
    for (int ks = 0; ks < KSC; ++ks) {
      const int gi = ks / (NWC * SPW_C);
#pragma unroll
      for (int r = 0; r < 4; ++r) {  // a0 (row g, k 2t..), a1 (row g+8), a2 (row g, k 2t+8..), a3 (row g+8)
        const int h = g + 8 * (r & 1), hi = r >> 1;
        const float x0 = ldq(qn_ptr, DC, h, qc_channel(w, ks, t, 0, hi));
        const float x1 = ldq(qn_ptr, DC, h, qc_channel(w, ks, t, 1, hi));
        qa_c[ks][r] = pack_bf16(x0, x1);
        qsum_c[gi][r & 1] += x0 + x1;
      }
    }
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int h = g + 8 * (r & 1), hi = r >> 1;
      const float x0 = ldq(qp_ptr, DR, h, qr_channel(RK, t, 0, hi));
      const float x1 = ldq(qp_ptr, DR, h, qr_channel(RK, t, 1, hi));
      qa_r[r] = pack_bf16(x0, x1);
      qsum_r[r & 1] += x0 + x1;
    }
    // Each group's channels are spread over the 4 lanes of a row: sum them.
#pragma unroll
    for (int i = 0; i < GPW; ++i)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        qsum_c[i][r] += __shfl_xor_sync(0xffffffffu, qsum_c[i][r], 1);
        qsum_c[i][r] += __shfl_xor_sync(0xffffffffu, qsum_c[i][r], 2);
      }
#pragma unroll
    for (int r = 0; r < 2; ++r) {  // the partial sum over this warp's rope k-step
      qsum_r[r] += __shfl_xor_sync(0xffffffffu, qsum_r[r], 1);
      qsum_r[r] += __shfl_xor_sync(0xffffffffu, qsum_r[r], 2);
    }
  }

  float o[GPW * 8][4], corr[GPW][4], zacc[4];
#pragma unroll
  for (int i = 0; i < GPW * 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
#pragma unroll
  for (int i = 0; i < GPW; ++i) corr[i][0] = corr[i][1] = corr[i][2] = corr[i][3] = 0.f;
  zacc[0] = zacc[1] = zacc[2] = zacc[3] = 0.f;
  float m_i[2] = {-INFINITY, -INFINITY}, l_i[2] = {0.f, 0.f};

  const int* bt_row = bt_ptr + (long long)b * bt_stride;
  auto tile_row0 = [&](int tt) -> long long {  // pool row of the tile's first position
    const int pos0 = (tt + t_lo) * NT;
    return (long long)bt_row[pos0 / page] * page + pos0 % page;
  };

  // One tile: scores, online softmax, values. vlo/vhi: valid tile-relative tokens.
  auto process = [&](auto prot_tag, const uint8_t* scc, const uint8_t* src, int szb,
                     const __nv_bfloat16* gpc, const __nv_bfloat16* gpr, int vlo, int vhi) {
    constexpr bool P = decltype(prot_tag)::value;
    // ---- scores: partial over this warp's channels
    float s[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
      const int tok = 8 * j + g;  // this lane's B column
      const bool tv = tok >= vlo && tok < vhi;
#pragma unroll
      for (int gi = 0; gi < GPW; ++gi) {
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int mm = 0; mm < NWC; ++mm) {
          const int wi = WPG * gi + t + 4 * mm;
          if constexpr (!P) {
            const uint32_t y = *reinterpret_cast<const uint32_t*>(scc + tok * CRS + w * (SLICE * CB / 8) + 4 * wi);
#pragma unroll
            for (int sl = 0; sl < SPW_C; ++sl) {
              const int ks = (gi * NWC + mm) * SPW_C + sl;
              mma(acc, qa_c[ks], codes2<CB>(y, CB * 2 * sl), codes2<CB>(y, CB * (2 * sl + 1)));
            }
          } else {
            uint32_t v[CPW_C / 2];  // CPW bf16 channels of the virtual word
#pragma unroll
            for (int q = 0; q < CPW_C / 8; ++q) {
              uint4 u = tv ? ld_u4(gpc + (long long)tok * DC + w * SLICE + wi * CPW_C + 8 * q) : make_uint4(0, 0, 0, 0);
              v[4 * q] = u.x; v[4 * q + 1] = u.y; v[4 * q + 2] = u.z; v[4 * q + 3] = u.w;
            }
#pragma unroll
            for (int sl = 0; sl < SPW_C; ++sl) {
              const int ks = (gi * NWC + mm) * SPW_C + sl;
              const int p0 = 2 * sl, p1 = 2 * sl + 1, hf = CPW_C / 2;
              mma(acc, qa_c[ks], __byte_perm(v[p0 / 2], v[(p0 + hf) / 2], (p0 & 1) ? 0x7632 : 0x5410),
                  __byte_perm(v[p1 / 2], v[(p1 + hf) / 2], (p1 & 1) ? 0x7632 : 0x5410));
            }
          }
        }
        if constexpr (!P) {
          const int G = w * GPW + gi;
          const float2 sc = *reinterpret_cast<const float2*>(&sm.cs_f[szb][G * SZS + 8 * j + 2 * t]);
          const float2 zc = *reinterpret_cast<const float2*>(&sm.cz_f[szb][G * SZS + 8 * j + 2 * t]);
          s[j][0] += sc.x * acc[0] + zc.x * qsum_c[gi][0];
          s[j][1] += sc.y * acc[1] + zc.y * qsum_c[gi][0];
          s[j][2] += sc.x * acc[2] + zc.x * qsum_c[gi][1];
          s[j][3] += sc.y * acc[3] + zc.y * qsum_c[gi][1];
        } else {
          s[j][0] += acc[0]; s[j][1] += acc[1]; s[j][2] += acc[2]; s[j][3] += acc[3];
        }
      }
      if (j % RWG == w / KSR) {  // the rope: this warp's k16 step RK for its share of the token tiles
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        if constexpr (!P) {
          const uint32_t y = *reinterpret_cast<const uint32_t*>(src + tok * RRS + 4 * wi_r);
          mma(acc, qa_r, codes2<RB>(y, RB * 2 * sl_r), codes2<RB>(y, RB * (2 * sl_r + 1)));
          const float2 sc = *reinterpret_cast<const float2*>(&sm.rs_f[szb][rg_r * SZS + 8 * j + 2 * t]);
          const float2 zc = *reinterpret_cast<const float2*>(&sm.rz_f[szb][rg_r * SZS + 8 * j + 2 * t]);
          s[j][0] += sc.x * acc[0] + zc.x * qsum_r[0];
          s[j][1] += sc.y * acc[1] + zc.y * qsum_r[0];
          s[j][2] += sc.x * acc[2] + zc.x * qsum_r[1];
          s[j][3] += sc.y * acc[3] + zc.y * qsum_r[1];
        } else {  // the same k slots from the bf16 row: channels wi_r * CPW + 2 sl + hi + kp * CPW / 2
          uint32_t b[2];
#pragma unroll
          for (int hi = 0; hi < 2; ++hi) {
            const int ch = wi_r * CPW_R + 2 * sl_r + hi;
            const unsigned short* rp = reinterpret_cast<const unsigned short*>(gpr + (long long)tok * DR);
            b[hi] = tv ? (uint32_t)__ldg(rp + ch) | ((uint32_t)__ldg(rp + ch + CPW_R / 2) << 16) : 0u;
          }
          mma(acc, qa_r, b[0], b[1]);
          s[j][0] += acc[0]; s[j][1] += acc[1]; s[j][2] += acc[2]; s[j][3] += acc[3];
        }
      }
      *reinterpret_cast<float2*>(&sm.red[w][g * PS + 8 * j + 2 * t]) = make_float2(s[j][0], s[j][1]);
      *reinterpret_cast<float2*>(&sm.red[w][(g + 8) * PS + 8 * j + 2 * t]) = make_float2(s[j][2], s[j][3]);
    }
    __syncthreads();

    // ---- softmax: warp w owns score tiles [TPW w, TPW (w + 1)) (8 TPW tokens)
    float x[TPW][4];
    float mloc[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int jj = 0; jj < TPW; ++jj) {
      const int col = 8 * (TPW * w + jj) + 2 * t;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float2 acc = make_float2(0.f, 0.f);
#pragma unroll
        for (int ww = 0; ww < NWARPS; ++ww) {
          const float2 v = *reinterpret_cast<const float2*>(&sm.red[ww][(g + 8 * r) * PS + col]);
          acc.x += v.x;
          acc.y += v.y;
        }
        x[jj][2 * r] = (col >= vlo && col < vhi) ? acc.x * qk_scale : -INFINITY;
        x[jj][2 * r + 1] = (col + 1 >= vlo && col + 1 < vhi) ? acc.y * qk_scale : -INFINITY;
        mloc[r] = fmaxf(mloc[r], fmaxf(x[jj][2 * r], x[jj][2 * r + 1]));
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mloc[r] = fmaxf(mloc[r], __shfl_xor_sync(0xffffffffu, mloc[r], 1));
      mloc[r] = fmaxf(mloc[r], __shfl_xor_sync(0xffffffffu, mloc[r], 2));
    }
    if (t == 0) {
      sm.mx[w][g] = mloc[0];
      sm.mx[w][g + 8] = mloc[1];
    }
    __syncthreads();
    float alpha[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int h = g + 8 * r;
      float mt = sm.mx[0][h];
#pragma unroll
      for (int ww = 1; ww < NWARPS; ++ww) mt = fmaxf(mt, sm.mx[ww][h]);
      const float m_new = fmaxf(m_i[r], mt);  // finite: every tile holds a valid token
      alpha[r] = exp2f(m_i[r] - m_new);
      m_i[r] = m_new;
      float ls = 0.f;
#pragma unroll
      for (int jj = 0; jj < TPW; ++jj) {
        const float p0 = exp2f(x[jj][2 * r] - m_new), p1 = exp2f(x[jj][2 * r + 1] - m_new);
        ls += p0 + p1;
        *reinterpret_cast<uint32_t*>(&sm.p[h * PS + 8 * (TPW * w + jj) + 2 * t]) = pack_bf16(p0, p1);
      }
      l_i[r] = l_i[r] * alpha[r] + ls;
    }
    __syncthreads();

    // ---- values: this warp's channels, all 64 tokens
    if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
      for (int i = 0; i < GPW * 8; ++i) {
        o[i][0] *= alpha[0]; o[i][1] *= alpha[0]; o[i][2] *= alpha[1]; o[i][3] *= alpha[1];
      }
#pragma unroll
      for (int i = 0; i < GPW; ++i) {
        corr[i][0] *= alpha[0]; corr[i][1] *= alpha[0]; corr[i][2] *= alpha[1]; corr[i][3] *= alpha[1];
      }
      zacc[0] *= alpha[0]; zacc[1] *= alpha[0]; zacc[2] *= alpha[1]; zacc[3] *= alpha[1];
    }
#pragma unroll
    for (int ks = 0; ks < NT / 16; ++ks) {
      const int k0 = 16 * ks + 2 * t;  // this lane's tokens: k0, k0+1 (b01 / a01), k0+8, k0+9 (b23 / a23)
      uint32_t pa[4];
      pa[0] = *reinterpret_cast<const uint32_t*>(&sm.p[g * PS + k0]);
      pa[1] = *reinterpret_cast<const uint32_t*>(&sm.p[(g + 8) * PS + k0]);
      pa[2] = *reinterpret_cast<const uint32_t*>(&sm.p[g * PS + k0 + 8]);
      pa[3] = *reinterpret_cast<const uint32_t*>(&sm.p[(g + 8) * PS + k0 + 8]);
      if constexpr (!P) {
        // zero term: B column g = (group g/2 of this warp, hi (even) / lo (odd) part)
        uint32_t zb0 = 0, zb1 = 0;
        if (g < 2 * GPW) {
          const int G = w * GPW + (g >> 1);
          const __nv_bfloat16* zp = (g & 1) ? sm.czl[szb] : sm.czh[szb];
          zb0 = *reinterpret_cast<const uint32_t*>(&zp[G * SZS + k0]);
          zb1 = *reinterpret_cast<const uint32_t*>(&zp[G * SZS + k0 + 8]);
        }
        mma(zacc, pa, zb0, zb1);
      }
#pragma unroll
      for (int gi = 0; gi < GPW; ++gi) {
        const int G = w * GPW + gi;
        uint32_t a[4];
        uint32_t cw[4];  // this lane's 8 channels of the group for tokens k0, k0+1, k0+8, k0+9
        if constexpr (!P) {
          const uint32_t s0 = *reinterpret_cast<const uint32_t*>(&sm.cs_b[szb][G * SZS + k0]);
          const uint32_t s1 = *reinterpret_cast<const uint32_t*>(&sm.cs_b[szb][G * SZS + k0 + 8]);
          a[0] = bmul2(pa[0], s0); a[1] = bmul2(pa[1], s0); a[2] = bmul2(pa[2], s1); a[3] = bmul2(pa[3], s1);
          mma(corr[gi], a, KMID, KMID);  // (128 + mid) * sum_n P'
          const int off = G * 8 * CB + g * CB;  // byte of this lane's channels in a token row
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int tok = k0 + (e & 1) + 8 * (e >> 1);
            if constexpr (CB == 4) cw[e] = *reinterpret_cast<const uint32_t*>(scc + tok * CRS + off);
            else cw[e] = *reinterpret_cast<const uint16_t*>(scc + tok * CRS + off);
          }
          // (token k0 | token k0+1) and (k0+8 | k0+9) side by side: low half, high half of each word
          const uint32_t z01a = __byte_perm(cw[0], cw[1], 0x5410), z23a = __byte_perm(cw[2], cw[3], 0x5410);
          uint32_t z01b = 0, z23b = 0;
          if constexpr (CB == 4) {
            z01b = __byte_perm(cw[0], cw[1], 0x7632);
            z23b = __byte_perm(cw[2], cw[3], 0x7632);
          }
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            const int bit = CB * j;
            const uint32_t b0 = codes2<CB>(bit < 16 ? z01a : z01b, bit & 15);
            const uint32_t b1 = codes2<CB>(bit < 16 ? z23a : z23b, bit & 15);
            mma(o[gi * 8 + j], a, b0, b1);
          }
        } else {
          a[0] = pa[0]; a[1] = pa[1]; a[2] = pa[2]; a[3] = pa[3];
          uint4 u[4];
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int tok = k0 + (e & 1) + 8 * (e >> 1);
            const bool ok = tok >= vlo && tok < vhi;
            u[e] = ok ? ld_u4(gpc + (long long)tok * DC + w * SLICE + 64 * gi + 8 * g) : make_uint4(0, 0, 0, 0);
          }
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            auto word = [&](const uint4& q, int i) { return i == 0 ? q.x : i == 1 ? q.y : i == 2 ? q.z : q.w; };
            const uint32_t b0 = pair_bf16(word(u[0], j / 2), word(u[1], j / 2), j);
            const uint32_t b1 = pair_bf16(word(u[2], j / 2), word(u[3], j / 2), j);
            mma(o[gi * 8 + j], a, b0, b1);
          }
        }
      }
    }
  };

  if (!prot_split) {
    // ---- body tiles: codes by cp.async (3 stages), scales / zeros one tile ahead through registers
    auto issue = [&](int tt) {
      if (tt < te) {
        const long long row0 = tile_row0(tt);
        uint8_t* dc = sm.cc[tt % STAGES];
        uint8_t* dr = sm.rc[tt % STAGES];
        constexpr int CCH = CROWB / 16, RCH = RROWB / 16;
#pragma unroll
        for (int i = tid; i < NT * CCH; i += NTHREADS) {
          const int r = i / CCH, c = i % CCH;
          cp_async16(dc + r * CRS + 16 * c, cc_ptr + (row0 + r) * c_row + 16 * c);
        }
#pragma unroll
        for (int i = tid; i < NT * RCH; i += NTHREADS) {
          const int r = i / RCH, c = i % RCH;
          cp_async16(dr + r * RRS + 16 * c, rc_ptr + (row0 + r) * r_row + 16 * c);
        }
      }
      cp_commit();
    };
    constexpr int NCE = (NT * NGC + NTHREADS - 1) / NTHREADS;  // (token, content group) per thread
    constexpr int NRE = (NT * NGR + NTHREADS - 1) / NTHREADS;
    float ls_c[NCE], lz_c[NCE], ls_r[NRE], lz_r[NRE];
    auto load_sz = [&](int tt) {
      if (tt >= te) return;
      const long long row0 = tile_row0(tt);
#pragma unroll
      for (int i = 0; i < NCE; ++i) {
        const int e = tid + i * NTHREADS;
        if (e < NT * NGC) {
          const long long off = (row0 + e / NGC) * c_sz_row + e % NGC;
          ls_c[i] = ld_half(cs_ptr + off);
          lz_c[i] = ld_half(cz_ptr + off);
        }
      }
#pragma unroll
      for (int i = 0; i < NRE; ++i) {
        const int e = tid + i * NTHREADS;
        if (e < NT * NGR) {
          const long long off = (row0 + e / NGR) * r_sz_row + e % NGR;
          ls_r[i] = ld_half(rs_ptr + off);
          lz_r[i] = ld_half(rz_ptr + off);
        }
      }
    };
    auto store_sz = [&](int tt) {  // invalid tokens get scale 0, zero 0 (their pool rows may hold NaN)
      if (tt >= te) return;
      const int pos0 = (tt + t_lo) * NT;
      const int buf = tt & 1;
      constexpr float mid = (float)(1 << (CB - 1));
#pragma unroll
      for (int i = 0; i < NCE; ++i) {
        const int e = tid + i * NTHREADS;
        if (e < NT * NGC) {
          const int tok = e / NGC, G = e % NGC, pos = pos0 + tok;
          const bool ok = pos >= sink && pos < q_hi;
          const float sc = ok ? ls_c[i] : 0.f, z = ok ? lz_c[i] : 0.f;
          sm.cs_f[buf][G * SZS + tok] = sc;
          sm.cz_f[buf][G * SZS + tok] = z - 128.f * sc;
          sm.cs_b[buf][G * SZS + tok] = __float2bfloat16_rn(sc);
          const float zc = z + mid * sc;
          const __nv_bfloat16 zh = __float2bfloat16_rn(zc);
          sm.czh[buf][G * SZS + tok] = zh;
          sm.czl[buf][G * SZS + tok] = __float2bfloat16_rn(zc - __bfloat162float(zh));
        }
      }
#pragma unroll
      for (int i = 0; i < NRE; ++i) {
        const int e = tid + i * NTHREADS;
        if (e < NT * NGR) {
          const int tok = e / NGR, G = e % NGR, pos = pos0 + tok;
          const bool ok = pos >= sink && pos < q_hi;
          const float sc = ok ? ls_r[i] : 0.f, z = ok ? lz_r[i] : 0.f;
          sm.rs_f[buf][G * SZS + tok] = sc;
          sm.rz_f[buf][G * SZS + tok] = z - 128.f * sc;
        }
      }
    };

#pragma unroll
    for (int i = 0; i < STAGES - 1; ++i) issue(tb + i);
    load_sz(tb);
    store_sz(tb);
    for (int tt = tb; tt < te; ++tt) {
      cp_wait<STAGES - 2>();
      __syncthreads();  // tile tt's codes and scales are in; everyone is done with tile tt-1
      issue(tt + STAGES - 1);
      load_sz(tt + 1);
      const int pos0 = (tt + t_lo) * NT;
      const int vlo = max(sink - pos0, 0), vhi = min(q_hi - pos0, NT);
      process(Body{}, sm.cc[tt % STAGES], sm.rc[tt % STAGES], tt & 1, nullptr, nullptr, vlo, vhi);
      store_sz(tt + 1);
    }
    cp_wait<0>();
  } else {
    // ---- protected rows: bf16, straight from global memory
    const int n_p = min(L, window);
    const long long row_base = (long long)slots_ptr[b] * window;
    for (int tt = tb; tt < te; ++tt) {
      __syncthreads();  // the shared score / P buffers of the last tile are free
      const long long r0 = row_base + (long long)tt * NT;
      process(Prot{}, nullptr, nullptr, 0, pc_ptr + r0 * DC, pr_ptr + r0 * DR, 0, min(n_p - tt * NT, NT));
    }
  }

  // ---- epilogue: l over lanes and warps, corrections, normalization, store
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l_i[r] += __shfl_xor_sync(0xffffffffu, l_i[r], 1);
    l_i[r] += __shfl_xor_sync(0xffffffffu, l_i[r], 2);
  }
  __syncthreads();
  if (t == 0) {
    sm.lsum[w][g] = l_i[0];
    sm.lsum[w][g + 8] = l_i[1];
  }
  __syncthreads();
  const long long prow = ((long long)b * nst + split) * H;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int h = g + 8 * r;
    float l = 0.f;
#pragma unroll
    for (int ww = 0; ww < NWARPS; ++ww) l += sm.lsum[ww][h];
    const bool ok = l > 0.f;
    const float inv = ok ? 1.f / l : 0.f;
    if (w == 0 && t == 0 && h0 + h < H)
      plse_ptr[prow + h0 + h] = ok ? (m_i[r] + log2f(l)) * 0.6931471805599453f : -INFINITY;
#pragma unroll
    for (int gi = 0; gi < GPW; ++gi) {
      // zero term of group gi for this row: lane (g, t = gi) holds its hi (c0 / c2) and lo (c1 / c3) parts
      const float zsum = __shfl_sync(0xffffffffu, zacc[2 * r] + zacc[2 * r + 1], g * 4 + gi);
      const float add = zsum - corr[gi][2 * r];
      if (h0 + h < H) {
        float* dst = po_ptr + (prow + h0 + h) * DC + w * SLICE + 64 * gi + 16 * t;
        float v[16];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          v[j] = (o[gi * 8 + j][2 * r] + add) * inv;          // column 2t: channel 16t + j
          v[8 + j] = (o[gi * 8 + j][2 * r + 1] + add) * inv;  // column 2t+1: channel 16t + 8 + j
        }
#pragma unroll
        for (int q = 0; q < 4; ++q)
          reinterpret_cast<float4*>(dst)[q] = make_float4(v[4 * q], v[4 * q + 1], v[4 * q + 2], v[4 * q + 3]);
      }
    }
  }
}
