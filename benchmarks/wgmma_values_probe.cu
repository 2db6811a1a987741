// Probe: the values half of a 16-head INT4 decode with wgmma and the codes as register A operands
// (benchmarks/wgmma_values_probe.py builds, checks and times it; sm_90a). The other half:
// wgmma_scores_probe.cu.
//
// O^T [512 channels, 16 heads] = sum over tiles and groups g of V_g^T [64 channels of g, 64 tokens] .
// P'_g [64 tokens, 16 heads], with P'_g[t, h] = P[t, h] * scale[t, g]: the scale is constant down a group's
// channels, so it goes into the B operand and A is the raw codes. One m64 block of O^T per group.
//   A: the thread (warp w, lane l, t = l % 4) holds rows m = 16 w + l / 4 (the low nibble of the group's byte
//      b = 8 w + l / 4: channel 2 b) and m + 8 (its high nibble: channel 2 b + 1, x 16); its k slots 2t, 2t+1,
//      2t+8, 2t+9 are the tokens 4t .. 4t+3 of the k step (a dot product does not care how k is ordered; B's
//      rows are permuted the same way). So it needs byte b of 4 consecutive tokens: the probe's input is the
//      codes byte-transposed within each tile, [tile][group][byte][64 tokens], and that is one 4-byte load.
//      prmt puts two tokens' bytes in the two halves, AND makes the fp16 subnormals (code * 2^-24, x 16 on
//      the high nibble).
//   B: P'_g in shared memory, K-major without swizzle ([group][k step][n8 block][k half][8 heads][8 slots]),
//      written by each thread for its own tokens (rows 16 w + l / 4, + 8 of the tile) and heads 2t, 2t+1, 2t+8,
//      2t+9 (the softmax's accumulator layout in the scores probe), double-buffered across tiles.
// The codes come through a RING-slot cp.async ring. Not included: the zero term, the softmax itself.
#include <cuda_fp16.h>
#include <stdint.h>

#define NGC 8
#ifndef RING
#define RING 3
#endif
#ifndef PMN
#define PMN 0  // 1: P' stored MN-major (heads contiguous: two heads per 4-byte store), B read transposed
#endif
#ifndef LBO
#define LBO 128  // the B descriptor's leading / stride byte offsets
#endif
#ifndef SBO
#define SBO 256
#endif
#define TILE_BYTES (NGC * 32 * 64)
#define STAGE_BYTES (TILE_BYTES + 64 * 16 * 4 + 64 * NGC * 4)  // codes, P (fp32), scales (fp32)

__device__ __forceinline__ void fence_operand(float& r) { asm volatile("" : "+f"(r)::"memory"); }

__device__ __forceinline__ uint64_t desc(const void* smem_ptr) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem_ptr));
  return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)(LBO >> 4) << 16) | ((uint64_t)(SBO >> 4) << 32);
}

__device__ __forceinline__ void wgmma_16(float (&d)[8], const uint32_t (&a)[4], uint64_t b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9,%10,%11}, %12, p, 1, 1, %14;\n}"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate), "n"(PMN));
}

__device__ __forceinline__ void cp16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"((uint32_t)__cvta_generic_to_shared(dst)), "l"(src));
}

// The k slot of tile-local token u within its k step (tokens 4t + e -> slot 2t + e, 4t + 2 + e -> 2t + 8 + e).
__device__ __forceinline__ int slot_of(int u) { return 2 * (u >> 2) + (u & 1) + ((u & 2) ? 8 : 0); }

