// Absorbed-MLA decode over the paged integer (or fp8) cache, few heads (<= 16 per CTA): mma.sync m16n8k16 with
// the codes turned straight into tensor-core operand registers. Launcher and contract: mla_decode_cuda.py.
//
// Compile-time config (-D): CB, RB (content / rope bits: 4 or 2), DC, DR (dims), RG (rope group), STAGES.
// fp8 variant (CB = 8: content e4m3 with an fp32 scale per CG channels, CG = 0: none; rope RB = 8: e4m3 without
// scale, or RB = 16: bf16; RG = DR): see "fp8" below; the structure is the same.
// Content groups are 64 channels. One CTA = (block of 16 heads, sequence, split: the grid's x, y, z, so that live
// splits are launched before the empty ones a loose max_seq_len adds) = NW = DC / 64 warps, one
// per content group; tiles of NT = 64 tokens (one block-table entry each: a page holds whole tiles).
//
// Per body tile:
//   scores  warp w takes the two n8 tiles of token quarter w % 4 (each q fragment load feeds two mmas) over
//           channel slice w / 4 of CS = NW / 4 (content groups and rope k steps split in halves at DC 512);
//           with two slices, each warp hands the other the partial sums of the tile that one keeps (a named
//           barrier per pair of warps):
//             S[16 heads, token] = 2^(6+e) Z + sum_g scale[t, g] 2^(24+e) acc_g      (fp32, log2 units)
//           acc_g = mma chains in fp16 over the channels of scale group g. The B operand is the codes: one
//           AND puts the code at bits [b, b + bits) of a 16-bit half into an fp16 subnormal worth
//           code * 2^(b-24), exactly (no offset, no int->float conversion; a shift by 8 reaches the odd
//           byte). The A operand is q' = fp16(q * qk_scale * 2^-e / 2^b) (e puts max |q'| in [2^13, 2^14)),
//           staged once per CTA in shared memory as ready fragments: a dot product does not care how k is
//           ordered, so each thread's k slots are the codes of its own words (`q_slot` below).
//           Z = sum_g zero[t, g] qsum_g 2^-6, one mma pair per kept n8 tile (zero fp16 exact; qsum 2^-6 as
//           fp16 hi + lo; qsum = the sum of the effective q over the group, from the fragments' k steps).
//   softmax P = 2^(S - m) (bf16, to shared memory) against the running max m, the same in every warp; the
//           barrier that publishes P votes, and only a tile whose scores pass m + 16 somewhere exchanges its max
//           through shared memory, rescales and stores P again.
//   values  warp w: O[16, 64 channels of group w] += P'_w . (128 + code) in bf16 with P'_w = P * scale[t, w]
//           (codes by lop3 into the mantissa of bf16 128.0, exact; prmt pairs two tokens), corr += P'_w .
//           (128 + mid) (an mma with a constant B: the same rounded P', so the offset cancels exactly), and
//           warp 0 accumulates W[h, g] = P . (zero + mid * scale)[t, g] (hi + lo bf16, all groups at once).
//           At the end O = o - corr + W[., w]. Column n of value tile jn is channel 64 w + 8 n + jn.
// Protected BF16 rows (sink + recent window) are nps extra splits per sequence (split indices 0 .. nps - 1, the
// launcher's prot_splits; 1 by default), each a run of their 64-row tiles, prefetched to L2 and read from global
// memory (clamped to a valid row: P = 0 drops the rest) with q in bf16, plain order.
// Codes of body tiles are staged in shared memory by cp.async (STAGES deep); the scales and zeros of the next
// tile are loaded into registers one tile ahead (branch-free) and converted when stored to shared memory.
//
// fp8 (CB = 8): e4m3 codes become fp16 by cvt.rn.f16x2.e4m3x2 (exact). Scores: the B operand is a thread's
// words t + 4 u of the group's 16 (bank-conflict-free 4-byte reads), the A operand q' in fp16 with the slots in
// the same order; S = 2^e sum_g scale[t, g] acc_g (no zero term); a bf16 rope (RB = 16) is a plain bf16 mma
// chain with unscaled bf16 q. Values: O += (P scale[t, w]) . code in fp16 (P in fp16, so MARGIN is 8: P * scale
// stays finite for scales < 2^7). Rows of an edge tile outside the valid positions are zeroed in shared memory
// (e4m3 has NaN patterns; P = 0 does not cancel them).

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
#ifndef CG
#define CG 0  // fp8 content: channels per fp32 scale (0: one fixed scale of 1.0, nothing stored)
#endif
#ifndef STAGES
#define STAGES 3  // shared-memory stages of codes (cp.async ring)
#endif

#define NT 64  // tokens per tile
constexpr bool FP8 = CB == 8;            // the fp8 variant (content e4m3; rope e4m3 or bf16)
constexpr bool RBF = RB == 16;           // bf16 rope (fp8 variant only)
constexpr int NW = DC / 64;              // warps: one per content group
constexpr int NTHREADS = 32 * NW;
constexpr int NQ = NT / 16;              // token quarters (two n8 tiles) of a tile
constexpr int CS = NW / NQ;              // channel slices of the scores: warp w takes quarter w % NQ, slice w / NQ
constexpr int NJ = 2 / CS;               // n8 tiles of scores per warp after the slices' exchange
constexpr int NGC = DC / 64, NGR = DR / RG, NG = NGC + NGR;  // scale groups
constexpr int CROWB = DC * CB / 8;       // code bytes of one token
constexpr int RROWB = DR * RB / 8;
constexpr int CRS = CROWB + 16;          // shared-memory row strides (+16 B: conflict-free fragment reads)
constexpr int RRS = RROWB + 16;
constexpr int KSC = DC / 16, KSR = DR / 16, KS = KSC + KSR;  // k16 steps of the scores
constexpr int CGB = 64 * CB / 8;         // bytes of one content group of one token
constexpr int RGB = RG * RB / 8;         // bytes of one rope group of one token
constexpr int WTC = CGB / 16;            // words of a content group per thread (4 threads per token)
constexpr int WTR = RGB / 16;
constexpr int SZS = NT + 4;              // row stride of the [group][token] scale tables
constexpr int ZS = 24;                   // row stride (halves) of the [token][group] zero table
constexpr int CCH = NT * CROWB / 16;     // 16-byte chunks of a tile's content codes
constexpr int RCH = NT * RROWB / 16;
constexpr int SZT = NTHREADS / NT;      // threads per token in the scale / zero staging
constexpr int NSZ = (NG + SZT - 1) / SZT;  // groups per thread there
constexpr int NCS = CG ? DC / (CG ? CG : 1) : 0;   // fp8: stored content scales per token
constexpr int NSF = (NCS + SZT - 1) / SZT;  // fp8: of them per thread in the staging
constexpr int ZN = FP8 ? 8 : 1;          // fp8 needs no zero tables: one tiny row keeps the layout
constexpr int CGS = CG ? CG : 64;        // fp8: channels per scale (a divisor that is never 0)
// Rows of the scale tables: int, one per scale group (scores) and content group (values); fp8, one per stored
// content scale. (fp8 leaves out what it does not use, so that two blocks of the 656-byte row fit an SM.)
constexpr int NSR = FP8 ? (NCS > 0 ? NCS : 1) : NG;
constexpr int NSB = FP8 ? (NCS > 0 ? NCS : 1) : NGC;
constexpr uint32_t KMID = (0x4300u | (1u << (CB - 1))) * 0x00010001u;  // bf16x2 (128 + mid, 128 + mid)

