"""A negative result, kept so it need not be tried again: INT4 decode in the "integer domain" under Triton.

    python benchmarks/decode_integer_domain.py        (GPU)

Idea: never build the dequantized bf16 tile. The packed content codes go to the tensor cores themselves
(nibble | 0x4300 is bf16 128 + code, exact, no int->float conversion), split into even/odd channel halves so
that everything between the load and the `tl.dot` is elementwise — then Triton keeps only the uint8 tile in
shared memory and converts it straight to the dot-operand layout. The group scales move to the other operand
(scores: per-group partial products scaled afterwards, as one batched [groups, heads, tokens] dot; values:
p scaled per group). On the H200 profile the real kernel spends 47.5 shared-memory wavefronts per token, most
of them on the bf16 tile; this removes them.

What happens (H200, triton 3.6, 2026-11-30; results/decode_integer_domain.md): this stripped prototype
(content path only: no RoPE, zero points, block tables or protected rows; 16 heads, 16 x 64K tokens) takes
~600 us, while the full kernel of `quantmla.kernels.mla_decode` takes 356 us for the same tokens with
everything. Compiled offline for sm_90a (triton 3.9's compiler and ptxas), its loop is ~2,400 SASS
instructions per 64-token tile against ~1,600 for the full kernel's: byte-to-bf16 expansion (PRMT), shuffles
for the transposed operand, and register spills.
"""

import argparse
import sys

import torch
import triton
import triton.language as tl
from triton.testing import do_bench


@triton.jit
def _content_int4_integer_domain(codes_ptr, sc_ptr, q_ptr, o_ptr, n_tiles, BN: tl.constexpr, BH: tl.constexpr,
                                 NG: tl.constexpr, GB: tl.constexpr):  # fmt: skip
    """Unnormalized softmax(q c^T) c over n_tiles * BN tokens of int4 codes [N, NG * GB] (scales only)."""
    pid = tl.program_id(0)
    h = tl.arange(0, BH)
    j = tl.arange(0, GB)
    g = tl.arange(0, NG)
    # q split into even/odd channels, per group: q_lo[g, h, j] = q[h, 2 * (g * GB + j)].
    qoff = h[None, :, None] * (NG * GB * 2) + 2 * (g[:, None, None] * GB + j[None, None, :])
    q_lo = tl.load(q_ptr + qoff)
    q_hi = tl.load(q_ptr + qoff + 1)
    acc_lo = tl.zeros([NG, BH, GB], tl.float32)
    acc_hi = tl.zeros([NG, BH, GB], tl.float32)
    m = tl.zeros([BH], tl.float32) - 1e30
    for t in range(n_tiles):
        u = (pid * n_tiles + t) * BN + tl.arange(0, BN)
        w = tl.load(codes_ptr + u[None, :, None] * (NG * GB) + g[:, None, None] * GB + j[None, None, :])
        sc = tl.load(sc_ptr + u[None, :] * NG + g[:, None]).to(tl.float32)  # [NG, BN]
        c_lo = ((w & 15).to(tl.int16) | 0x4300).to(tl.bfloat16, bitcast=True)  # 128 + code
        c_hi = ((w >> 4).to(tl.int16) | 0x4300).to(tl.bfloat16, bitcast=True)
        s3 = tl.dot(q_lo, tl.trans(c_lo, 0, 2, 1))
        s3 = tl.dot(q_hi, tl.trans(c_hi, 0, 2, 1), s3)  # [NG, BH, BN] per-group partial scores
        s = tl.sum(s3 * sc[:, None, :], 0)
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        m = m_new
        p3 = (p[None, :, :] * sc[:, None, :]).to(tl.bfloat16)
        acc_lo = tl.dot(p3, c_lo, acc_lo * alpha[None, :, None])
        acc_hi = tl.dot(p3, c_hi, acc_hi * alpha[None, :, None])
    base = o_ptr + pid * BH * NG * GB * 2
    tl.store(base + qoff, acc_lo)
    tl.store(base + qoff + 1, acc_hi)


def main():
    n, bn = 16 * 65536, 64
    codes = torch.randint(0, 256, (n, 256), dtype=torch.uint8, device="cuda")
    sc = (torch.rand(n, 8, device="cuda") * 0.01).half()
    q = torch.randn(16, 512, device="cuda").bfloat16()
    print(f"{torch.cuda.get_device_name(0)}, triton {triton.__version__}; 16 heads, {n} int4 tokens, content only")
    print("| programs | tiles each | warps | stages | us |\n|---:|---:|---:|---:|---:|")
    for progs, nw, ns in [(256, 4, 2), (264, 4, 2), (528, 4, 2), (256, 4, 3), (256, 8, 2)]:
        tiles = n // bn // progs
        o = torch.empty(progs, 16, 512, device="cuda")

        def fn():
            _content_int4_integer_domain[(progs,)](codes, sc, q, o, tiles, BN=bn, BH=16, NG=8, GB=32,
                                                   num_warps=nw, num_stages=ns)  # fmt: skip

        fn()
        t = do_bench(fn, warmup=5, rep=50, return_mode="median") * 1e3
        print(f"| {progs} | {tiles} | {nw} | {ns} | {t:.1f} |", flush=True)


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    if not torch.cuda.is_available():
        sys.exit("decode_integer_domain.py needs a CUDA GPU (torch.cuda.is_available() is False)")
    main()
