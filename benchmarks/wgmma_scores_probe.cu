// Probe: the scores half of a 16-head INT4 decode with wgmma and the codes as register A operands
// (benchmarks/wgmma_scores_probe.py builds, checks and times it; sm_90a).
//
// S[t, h] = 2^24 * sum_g scale[t, g] * acc_g[t, h], acc_g = sum over the 64 channels of group g of
// A[t, k] * B[k, h], for 9 groups (8 content + 1 rope) of 64 int4 channels.
//   A: m64n16k16 register fragments made from the code bytes by AND (and one shift per word): a nibble at bits
//      [0, 4) of a 16-bit half is the fp16 subnormal code * 2^-24, at bits [4, 8) 16 * code * 2^-24.
//   B: q in shared memory, permuted to the fragments' channel order and divided by 16 on the high nibbles
//      (`stage_q` in the .py writes that image: [group][k step][n8 block][k half][8 rows][8 fp16], no swizzle).
// One CTA = one warpgroup; it walks tiles of 64 tokens (rows of 288 code bytes: 9 groups x 32 B), the next
// tile's codes and scales loaded into registers while this one's MMAs run, 3 groups' MMAs per batch.
// Thread (warp w, lane l), t = l % 4: tokens 16 w + l / 4 and + 8 of the tile; per group it loads bytes
// [8 t, 8 t + 8) of both rows (channels 16 t .. 16 t + 15): word x (bytes 0-3) makes k steps 0 and 1, y
// steps 2 and 3. In k step s the fragment's k slot 2 t + e holds channel 16 t + 8 (s / 2) + 2 (s % 2) + 4 e,
// slot 2 t + 8 + e the next channel (the high nibble, x 16).
#include <cuda_fp16.h>
#include <stdint.h>

#define NG 9
#ifndef RING
#define RING 0  // 0: each tile's codes and scales go to registers one tile ahead; n > 0: by cp.async into an n-slot
                // shared-memory ring (dynamic shared memory, RING * STAGE_BYTES), n - 1 tiles ahead
#endif
#define STAGE_BYTES (64 * ROW + 64 * NG * 4)
#ifndef MIN_CTAS
#define MIN_CTAS 1  // __launch_bounds__ minimum CTAs per SM (3 caps registers at 168)
#endif
#define ROW 288

__device__ __forceinline__ void fence_operand(uint32_t& r) { asm volatile("" : "+r"(r)::"memory"); }
__device__ __forceinline__ void fence_operand(float& r) { asm volatile("" : "+f"(r)::"memory"); }

__device__ __forceinline__ uint64_t desc(const void* smem_ptr, int lbo, int sbo) {
  // no swizzle, K-major: core matrices of 8 rows x 16 B (the image puts the next one along K 128 B on and the
  // next 8 rows along N 256 B on; which of the two offsets is which is the probe's argument)
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem_ptr));
  uint64_t d = 0;
  d |= (uint64_t)((addr & 0x3FFFF) >> 4);
  d |= (uint64_t)((lbo >> 4) & 0x3FFF) << 16;
  d |= (uint64_t)((sbo >> 4) & 0x3FFF) << 32;
  return d;  // layout type 0 (interleave / none), base offset 0
}

__device__ __forceinline__ void wgmma_16(float (&d)[8], const uint32_t (&a)[4], uint64_t b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9,%10,%11}, %12, p, 1, 1, 0;\n}"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
}

extern "C" __global__ void __launch_bounds__(128, MIN_CTAS) scores_probe(const uint8_t* __restrict__ codes,
                                                             const float* __restrict__ scale,  // [tokens, 9]
                                                             const uint4* __restrict__ q_image,  // 18 KB
                                                             float* __restrict__ out, int ntiles, int write, int lbo,
                                                             int sbo) {
  __shared__ __align__(128) uint4 qs[NG * 4 * 32];  // 9 groups x 4 k steps x 512 B
  const int tid = threadIdx.x, w = tid >> 5, l = tid & 31, t = l & 3, g4 = l >> 2;
  for (int i = tid; i < NG * 4 * 32; i += 128) qs[i] = q_image[i];
  asm volatile("fence.proxy.async.shared::cta;");
  __syncthreads();
  float check = 0.f;
#if RING == 0
  // codes and scales of a tile: loaded one tile ahead (registers), so their latency hides behind the MMAs
  uint2 c0[NG], c1[NG];
  float s0[NG], s1[NG];
  auto load = [&](int tile) {
    const long long r0 = (long long)tile * 64 + 16 * w + g4, r1 = r0 + 8;
#pragma unroll
    for (int g = 0; g < NG; ++g) {
      c0[g] = __ldg(reinterpret_cast<const uint2*>(codes + r0 * ROW + 8 * t + 32 * g));
      c1[g] = __ldg(reinterpret_cast<const uint2*>(codes + r1 * ROW + 8 * t + 32 * g));
      s0[g] = __ldg(scale + r0 * NG + g);
      s1[g] = __ldg(scale + r1 * NG + g);
    }
  };
  if (blockIdx.x < ntiles) load(blockIdx.x);
  for (int tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
    const long long r0 = (long long)tile * 64 + 16 * w + g4, r1 = r0 + 8;
    uint2 k0[NG], k1[NG];
    float q0[NG], q1[NG];
#pragma unroll
    for (int g = 0; g < NG; ++g) {
      k0[g] = c0[g]; k1[g] = c1[g]; q0[g] = s0[g] * 16777216.f; q1[g] = s1[g] * 16777216.f;
    }
    if (tile + gridDim.x < ntiles) load(tile + gridDim.x);
#else
  extern __shared__ __align__(16) uint8_t ring[];
  auto issue = [&](int k, int tile) {  // the CTA's k-th tile into slot k % RING; one commit group either way
    if (tile < ntiles) {
      uint8_t* dst = ring + (k % RING) * STAGE_BYTES;
      const uint8_t* src = codes + (long long)tile * 64 * ROW;
      for (int i = tid; i < 64 * ROW / 16; i += 128)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"((uint32_t)__cvta_generic_to_shared(dst + 16 * i)),
                     "l"(src + 16 * i));
      const uint8_t* ssrc = reinterpret_cast<const uint8_t*>(scale + (long long)tile * 64 * NG);
      for (int i = tid; i < 64 * NG * 4 / 16; i += 128)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"((uint32_t)__cvta_generic_to_shared(
                         dst + 64 * ROW + 16 * i)), "l"(ssrc + 16 * i));
    }
    asm volatile("cp.async.commit_group;");
  };