static_assert(DC == 256 || DC == 512, "kv_lora_rank 256 or 512 (one warp per 64-channel group)");
static_assert(CB == 2 || CB == 4 || CB == 8, "content bits");
static_assert(FP8 ? (RB == 8 || RB == 16) && RG == DR : (RB == 2 || RB == 4), "rope bits (fp8 content: e4m3 or bf16 rope)");
static_assert(!FP8 || CG == 0 || (CG % 64 == 0 && DC % (CG ? CG : 64) == 0), "fp8 content scale groups of whole 64-channel warps");
static_assert(DR % RG == 0 && RG % 16 == 0 && RGB % 16 == 0, "rope group: whole words for 4 threads");
static_assert(NG <= 16, "at most 16 scale groups (one k16 step of the zero term)");
static_assert(NGC == 2 * SZT, "scale staging: two content groups per thread");
static_assert((CS == 1 || CS == 2) && NGC % CS == 0 && KSR % CS == 0, "channel slices of the scores");
static_assert(DC % 8 == 0 && DR % 8 == 0 && (2 * NT * ZS * 2) % 16 == 0, "16-byte staging");
static_assert(CCH % NTHREADS == 0 && (RCH <= NTHREADS || RCH % NTHREADS == 0), "cp.async chunks per thread");

struct Ring {
  uint8_t cc[STAGES][NT * CRS];     // content codes, token rows
  uint8_t rc[STAGES][NT * RRS];     // rope codes
};