extern "C" __global__ void __launch_bounds__(128) values_probe(const uint8_t* __restrict__ vt,  // [tiles][8][32][64]
                                                             const float* __restrict__ p,       // [tokens, 16]
                                                             const float* __restrict__ scale,   // [tokens, 8]
                                                             float* __restrict__ out,           // [grid, 16, 512]
                                                             int ntiles) {
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* ring = smem;
  __half* pimg = reinterpret_cast<__half*>(smem + RING * STAGE_BYTES);  // [2][8 groups][4 k steps][256]
  const int tid = threadIdx.x, w = tid >> 5, l = tid & 31, t = l & 3, g4 = l >> 2;

  auto issue = [&](int k, int tile) {
    if (tile < ntiles) {
      uint8_t* dst = ring + (k % RING) * STAGE_BYTES;
      const uint8_t* src = vt + (long long)tile * TILE_BYTES;
      for (int i = tid; i < TILE_BYTES / 16; i += 128) cp16(dst + 16 * i, src + 16 * i);
      const uint8_t* ps = reinterpret_cast<const uint8_t*>(p + (long long)tile * 64 * 16);
      for (int i = tid; i < 64 * 16 * 4 / 16; i += 128) cp16(dst + TILE_BYTES + 16 * i, ps + 16 * i);
      const uint8_t* ss = reinterpret_cast<const uint8_t*>(scale + (long long)tile * 64 * NGC);
      for (int i = tid; i < 64 * NGC * 4 / 16; i += 128) cp16(dst + TILE_BYTES + 4096 + 16 * i, ss + 16 * i);
    }
    asm volatile("cp.async.commit_group;");
  };

  float acc[NGC][8];  // defined by the first tile's MMAs (scale-d 0), not by an instruction: a register that a
                     // non-wgmma instruction writes would serialize the MMAs
#pragma unroll
  for (int g = 0; g < NGC; ++g) {
#pragma unroll
    for (int e = 0; e < 8; ++e) asm volatile("" : "=f"(acc[g][e]));
  }
#pragma unroll
  for (int k = 0; k < RING - 1; ++k) issue(k, blockIdx.x + k * gridDim.x);
  int k = 0;
  for (int tile = blockIdx.x; tile < ntiles; tile += gridDim.x, ++k) {
    asm volatile("cp.async.wait_group %0;" ::"n"(RING - 2));
    asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");  // tile k - 2's MMAs (its P' buffer) are done
    __syncthreads();
    issue(k + RING - 1, tile + (RING - 1) * gridDim.x);
    const uint8_t* st = ring + (k % RING) * STAGE_BYTES;
    const float* ps = reinterpret_cast<const float*>(st + TILE_BYTES);
    const float* ss = reinterpret_cast<const float*>(st + TILE_BYTES + 4096);
    __half* pb = pimg + (k & 1) * (NGC * 4 * 256);
    // P'_g for this thread's tokens u0 = 16 w + g4, u1 = u0 + 8 (k step w) and heads 2t, 2t+1, 2t+8, 2t+9
    const int u0 = 16 * w + g4, u1 = u0 + 8;
    float pv[2][4];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int u = r ? u1 : u0;
#pragma unroll
      for (int i = 0; i < 4; ++i) pv[r][i] = ps[u * 16 + 2 * t + (i & 1) + 8 * (i >> 1)];
    }
#pragma unroll
    for (int g = 0; g < NGC; ++g) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int u = r ? u1 : u0;
        const float sc = ss[u * NGC + g];
        const int kk = slot_of(u & 15);  // K index within the k step
        if (PMN) {  // image [n8 block][k half][8 slots][8 heads]: heads 2t, 2t+1 (and + 8) in one 4-byte store
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const __half2 v = __floats2half2_rn(pv[r][2 * j] * sc, pv[r][2 * j + 1] * sc);
            *reinterpret_cast<__half2*>(&pb[(g * 4 + w) * 256 + j * 128 + (kk >> 3) * 64 + (kk & 7) * 8 + 2 * t]) = v;
          }
        } else {  // K-major image [n8 block][k half][8 heads][8 slots]
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int h = 2 * t + (i & 1) + 8 * (i >> 1);
            pb[(g * 4 + w) * 256 + (h >> 3) * 128 + (kk >> 3) * 64 + (h & 7) * 8 + (kk & 7)] = __float2half_rn(pv[r][i] * sc);
          }
        }
      }
    }
    asm volatile("fence.proxy.async.shared::cta;");
    __syncthreads();
#pragma unroll
    for (int g = 0; g < NGC; ++g) {
      uint32_t a[4][4];
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        const uint32_t word = *reinterpret_cast<const uint32_t*>(st + (g * 32 + 8 * w + g4) * 64 + 16 * s + 4 * t);
        const uint32_t x01 = __byte_perm(word, 0, 0x4140), x23 = __byte_perm(word, 0, 0x4342);
        a[s][0] = x01 & 0x000F000Fu;  // row m (low nibble), slots 2t, 2t+1
        a[s][1] = x01 & 0x00F000F0u;  // row m + 8 (high nibble)
        a[s][2] = x23 & 0x000F000Fu;  // row m, slots 2t+8, 2t+9
        a[s][3] = x23 & 0x00F000F0u;  // row m + 8
      }
      asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
      for (int s = 0; s < 4; ++s) wgmma_16(acc[g], a[s], desc(pb + (g * 4 + s) * 256), k > 0 || s > 0);
    }
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
  }
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
  // acc[g][e]: row m (e & 2 ? +8 : 0) of block g, head 2t + (e & 1) + 8 (e >> 2)
#pragma unroll
  for (int g = 0; g < NGC; ++g) {
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      fence_operand(acc[g][e]);
      const int b = 8 * w + g4, hi = (e >> 1) & 1;
      const int c = 64 * g + 2 * b + hi, h = 2 * t + (e & 1) + 8 * (e >> 2);
      out[((long long)blockIdx.x * 16 + h) * 512 + c] = acc[g][e] * (hi ? 1048576.f : 16777216.f);
    }
  }
}