#pragma unroll
  for (int k = 0; k < RING - 1; ++k) issue(k, blockIdx.x + k * gridDim.x);
  int k = 0;
  for (int tile = blockIdx.x; tile < ntiles; tile += gridDim.x, ++k) {
    asm volatile("cp.async.wait_group %0;" ::"n"(RING - 2));
    __syncthreads();  // tile k is in; every thread is done with tile k - 1's slot
    issue(k + RING - 1, tile + (RING - 1) * gridDim.x);
    const long long r0 = (long long)tile * 64 + 16 * w + g4, r1 = r0 + 8;
    const uint8_t* st = ring + (k % RING) * STAGE_BYTES;
    const int l0 = 16 * w + g4, l1 = l0 + 8;
    uint2 k0[NG], k1[NG];
    float q0[NG], q1[NG];
#pragma unroll
    for (int g = 0; g < NG; ++g) {
      k0[g] = *reinterpret_cast<const uint2*>(st + l0 * ROW + 8 * t + 32 * g);
      k1[g] = *reinterpret_cast<const uint2*>(st + l1 * ROW + 8 * t + 32 * g);
      q0[g] = reinterpret_cast<const float*>(st + 64 * ROW)[l0 * NG + g] * 16777216.f;
      q1[g] = reinterpret_cast<const float*>(st + 64 * ROW)[l1 * NG + g] * 16777216.f;
    }
#endif
    float s[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) s[e] = 0.f;
#pragma unroll
    for (int gb = 0; gb < NG; gb += 3) {  // 3 groups per batch of MMAs: 3 accumulators of 8
      float acc[3][8];
#pragma unroll
      for (int i = 0; i < 3; ++i) {
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[i][e] = 0.f;
      }
      uint32_t a[3][4][4];
#pragma unroll
      for (int i = 0; i < 3; ++i) {
#pragma unroll
        for (int st = 0; st < 4; ++st) {
          const uint32_t x0 = st < 2 ? k0[gb + i].x : k0[gb + i].y, x1 = st < 2 ? k1[gb + i].x : k1[gb + i].y;
          const uint32_t y0 = (st & 1) ? x0 >> 8 : x0, y1 = (st & 1) ? x1 >> 8 : x1;
          a[i][st][0] = y0 & 0x000F000Fu;  // row r0, slots 2t, 2t+1
          a[i][st][1] = y1 & 0x000F000Fu;  // row r1
          a[i][st][2] = y0 & 0x00F000F0u;  // row r0, slots 2t+8, 2t+9
          a[i][st][3] = y1 & 0x00F000F0u;  // row r1
        }
      }
      asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
      for (int i = 0; i < 3; ++i) {
#pragma unroll
        for (int st = 0; st < 4; ++st)
          wgmma_16(acc[i], a[i][st], desc(&qs[((gb + i) * 4 + st) * 32], lbo, sbo), st > 0);
      }
      asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
      asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
#pragma unroll
      for (int i = 0; i < 3; ++i) {
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          fence_operand(acc[i][e]);
          // accumulator e: row r0 for e % 4 < 2, r1 otherwise; column 2t + (e & 1) + 8 (e / 4)
          s[e] = fmaf((e & 2) ? q1[gb + i] : q0[gb + i], acc[i][e], s[e]);
        }
      }
    }
    if (write) {
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const long long r = (e & 2) ? r1 : r0;
        out[r * 16 + 2 * t + (e & 1) + 8 * (e >> 2)] = s[e];
      }
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) check += s[e];
    }
  }
  if (!write) out[blockIdx.x * 128 + tid] = check;
}