struct Smem {
  Ring ring;                        // the code tiles
  uint4 qf[KS * 32];                // q A fragments [k step][lane] (body: fp16 q'; protected: bf16 q)
  float scf[2][NSR * SZS];          // scores: scale * 2^(24+e) (fp8: * 2^e), [group][token]
  alignas(16) __half zh[2][FP8 ? ZN : NT * ZS];  // scores: zero (fp16), [token][group]; groups >= NG stay 0
  alignas(16) uint16_t scb[2][NSB * SZS];  // values: scale (bf16; fp8: fp16), [group][vpos(token)]
  alignas(16) __nv_bfloat16 zch[2][FP8 ? ZN : NGC * SZS];  // values: zero + mid * scale, hi part
  alignas(16) __nv_bfloat16 zcl[2][FP8 ? ZN : NGC * SZS];  //         and lo part
  uint4 pf[NT / 16][32];            // P of the tile (bf16) as the values' A fragments [k step][lane]
  float qsum[FP8 ? 1 : 16][16];     // sum of the effective q' over each group [head][group]
  float mx[16][NW];                 // per-warp tile max per head
  float lsum[16][NW];
  uint4 qzf[2][FP8 ? 1 : 32];       // A fragments of qsum 2^-6 [head][group] as fp16, hi and lo part [lane]
  float red[NW];
  union {
    float4 xs[CS > 1 ? NW * 32 : 1];  // scores: the partial sums a slice hands to the other [warp][lane]
    float qks[KS][16];                // prologue: per k step, the sum of the effective q' times 2^shift [k step][head]
    float wz[NW][16][8];              // epilogue: each warp's part of W [warp][head][group]
  } xu;
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

// Register r of a thread's scores B operand from its words wd (codes of BITS bits): the word is
// wd[r / (2 CPB)], the byte pair (0, 2) or, shifted by 8, (1, 3), code j = r % CPB of each byte as an fp16
// subnormal: code * 2^(BITS j - 24).
template <int BITS, int NWD>
__device__ __forceinline__ uint32_t sub_codes(const uint32_t (&wd)[NWD], int r) {
  constexpr int CPB = 8 / BITS;
  const int u = r / (2 * CPB), s = (r / CPB) & 1, j = r % CPB;
  const uint32_t y = s ? (wd[u] >> 8) : wd[u];
  return y & ((((1u << BITS) - 1) << (BITS * j)) * 0x00010001u);
}

__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void mma_bf16(float (&d)[4], uint4 a, uint32_t b0, uint32_t b1) {
  const uint32_t aa[4] = {a.x, a.y, a.z, a.w};
  mma_bf16(d, aa, b0, b1);
}

__device__ __forceinline__ void mma_f16(float (&d)[4], uint4 a, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

__device__ __forceinline__ uint32_t pack_f16(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

__device__ __forceinline__ uint32_t bmul2(uint32_t a, uint32_t b) {
  __nv_bfloat162 r = __hmul2(*reinterpret_cast<__nv_bfloat162*>(&a), *reinterpret_cast<__nv_bfloat162*>(&b));
  return *reinterpret_cast<uint32_t*>(&r);
}

__device__ __forceinline__ uint32_t hmul2(uint32_t a, uint32_t b) {
  __half2 r = __hmul2(*reinterpret_cast<__half2*>(&a), *reinterpret_cast<__half2*>(&b));
  return *reinterpret_cast<uint32_t*>(&r);
}

// The four e4m3 bytes of w -> fp16x2 (byte 0, byte 1) in lo and (byte 2, byte 3) in hi, exact (sm_89+).
__device__ __forceinline__ void e4m3x4_f16(uint32_t w, uint32_t& lo, uint32_t& hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm("{.reg .b16 a, b;\n mov.b32 {a, b}, %2;\n cvt.rn.f16x2.e4m3x2 %0, a;\n cvt.rn.f16x2.e4m3x2 %1, b;}"
      : "=r"(lo), "=r"(hi) : "r"(w));
#else
  lo = hi = 0u;  // the launcher never runs the fp8 variant below sm_89
#endif
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

// Named barrier id (1..15; __syncthreads is 0) over n threads (whole warps).
__device__ __forceinline__ void bar_sync(int id, int n) { asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory"); }

__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

__device__ __forceinline__ uint4 ld_u4(const void* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }
__device__ __forceinline__ uint32_t ld_u32(const void* p) { return __ldg(reinterpret_cast<const unsigned int*>(p)); }

__device__ __forceinline__ uint32_t word_of(const uint4& q, int i) {
  return i == 0 ? q.x : i == 1 ? q.y : i == 2 ? q.z : q.w;
}

// One run of k steps of the scores within one scale group, for the lane's two n8 tiles (token rows rp and
// rp + 8 rows): the group's WT code words of each, NK k steps from k step KK0 of the group with the q fragments
// at qf[32 kk] (this lane's, shared by both tiles), times the group's scales of the lane's tokens (2t, 2t+1)
// of each tile (scp, scp + 8), added to s.
template <int BITS, int WT>
__device__ __forceinline__ void group_scores(float (&s)[2][4], const uint8_t* rp, int tile_bytes, const uint4* qf,
                                             int kk0, int nk, const float* scp) {
  uint32_t wd[2][WT];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const uint8_t* p = rp + j * tile_bytes;
    if constexpr (WT == 2) {
      const uint2 v = *reinterpret_cast<const uint2*>(p);
      wd[j][0] = v.x;
      wd[j][1] = v.y;
    } else {
      wd[j][0] = *reinterpret_cast<const uint32_t*>(p);
    }
  }
  float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
  for (int kk = 0; kk < nk; ++kk) {
    const uint4 a = qf[32 * kk];
    const int r = 2 * (kk0 + kk);
#pragma unroll
    for (int j = 0; j < 2; ++j) mma_f16(acc[j], a, sub_codes<BITS>(wd[j], r), sub_codes<BITS>(wd[j], r + 1));
  }
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const float2 sc = *reinterpret_cast<const float2*>(scp + 8 * j);
    s[j][0] += sc.x * acc[j][0];
    s[j][1] += sc.y * acc[j][1];
    s[j][2] += sc.x * acc[j][2];
    s[j][3] += sc.y * acc[j][3];
  }
}

// fp8: one run of NK k steps from k step KK0 of a group whose row starts at rp (token row rp, rp + 8 rows for
// the lane's two n8 tiles; rp already at the lane's word t): k step kk is word t + 4 kk, i.e. byte 16 kk of rp,
// its fp16 pairs (bytes 0, 1) and (2, 3) the B registers. Adds scale[tok] * acc (scp: [token] of the group, the
// lane's tokens 2t, 2t+1 of each tile at scp, scp + 8) or, scp null, sfac * acc.
__device__ __forceinline__ void fp8_group_scores(float (&s)[2][4], const uint8_t* rp, int tile_bytes, const uint4* qf,
                                                 int kk0, int nk, const float* scp, float sfac) {
  float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
  for (int kk = 0; kk < nk; ++kk) {
    const uint4 a = qf[32 * kk];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      uint32_t b0, b1;
      e4m3x4_f16(*reinterpret_cast<const uint32_t*>(rp + j * tile_bytes + 16 * (kk0 + kk)), b0, b1);
      mma_f16(acc[j], a, b0, b1);
    }
  }
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const float2 sc = scp ? *reinterpret_cast<const float2*>(scp + 8 * j) : make_float2(sfac, sfac);
    s[j][0] += sc.x * acc[j][0];
    s[j][1] += sc.y * acc[j][1];
    s[j][2] += sc.x * acc[j][2];
    s[j][3] += sc.y * acc[j][3];
  }
}

template <int N>
struct IntC {
  static constexpr int value = N;
};

// ---- the scores' k-slot map ------------------------------------------------------------------------------
// Body k step ks, lane (g, t), fragment register r (a0..a3: rows g, g+8, g, g+8; k slots 2t, 2t+1 for r < 2,
// 2t+8, 2t+9 for r >= 2): which channel of q (< DC: content, else DC + rope channel) each of the pair's two
// slots holds, and its bit offset b in the byte (q is divided by 2^b). The thread's B registers of a group
// are sub_codes(words, 0..7) in order; k step kk of the group takes registers 2 kk (slots 2t, 2t+1) and
// 2 kk + 1 (slots 2t+8, 2t+9); the low / high fp16 of a register is byte s / 2 + s of its word.
struct Slot {
  int ch0, ch1, shift;
};
template <bool ROPE>  // compile-time, so that the divisions below are shifts
__device__ __forceinline__ Slot q_slot(int ks, int t, int hi) {
  constexpr int bits = ROPE ? RB : CB, cpb = bits < 8 ? 8 / bits : 1;
  constexpr int kpg = ROPE ? RG / 16 : 4;              // k steps per group
  constexpr int wt = ROPE ? WTR : WTC;                 // words per thread per group
  const int kr = ROPE ? ks - KSC : ks;
  const int kk = kr % kpg, grp = kr / kpg;             // k step within the group, group
  const int r = 2 * kk + hi;                           // register of the group
  const int base = ROPE ? DC : 0;
  if constexpr (bits == 16)  // bf16 rope: plain order
    return Slot{base + 16 * kr + 2 * t + 8 * hi, base + 16 * kr + 2 * t + 8 * hi + 1, 0};
  if constexpr (bits == 8) {  // fp8: word t + 4 kk of the group, bytes (2 hi, 2 hi + 1)
    const int wi = grp * 4 * wt + t + 4 * kk;
    return Slot{base + 4 * wi + 2 * hi, base + 4 * wi + 2 * hi + 1, 0};
  }
  const int u = r / (2 * cpb), s = (r / cpb) & 1, j = r % cpb;
  const int wi = grp * 4 * wt + t * wt + u;            // word of the token's row
  return Slot{base + (4 * wi + s) * cpb + j, base + (4 * wi + 2 + s) * cpb + j, bits * j};
}

// Where token tok of a tile sits in the values' [group][token] tables (bf16 scales and zero terms): within each
// 16 tokens, token 2t + 8 hi + b at 4t + 2 hi + b, so that an MMA k step's four tokens of lane t (2t, 2t+1,
// 2t+8, 2t+9) are one 8-byte word.
__device__ __forceinline__ int vpos(int tok) {
  return (tok & ~15) | ((tok & 6) << 1) | ((tok >> 2) & 2) | (tok & 1);
}

// Body splits of one sequence of L tokens: `body_splits` of mla_decode_cuda.py, the same integer arithmetic
// (fit: blocks of a sequence in one wave, before the protected split's slot; ctas: blocks per split index).
constexpr int PROT_TILES = 12;
__device__ __forceinline__ int body_splits_of(int L, int fit, int ctas, int num_sms, bool protected_rows) {
  const int length = max(L, 1);
  auto tiles = [&](int n) { return (length + NT * n - 1) / (NT * n); };
  if (protected_rows && fit > 1 && tiles(fit - 1) - tiles(fit) <= PROT_TILES) fit -= 1;
  const int shortest = (long long)ctas * ((length + 255) / 256) <= num_sms ? 256 : 512;
  int root = 1;  // ceil(sqrt(length) / 4): the least root with 16 root^2 >= length
  while (16 * root * root < length) ++root;
  return max(1, min(min(fit, root), (length + shortest - 1) / shortest));
}

// ---- the kernel ----------------------------------------------------------------------------------------

extern "C" __global__ void __launch_bounds__(NTHREADS, 2) mla_decode_int(
    const void* __restrict__ qn_ptr, const void* __restrict__ qp_ptr, int q_f32,
    const uint8_t* __restrict__ cc_ptr, const __half* __restrict__ cs_ptr, const __half* __restrict__ cz_ptr,
    const uint8_t* __restrict__ rc_ptr, const __half* __restrict__ rs_ptr, const __half* __restrict__ rz_ptr,
    const __nv_bfloat16* __restrict__ pc_ptr, const __nv_bfloat16* __restrict__ pr_ptr,
    const int* __restrict__ bt_ptr, int bt_stride, const int* __restrict__ lens_ptr,
    const int* __restrict__ slots_ptr, float* __restrict__ po_ptr, float* __restrict__ plse_ptr,
    int H, int nsb, int nps, int nst, int fit, int ctas, int num_sms, float qk_scale, long long c_row,
    long long c_sz_row, long long r_row, long long r_sz_row, int page, int sink, int window) {
  extern __shared__ __align__(16) uint8_t smem_raw[];
  Smem& sm = *reinterpret_cast<Smem*>(smem_raw);

  const int hb = blockIdx.x, b = blockIdx.y, split = blockIdx.z;
  const int tid = threadIdx.x, w = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int h0 = hb * 16;
  const int jt0 = CS == 1 ? 2 * w : 2 * (w % NQ) + w / NQ;  // first n8 tile of this warp's scores (tokens 8 jt0 ..)

  // Work: body tiles (positions [sink, q_hi), tiles of NT aligned to position 0) split over nsb splits;
  // splits 0 .. nps - 1 (nps = 0 when window = 0) take the protected rows [0, min(L, window)) in runs of whole
  // tiles, and body split s is split s + nps. (First, so that the live splits keep their places in the partials
  // whatever nsb is: the combine then sums them in the same order under any bound.)
  const int L = lens_ptr[b];
  const int n_q = max(L - window, 0);
  const int q_hi = sink + n_q;
  const int t_lo = sink / NT;
  const int nt_q = n_q > 0 ? (q_hi + NT - 1) / NT - t_lo : 0;
  const bool prot_split = split < nps;
  const int body_split = split - nps;
  int tb, te;
  if (!prot_split) {
    // nsb is sized for max_seq_len; the sequence takes its own count (fit = 0: nsb as given), and the splits
    // past it have no tiles.
    const int own = fit > 0 ? min(nsb, body_splits_of(L, fit, ctas, num_sms, window > 0)) : nsb;
    const int per = (nt_q + own - 1) / own;
    tb = body_split < own ? body_split * per : nt_q;
    te = min(tb + per, nt_q);
  } else {
    const int ntp = (min(L, window) + NT - 1) / NT, per = (ntp + nps - 1) / nps;
    tb = min(split * per, ntp);
    te = min(tb + per, ntp);
  }
  if (tb >= te) {  // no tiles: lse = -inf alone (the combine reads no output where lse is -inf)
    if (tid < 16 && h0 + tid < H) plse_ptr[((long long)b * nst + split) * H + h0 + tid] = -INFINITY;
    return;
  }

  // ---- the body's copies: codes by cp.async (STAGES deep), scales / zeros one tile ahead through registers.
  // The first tiles are issued before the q prologue, which hides their latency.
  const int* bt_row = bt_ptr + (long long)b * bt_stride;
  const int tpp_lg = __ffs(page / NT) - 1;  // tiles per page: a power of two (the launcher checks)
  // Block-table entry of a tile (0 past te: a page whose rows nobody uses), and the pool row of its first position.
  auto tile_blk = [&](int tt) -> int { return tt < te ? bt_row[(tt + t_lo) >> tpp_lg] : 0; };
  auto tile_row = [&](int tt, int blk) -> long long {
    return (long long)blk * page + ((tt + t_lo) & ((1 << tpp_lg) - 1)) * NT;
  };
  auto issue = [&](int tt, long long row0) {
    if (tt < te) {
      uint8_t* dc = sm.ring.cc[tt % STAGES];
      uint8_t* dr = sm.ring.rc[tt % STAGES];
      constexpr int CPR = CROWB / 16, RPR = RROWB / 16;  // chunks per row
      const uint8_t* src = cc_ptr + (row0 + tid / CPR) * c_row + 16 * (tid % CPR);
      uint8_t* dst = dc + (tid / CPR) * CRS + 16 * (tid % CPR);
#pragma unroll
      for (int i = 0; i < CCH / NTHREADS; ++i)
        cp_async16(dst + i * (NTHREADS / CPR) * CRS, src + i * (NTHREADS / CPR) * c_row);
#pragma unroll
      for (int i = 0; i < (RCH + NTHREADS - 1) / NTHREADS; ++i) {
        const int ch = tid + i * NTHREADS;
        if (RCH % NTHREADS == 0 || ch < RCH)
          cp_async16(dr + (ch / RPR) * RRS + 16 * (ch % RPR), rc_ptr + (row0 + ch / RPR) * r_row + 16 * (ch % RPR));
      }
    }
    cp_commit();
  };
  // Scales and zeros: thread tid takes token tid % NT and the groups G = tid / NT + k * SZT (k < NSZ); as
  // NGC = 2 SZT, slots 0 and 1 are content groups and the rest rope groups. Branch-free: a rope slot past
  // the last group loads group NGR - 1 and stores nothing; a tile past te loads rows of its page 0 and
  // stores into a buffer nobody reads.
  // fp8: the NCS fp32 content scales of token tid % NT, groups tid / NT + k * SZT (k < NSF; none if CG = 0).
  __half ls_[NSZ], lz_[NSZ];
  float lf_[NSF > 0 ? NSF : 1];
  const int sz_tok = tid % NT, sz_g0 = tid / NT;
  auto load_sz = [&](long long row0) {
    const long long row = row0 + sz_tok;
    if constexpr (FP8) {
      const float* cs = reinterpret_cast<const float*>(cs_ptr) + row * c_sz_row;
#pragma unroll
      for (int k = 0; k < NSF; ++k) lf_[k] = cs[min(sz_g0 + k * SZT, NCS - 1)];
      return;
    }
    const __half* cs = cs_ptr + row * c_sz_row + sz_g0;
    const __half* cz = cz_ptr + row * c_sz_row + sz_g0;
    const __half* rs = rs_ptr + row * r_sz_row;
    const __half* rz = rz_ptr + row * r_sz_row;
#pragma unroll
    for (int k = 0; k < NSZ; ++k) {
      if (k < 2) {
        ls_[k] = cs[k * SZT];
        lz_[k] = cz[k * SZT];
      } else {
        const int rg = min(sz_g0 + (k - 2) * SZT, NGR - 1);
        ls_[k] = rs[rg];
        lz_[k] = rz[rg];
      }
    }
  };
  // ---- q fragments. Thread tid builds entries i = tid + e NTHREADS (k step i / 32, lane i % 32 = its own
  // lane): it reads their q values straight from global memory into registers (pairs of adjacent channels:
  // a body slot's channel + 1 is the same slot of the register hi = 1; the protected order pairs within a
  // register), takes max |q * qk_scale| over the CTA (the exponent e; body splits only), then rounds. As
  // KSC * 32 = 4 NTHREADS, entries e < 4 are content k steps and the rest rope ones.
  constexpr int FE = (KS * 32 + NTHREADS - 1) / NTHREADS;
  static_assert(KSC * 32 == 4 * NTHREADS, "four content fragment entries per thread");
  float fv[FE][4][2];  // [entry][register a0..a3][half]: q, then q * qk_scale (0: padded head or no entry)
  float amax = 0.f;
  // (fp32 or bf16 q: two copies of the loads, each with its element size known)
  auto load_q = [&](auto f32c) {
    constexpr bool F32 = decltype(f32c)::value;
    constexpr int ESZ = F32 ? 4 : 2;
    const char *qn_row[2], *qp_row[2];  // [hr]: the rows of heads h0 + g + 8 hr (clamped; padded heads read 0)
    bool live[2];
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const long long row = (long long)b * H + min(h0 + g + 8 * hr, H - 1);
      live[hr] = h0 + g + 8 * hr < H;
      qn_row[hr] = reinterpret_cast<const char*>(qn_ptr) + row * DC * ESZ;
      qp_row[hr] = reinterpret_cast<const char*>(qp_ptr) + row * DR * ESZ;
    }
    auto pair = [&](int hr, bool rope, int c) -> float2 {  // q at channels c, c + 1 (c even) of one path
      if (!live[hr]) return make_float2(0.f, 0.f);
      const char* src = (rope ? qp_row[hr] : qn_row[hr]) + c * ESZ;
      if constexpr (F32) return __ldg(reinterpret_cast<const float2*>(src));
      const uint32_t u = ld_u32(src);
      return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u));
    };
#pragma unroll
    for (int e = 0; e < FE; ++e) {
      const int ks = (tid + e * NTHREADS) >> 5;
      const bool valid = ks < KS, rope = e >= 4;  // both warp-uniform
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        if (!valid) {
          fv[e][hr][0] = fv[e][hr][1] = fv[e][hr + 2][0] = fv[e][hr + 2][1] = 0.f;
        } else if (prot_split || FP8) {  // register (hr, hi) = channels c, c + 1 (protected: c = 16 ks + 2t + 8 hi)
#pragma unroll
          for (int hi = 0; hi < 2; ++hi) {
            const int c = prot_split ? 16 * ks + 2 * t + 8 * hi - (rope ? DC : 0)
                                     : (rope ? q_slot<true>(ks, t, hi).ch0 - DC : q_slot<false>(ks, t, hi).ch0);
            const float2 v = pair(hr, rope, c);
            fv[e][hr + 2 * hi][0] = v.x;
            fv[e][hr + 2 * hi][1] = v.y;
          }
        } else {  // register (hr, hi) = slots (ch0 + hi, ch1 + hi)
          const Slot sl = rope ? q_slot<true>(ks, t, 0) : q_slot<false>(ks, t, 0);
          const int base = rope ? DC : 0;
          const float2 v0 = pair(hr, rope, sl.ch0 - base), v1 = pair(hr, rope, sl.ch1 - base);
          fv[e][hr][0] = v0.x;
          fv[e][hr + 2][0] = v0.y;
          fv[e][hr][1] = v1.x;
          fv[e][hr + 2][1] = v1.y;
        }
      }
    }
  };
  if (q_f32) load_q(IntC<1>{});
  else load_q(IntC<0>{});
  int nxt[STAGES - 1];  // block-table entries of tiles tt+1 .. tt+STAGES-1, read a tile before they are needed
  if (!prot_split) {
    const int blk0 = tile_blk(tb);
    load_sz(tile_row(tb, blk0));  // first: they are needed first (a split here has a tile: tb < te)
#pragma unroll
    for (int i = 0; i < STAGES - 1; ++i) {
      nxt[i] = tile_blk(tb + 1 + i);
      issue(tb + i, tile_row(tb + i, i == 0 ? blk0 : nxt[i - 1]));
    }
  } else {  // this split's protected rows go to L2 while q is read (they are read with plain loads below)
    const long long r0 = (long long)slots_ptr[b] * window + (long long)tb * NT;
    const int n_p = min(min(L, window), te * NT) - tb * NT;
    const char* pc = reinterpret_cast<const char*>(pc_ptr + r0 * DC);
    const char* pr = reinterpret_cast<const char*>(pr_ptr + r0 * DR);
    for (int off = tid * 128; off < n_p * DC * 2; off += NTHREADS * 128) prefetch_l2(pc + off);
    for (int off = tid * 128; off < n_p * DR * 2; off += NTHREADS * 128) prefetch_l2(pr + off);
  }

  // (the copies above are issued while the q loads are in flight)
#pragma unroll
  for (int e = 0; e < FE; ++e)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      fv[e][r][0] *= qk_scale;
      fv[e][r][1] *= qk_scale;
      if (!(RBF && e >= 4)) amax = fmaxf(amax, fmaxf(fabsf(fv[e][r][0]), fabsf(fv[e][r][1])));  // fp16 entries
    }
  float qs = 1.f, sfac = 1.f;  // q' = q * qk_scale * qs (fp16); S multiplier 2^e = sfac
  if (!prot_split) {
#pragma unroll
    for (int o = 16; o; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if (lane == 0) sm.red[w] = amax;
    __syncthreads();
    amax = sm.red[0];
#pragma unroll
    for (int i = 1; i < NW; ++i) amax = fmaxf(amax, sm.red[i]);
    if (amax > 0.f && amax < INFINITY) {
      int ex;
      frexpf(amax, &ex);  // amax < 2^ex
      qs = ldexpf(1.f, 14 - ex);
      sfac = ldexpf(1.f, ex - 14);
    }
  }
  // Round (body: fp16 of q * qk_scale * qs / 2^shift; protected: bf16) and store; body entries also give
  // each k step's sum of the effective q' times 2^shift per head (lanes t reduce by shuffles), for qsum.
#pragma unroll
  for (int e = 0; e < FE; ++e) {
    const int i = tid + e * NTHREADS, ks = i >> 5;
    if (ks >= KS) continue;  // warp-uniform
    uint32_t a[4];
    if (prot_split || (RBF && e >= 4)) {  // bf16, unscaled
#pragma unroll
      for (int r = 0; r < 4; ++r) a[r] = pack_bf16(fv[e][r][0], fv[e][r][1]);
    } else if constexpr (FP8) {  // fp16 q * qk_scale * qs
#pragma unroll
      for (int r = 0; r < 4; ++r) a[r] = pack_f16(fv[e][r][0] * qs, fv[e][r][1] * qs);
    } else {
      float part[2] = {0.f, 0.f};
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int shift = (e < 4 ? q_slot<false>(ks, t, r >> 1) : q_slot<true>(ks, t, r >> 1)).shift;
        const float down = __int_as_float((127 - shift) << 23), up = __int_as_float((127 + shift) << 23);
        const __half2 hv = __floats2half2_rn(fv[e][r][0] * qs * down, fv[e][r][1] * qs * down);
        a[r] = *reinterpret_cast<const uint32_t*>(&hv);
        const float2 back = __half22float2(hv);
        part[r & 1] += (back.x + back.y) * up;  // exact: the effective value times 2^shift
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        part[r] += __shfl_xor_sync(0xffffffffu, part[r], 1);
        part[r] += __shfl_xor_sync(0xffffffffu, part[r], 2);
      }
      if (t == 0) {
        sm.xu.qks[ks][g] = part[0];
        sm.xu.qks[ks][g + 8] = part[1];
      }
    }
    sm.qf[i] = make_uint4(a[0], a[1], a[2], a[3]);
  }
  if (!prot_split && !FP8) {
    __syncthreads();
    for (int i = tid; i < 16 * 16; i += NTHREADS) {
      const int h = i >> 4, G = i & 15;
      float s = 0.f;
      if (G < NG) {
        const int k0 = G < NGC ? 4 * G : KSC + (G - NGC) * (RG / 16), kn = G < NGC ? 4 : RG / 16;
        for (int k = k0; k < k0 + kn; ++k) s += sm.xu.qks[k][h];
      }
      sm.qsum[h][G] = s * 0.015625f;  // 2^-6 keeps it inside fp16's range
    }
    for (int i = tid; i < (int)(sizeof(sm.zh) / 16); i += NTHREADS) reinterpret_cast<uint4*>(&sm.zh[0][0])[i] = make_uint4(0u, 0u, 0u, 0u);
    __syncthreads();
    if (w == 0) {
      uint32_t hi[4], lo[4];
#pragma unroll
      for (int r = 0; r < 4; ++r) {  // a0 (row g, groups 2t, 2t+1), a1 (row g+8), a2 (row g, 2t+8..), a3
        const int h = g + 8 * (r & 1), G = 2 * t + 8 * (r >> 1);
        const float v0 = sm.qsum[h][G], v1 = sm.qsum[h][G + 1];
        const float h0f = __half2float(__float2half_rn(v0)), h1f = __half2float(__float2half_rn(v1));
        hi[r] = pack_f16(h0f, h1f);
        lo[r] = pack_f16(v0 - h0f, v1 - h1f);
      }
      sm.qzf[0][lane] = make_uint4(hi[0], hi[1], hi[2], hi[3]);
      sm.qzf[1][lane] = make_uint4(lo[0], lo[1], lo[2], lo[3]);
    }
  }
  __syncthreads();

  float o[8][4], corr[4], wacc[4];
#pragma unroll
  for (int i = 0; i < 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  corr[0] = corr[1] = corr[2] = corr[3] = 0.f;
  wacc[0] = wacc[1] = wacc[2] = wacc[3] = 0.f;
  float m_i[2] = {-INFINITY, -INFINITY}, l_i[2] = {0.f, 0.f};

  // Softmax of this warp's scores x (NJ n8 tiles; rows g, g+8; columns 2t, 2t+1), P to shared memory. P is
  // taken against the running max m_i, the same in every warp, and may reach 2^MARGIN (bf16 and the fp32
  // sums hold that easily). P is stored first and the barrier that publishes it also votes: only a tile whose
  // scores pass m_i + MARGIN somewhere (the first tile always) then exchanges its max through shared memory,
  // rescales the accumulators and stores P again. A common tile costs one barrier.
  auto softmax = [&](float (&x)[NJ][4]) {
    constexpr float MARGIN = FP8 ? 8.f : 16.f;
    const bool p16 = FP8 && !prot_split;  // the fp8 body's values take P in fp16
    float mloc[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      mloc[0] = fmaxf(mloc[0], fmaxf(x[j][0], x[j][1]));
      mloc[1] = fmaxf(mloc[1], fmaxf(x[j][2], x[j][3]));
    }
    float ls[2];
    uint32_t pk[NJ][2];
    auto store_p = [&]() {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        ls[r] = 0.f;
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
          const float p0 = exp2f(x[j][2 * r] - m_i[r]), p1 = exp2f(x[j][2 * r + 1] - m_i[r]);
          ls[r] += p0 + p1;
          pk[j][r] = p16 ? pack_f16(p0, p1) : pack_bf16(p0, p1);
        }
      }
      // n8 tile jt is half jt & 1 of values k step jt / 2: registers 2 (jt & 1) (row g) and + 1 (row g + 8)
#pragma unroll
      for (int j = 0; j < NJ; ++j)
        reinterpret_cast<uint2*>(&sm.pf[(jt0 + j) >> 1][lane])[(jt0 + j) & 1] = make_uint2(pk[j][0], pk[j][1]);
    };
    store_p();
    if (__syncthreads_or(mloc[0] > m_i[0] + MARGIN || mloc[1] > m_i[1] + MARGIN)) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        mloc[r] = fmaxf(mloc[r], __shfl_xor_sync(0xffffffffu, mloc[r], 1));
        mloc[r] = fmaxf(mloc[r], __shfl_xor_sync(0xffffffffu, mloc[r], 2));
      }
      if (t == 0) {
        sm.mx[g][w] = mloc[0];
        sm.mx[g + 8][w] = mloc[1];
      }
      __syncthreads();
      float alpha[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int h = g + 8 * r;
        float mt = sm.mx[h][0];
#pragma unroll
        for (int ww = 1; ww < NW; ++ww) mt = fmaxf(mt, sm.mx[h][ww]);
        const float m_new = fmaxf(m_i[r], mt);  // finite: every tile holds a valid token
        alpha[r] = exp2f(m_i[r] - m_new);
        m_i[r] = m_new;
        l_i[r] *= alpha[r];
      }
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        o[i][0] *= alpha[0]; o[i][1] *= alpha[0]; o[i][2] *= alpha[1]; o[i][3] *= alpha[1];
      }
      corr[0] *= alpha[0]; corr[1] *= alpha[0]; corr[2] *= alpha[1]; corr[3] *= alpha[1];
      wacc[0] *= alpha[0]; wacc[1] *= alpha[0]; wacc[2] *= alpha[1]; wacc[3] *= alpha[1];
      store_p();
      __syncthreads();
    }
    l_i[0] += ls[0];
    l_i[1] += ls[1];
  };

  // A fragment of P for tokens [16 ks, 16 ks + 16).
  auto p_frag = [&](int ks, uint32_t (&pa)[4]) {
    const uint4 v = sm.pf[ks][lane];
    pa[0] = v.x;
    pa[1] = v.y;
    pa[2] = v.z;
    pa[3] = v.w;
  };

  if (!prot_split) {
    // ---- body tiles
    const float ssc = sfac * 16777216.f;  // 2^(24+e)
    auto store_sz = [&](int tt) {  // invalid tokens get scale 0, zero 0 (their pool rows may hold NaN)
      const int pos = (tt + t_lo) * NT + sz_tok;
      const bool ok = pos >= sink && pos < q_hi;
      const int buf = tt & 1;
      if constexpr (FP8) {  // scores: scale * 2^e; values: fp16 scale
#pragma unroll
        for (int k = 0; k < NSF; ++k) {
          const int G = sz_g0 + k * SZT;
          if (NCS % SZT && G >= NCS) continue;
          const float sc = ok ? lf_[k] : 0.f;
          sm.scf[buf][G * SZS + sz_tok] = sc * sfac;
          sm.scb[buf][G * SZS + vpos(sz_tok)] = __half_as_ushort(__float2half_rn(sc));
        }
        return;
      }
      constexpr float mid = (float)(1 << (CB - 1));
#pragma unroll
      for (int k = 0; k < NSZ; ++k) {
        const int G = k < 2 ? sz_g0 + k * SZT : NGC + sz_g0 + (k - 2) * SZT;
        if (k >= 2 && G >= NG) continue;
        const float sc = ok ? __half2float(ls_[k]) : 0.f, z = ok ? __half2float(lz_[k]) : 0.f;
        sm.scf[buf][G * SZS + sz_tok] = sc * ssc;
        sm.zh[buf][sz_tok * ZS + G] = __float2half_rn(z);
        if (k < 2) {
          sm.scb[buf][G * SZS + vpos(sz_tok)] = __bfloat16_as_ushort(__float2bfloat16_rn(sc));
          const float zc = z + mid * sc;
          const __nv_bfloat16 zhb = __float2bfloat16_rn(zc);
          sm.zch[buf][G * SZS + vpos(sz_tok)] = zhb;
          sm.zcl[buf][G * SZS + vpos(sz_tok)] = __float2bfloat16_rn(zc - __bfloat162float(zhb));
        }
      }
    };
    const float zfac = sfac * 64.f;  // Z was computed with qsum 2^-6
    store_sz(tb);
    for (int tt = tb; tt < te; ++tt) {
      cp_wait<STAGES - 2>();
      __syncthreads();  // tile tt's codes and scales are in; everyone is done with tile tt-1
      issue(tt + STAGES - 1, tile_row(tt + STAGES - 1, nxt[STAGES - 2]));
      load_sz(tile_row(tt + 1, nxt[0]));
#pragma unroll
      for (int i = 0; i < STAGES - 2; ++i) nxt[i] = nxt[i + 1];
      nxt[STAGES - 2] = tile_blk(tt + STAGES);
      const int pos0 = (tt + t_lo) * NT;
      const int vlo = max(sink - pos0, 0), vhi = min(q_hi - pos0, NT);
      const uint8_t* scc = sm.ring.cc[tt % STAGES];
      const uint8_t* src = sm.ring.rc[tt % STAGES];
      const int buf = tt & 1;
      if constexpr (FP8) {  // an edge tile: rows outside [vlo, vhi) may hold e4m3 NaNs, which P = 0 would not cancel
        if (vlo > 0 || vhi < NT) {
          constexpr int CPR = CROWB / 16;
          for (int i = tid; i < NT * CPR; i += NTHREADS) {
            const int row = i / CPR;
            if (row < vlo || row >= vhi)
              *reinterpret_cast<uint4*>(sm.ring.cc[tt % STAGES] + row * CRS + 16 * (i % CPR)) = make_uint4(0u, 0u, 0u, 0u);
          }
          __syncthreads();
        }
      }

      // ---- scores: this warp's two n8 tiles (quarter w % NQ) over its channel slice; with two slices the
      // warps of a quarter hand each other the partial sums of the tile the other keeps (jt0)
      float x[NJ][4];
      {
        float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
        float keep[4];
        const int tq = 16 * (w % NQ);  // the quarter's first token
        auto slice = [&](auto csc) {
          constexpr int cs = decltype(csc)::value;
          if constexpr (FP8) {
#pragma unroll
            for (int gi = 0; gi < NGC / CS; ++gi) {
              const int G = cs * (NGC / CS) + gi;
              fp8_group_scores(s, scc + (tq + g) * CRS + G * CGB + 4 * t, 8 * CRS, &sm.qf[4 * G * 32 + lane], 0, 4,
                               CG ? &sm.scf[buf][(G * 64 / CGS) * SZS + tq + 2 * t] : nullptr, sfac);
            }
            constexpr int KSL = KSR / CS;
            const int ks0 = cs * KSL;  // this slice's first rope k step
            if constexpr (RBF) {  // bf16 rope: plain order, unscaled bf16 q, straight into s
#pragma unroll
              for (int kk = 0; kk < KSL; ++kk) {
                const uint4 a = sm.qf[(KSC + ks0 + kk) * 32 + lane];
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                  const uint8_t* rp = src + (tq + g + 8 * j) * RRS + 32 * (ks0 + kk) + 4 * t;
                  mma_bf16(s[j], a, *reinterpret_cast<const uint32_t*>(rp), *reinterpret_cast<const uint32_t*>(rp + 16));
                }
              }
            } else {
              fp8_group_scores(s, src + (tq + g) * RRS + 4 * t, 8 * RRS, &sm.qf[(KSC + ks0) * 32 + lane], ks0, KSL,
                               nullptr, sfac);
            }
          } else {
#pragma unroll
          for (int gi = 0; gi < NGC / CS; ++gi) {
            const int G = cs * (NGC / CS) + gi;
            group_scores<CB, WTC>(s, scc + (tq + g) * CRS + G * CGB + t * 4 * WTC, 8 * CRS, &sm.qf[4 * G * 32 + lane], 0,
                                  4, &sm.scf[buf][G * SZS + tq + 2 * t]);
          }
          constexpr int KPG = RG / 16, KSL = KSR / CS, KC = KPG < KSL ? KPG : KSL;  // a run stays in one group
#pragma unroll
          for (int c = 0; c < KSL / KC; ++c) {
            const int ks = cs * KSL + c * KC, G = ks / KPG;  // rope k step, rope group
            group_scores<RB, WTR>(s, src + (tq + g) * RRS + G * RGB + t * 4 * WTR, 8 * RRS,
                                  &sm.qf[(KSC + ks) * 32 + lane], ks % KPG, KC, &sm.scf[buf][(NGC + G) * SZS + tq + 2 * t]);
          }
          }
          if constexpr (CS > 1) {
            sm.xu.xs[w * 32 + lane] = make_float4(s[1 - cs][0], s[1 - cs][1], s[1 - cs][2], s[1 - cs][3]);
#pragma unroll
            for (int e = 0; e < 4; ++e) keep[e] = s[cs][e];
          }
        };
        if (CS == 1 || w < NQ) slice(IntC<0>{});
        else slice(IntC<CS - 1>{});
        if constexpr (CS > 1) {
          bar_sync(1 + w % NQ, 64);  // the partner's partial sums are in (only the two warps of a quarter wait)
          const float4 o = sm.xu.xs[((w + NQ) % NW) * 32 + lane];
          s[0][0] = keep[0] + o.x; s[0][1] = keep[1] + o.y; s[0][2] = keep[2] + o.z; s[0][3] = keep[3] + o.w;
        }
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
          const int n0 = 8 * (jt0 + j), tok = n0 + g;
          float z[4] = {0.f, 0.f, 0.f, 0.f};
          if constexpr (!FP8) {
            const uint32_t zb0 = *reinterpret_cast<const uint32_t*>(&sm.zh[buf][tok * ZS + 2 * t]);
            const uint32_t zb1 = *reinterpret_cast<const uint32_t*>(&sm.zh[buf][tok * ZS + 2 * t + 8]);
            mma_f16(z, sm.qzf[0][lane], zb0, zb1);
            mma_f16(z, sm.qzf[1][lane], zb0, zb1);
          }
          const int c0 = n0 + 2 * t;
          const bool v0 = c0 >= vlo && c0 < vhi, v1 = c0 + 1 >= vlo && c0 + 1 < vhi;
          x[j][0] = v0 ? s[j][0] + zfac * z[0] : -INFINITY; x[j][1] = v1 ? s[j][1] + zfac * z[1] : -INFINITY;
          x[j][2] = v0 ? s[j][2] + zfac * z[2] : -INFINITY; x[j][3] = v1 ? s[j][3] + zfac * z[3] : -INFINITY;
        }
      }
      softmax(x);

      // ---- values: content group w, all 64 tokens
#pragma unroll
      for (int ks = 0; ks < NT / 16; ++ks) {
        const int k0 = 16 * ks + 2 * t;  // this lane's tokens: k0, k0+1 (b0 / a01), k0+8, k0+9 (b1 / a23)
        const int v0 = 16 * ks + 4 * t;  // their vpos: v0 .. v0 + 3
        uint32_t pa[4];
        p_frag(ks, pa);
        if constexpr (FP8) {  // O += (P scale) . code, fp16; byte jn of the lane's 8 is tile jn's column g
          uint32_t a[4] = {pa[0], pa[1], pa[2], pa[3]};
          if constexpr (CG > 0) {
            const uint2 sv = *reinterpret_cast<const uint2*>(&sm.scb[buf][(w * 64 / CGS) * SZS + v0]);
            a[0] = hmul2(pa[0], sv.x); a[1] = hmul2(pa[1], sv.x); a[2] = hmul2(pa[2], sv.y); a[3] = hmul2(pa[3], sv.y);
          }
          uint2 cw[4];  // tokens k0, k0+1, k0+8, k0+9: channels 64 w + 8 g + [0, 8)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            cw[e] = *reinterpret_cast<const uint2*>(scc + (k0 + (e & 1) + 8 * (e >> 1)) * CRS + w * CGB + 8 * g);
#pragma unroll
          for (int h = 0; h < 2; ++h) {  // channels 4 h .. 4 h + 3
            const uint32_t t0 = h ? cw[0].y : cw[0].x, t1 = h ? cw[1].y : cw[1].x;
            const uint32_t t2 = h ? cw[2].y : cw[2].x, t3 = h ? cw[3].y : cw[3].x;
#pragma unroll
            for (int q = 0; q < 2; ++q) {  // channel pair 4 h + 2 q, + 1: bytes (k0, k0+1) of each
              const uint32_t sel = q ? 0x7362 : 0x5140;
              uint32_t b0[2], b1[2];
              e4m3x4_f16(__byte_perm(t0, t1, sel), b0[0], b0[1]);
              e4m3x4_f16(__byte_perm(t2, t3, sel), b1[0], b1[1]);
              mma_f16(o[4 * h + 2 * q], make_uint4(a[0], a[1], a[2], a[3]), b0[0], b1[0]);
              mma_f16(o[4 * h + 2 * q + 1], make_uint4(a[0], a[1], a[2], a[3]), b0[1], b1[1]);
            }
          }
          continue;
        }
        if (ks == w % NQ) {  // W: B column g = group g; warp w takes k step w % NQ, the hi and / or lo part
          const bool hi = CS == 1 || w < NQ, lo = CS == 1 || w >= NQ;
          if (hi) {
            const uint2 z = g < NGC ? *reinterpret_cast<const uint2*>(&sm.zch[buf][g * SZS + v0]) : make_uint2(0u, 0u);
            mma_bf16(wacc, pa, z.x, z.y);
          }
          if (lo) {
            const uint2 z = g < NGC ? *reinterpret_cast<const uint2*>(&sm.zcl[buf][g * SZS + v0]) : make_uint2(0u, 0u);
            mma_bf16(wacc, pa, z.x, z.y);
          }
        }
        const uint2 sv = *reinterpret_cast<const uint2*>(&sm.scb[buf][w * SZS + v0]);
        const uint32_t s0 = sv.x, s1 = sv.y;
        uint32_t a[4];
        a[0] = bmul2(pa[0], s0); a[1] = bmul2(pa[1], s0); a[2] = bmul2(pa[2], s1); a[3] = bmul2(pa[3], s1);
        mma_bf16(corr, a, KMID, KMID);
        uint32_t cw[4];  // this lane's word (8 / bits bytes of group w) of tokens k0, k0+1, k0+8, k0+9
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int tok = k0 + (e & 1) + 8 * (e >> 1);
          if constexpr (CB == 4) cw[e] = *reinterpret_cast<const uint32_t*>(scc + tok * CRS + w * CGB + 4 * g);
          else cw[e] = *reinterpret_cast<const uint16_t*>(scc + tok * CRS + w * CGB + 2 * g);
        }
        const uint32_t y01a = __byte_perm(cw[0], cw[1], 0x5410), y23a = __byte_perm(cw[2], cw[3], 0x5410);
        uint32_t y01b = 0, y23b = 0;
        if constexpr (CB == 4) {
          y01b = __byte_perm(cw[0], cw[1], 0x7632);
          y23b = __byte_perm(cw[2], cw[3], 0x7632);
        }
#pragma unroll
        for (int jn = 0; jn < 8; ++jn) {  // tile jn: bit CB * jn of the lane's bytes
          const int bit = CB * jn;
          const uint32_t b0 = codes2<CB>(bit < 16 ? y01a : y01b, bit & 15);
          const uint32_t b1 = codes2<CB>(bit < 16 ? y23a : y23b, bit & 15);
          mma_bf16(o[jn], a, b0, b1);
        }
      }
      store_sz(tt + 1);
    }
    cp_wait<0>();
  } else {
    // ---- protected rows: bf16, straight from global memory
    const int n_p = min(L, window);
    const long long row_base = (long long)slots_ptr[b] * window;
    for (int tt = tb; tt < te; ++tt) {
      __syncthreads();  // the shared P of the last tile is free
      const long long r0 = row_base + (long long)tt * NT;
      const int nv = min(n_p - tt * NT, NT);  // valid rows of the tile (>= 1)
      const __nv_bfloat16* gpc = pc_ptr + r0 * DC;
      const __nv_bfloat16* gpr = pr_ptr + r0 * DR;
      float x[NJ][4];
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        const int n0 = 8 * (jt0 + j);
        const int tok = min(n0 + g, nv - 1);
        float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 12
        for (int ks = 0; ks < KS; ++ks) {
          const __nv_bfloat16* rp = ks < KSC ? gpc + (long long)tok * DC + 16 * ks : gpr + (long long)tok * DR + 16 * (ks - KSC);
          mma_bf16(s, sm.qf[ks * 32 + lane], ld_u32(rp + 2 * t), ld_u32(rp + 2 * t + 8));
        }
        const int c0 = n0 + 2 * t;
        const bool v0 = c0 < nv, v1 = c0 + 1 < nv;
        x[j][0] = v0 ? s[0] : -INFINITY; x[j][1] = v1 ? s[1] : -INFINITY;
        x[j][2] = v0 ? s[2] : -INFINITY; x[j][3] = v1 ? s[3] : -INFINITY;
      }
      softmax(x);
#pragma unroll
      for (int ks = 0; ks < NT / 16; ++ks) {
        const int k0 = 16 * ks + 2 * t;
        uint32_t pa[4];
        p_frag(ks, pa);
        uint4 u[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int tok = min(k0 + (e & 1) + 8 * (e >> 1), nv - 1);
          u[e] = ld_u4(gpc + (long long)tok * DC + 64 * w + 8 * g);
        }
#pragma unroll
        for (int jn = 0; jn < 8; ++jn) {
          const uint32_t sel = (jn & 1) ? 0x7632 : 0x5410;
          const uint32_t b0 = __byte_perm(word_of(u[0], jn / 2), word_of(u[1], jn / 2), sel);
          const uint32_t b1 = __byte_perm(word_of(u[2], jn / 2), word_of(u[3], jn / 2), sel);
          mma_bf16(o[jn], pa, b0, b1);
        }
      }
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
    sm.lsum[g][w] = l_i[0];
    sm.lsum[g + 8][w] = l_i[1];
  }
  // this warp's part of W [head][group]: C fragment rows g, g+8, columns 2t, 2t+1 (the exchange buffer is free)
  sm.xu.wz[w][g][2 * t] = wacc[0];
  sm.xu.wz[w][g][2 * t + 1] = wacc[1];
  sm.xu.wz[w][g + 8][2 * t] = wacc[2];
  sm.xu.wz[w][g + 8][2 * t + 1] = wacc[3];
  __syncthreads();
  const long long prow = ((long long)b * nst + split) * H;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int h = g + 8 * r;
    float l = 0.f;
#pragma unroll
    for (int ww = 0; ww < NW; ++ww) l += sm.lsum[h][ww];
    const bool ok = l > 0.f;
    const float inv = ok ? 1.f / l : 0.f;
    if (w == 0 && t == 0 && h0 + h < H)
      plse_ptr[prow + h0 + h] = ok ? (m_i[r] + log2f(l)) * 0.6931471805599453f : -INFINITY;
    float wsum = 0.f;
#pragma unroll
    for (int ww = 0; ww < NW; ++ww) wsum += sm.xu.wz[ww][h][w];
    const float add = prot_split || FP8 ? 0.f : wsum - corr[2 * r];
    if (h0 + h < H) {
      float* dst = po_ptr + (prow + h0 + h) * DC + 64 * w + 16 * t;
      float v[16];
#pragma unroll
      for (int jn = 0; jn < 8; ++jn) {
        v[jn] = (o[jn][2 * r] + add) * inv;          // column 2t: channel 16t + jn
        v[8 + jn] = (o[jn][2 * r + 1] + add) * inv;  // column 2t+1: channel 16t + 8 + jn
      }
#pragma unroll
      for (int q = 0; q < 4; ++q)
        reinterpret_cast<float4*>(dst)[q] = make_float4(v[4 * q], v[4 * q + 1], v[4 * q + 2], v[4 * q + 3]);
    }
  }
}
