"""CUDA decode kernel for few heads over the integer or fp8 paged cache (`mla_decode_int.cu`), and its launcher.

Same contract as `quantmla.kernels.mla_decode.mla_decode` (which calls `mla_decode_cuda` when
`decode_kernel_name` says "cuda"): q_nope_absorbed [B, H, dc] and q_pe [B, H, dr] (bf16 or fp32), a
`PagedMLACache`, block_tables int32 [B, max_blocks], seq_lens int32 [B] (0 allowed), slots int32 [B],
sm_scale -> out [B, H, dc] (out_dtype), lse [B, H] fp32 (natural log, -inf for an empty sequence).

What it takes (`unsupported_reason` says why not, and the Triton kernel then runs):
  - a CUDA device of compute capability >= 8.0 and `nvcc` (PATH, $CUDA_HOME/bin or /usr/local/cuda/bin);
  - content and rope both int4 or int2 (asymmetric: fp16 scale + zero per group of channels, not token-axis:
    `decode_kernel_name` gives those to Triton whatever $QUANTMLA_DECODE_KERNEL says), content group 64, rope group
    a multiple of 32 (int4) or 64 (int2) channels; dc a multiple of 256, dr * bits a multiple of 128;
    or content fp8 (e4m3, an fp32 scale per group of 64 channels times a power of two, or group 0: none) with
    rope fp8:0 or bf16 (FlashMLA's 656-byte row is fp8:128 + bf16; vLLM's 576-byte row fp8:0 + fp8:0), on a
    device of compute capability >= 8.9 (cvt e4m3 -> fp16);
  - pages of 64 tokens times a power of two (64, 128, 256, ...); protected rows in bf16;
  - pools of whole contiguous rows (row strides may exceed the width, as in vLLM's packed rows), code rows
    16-byte aligned; scale and zero with one row stride.
  - kv_lora_rank 256 or 512 (one warp per 64-channel content group), at most 16 scale groups.
Heads are processed 16 per CTA (padded): the kernel reads and dequantizes the cache once per 16 heads, so it
is meant for few heads, or few sequences of many heads.

"auto" picks it where it measured faster than the Triton kernel on the H200 (`auto_cuda_max_batch`).

Build: nvcc -cubin for the device's architecture, one binary per (formats, dims, groups, ring stages: the
deepest of 3 and 2 with which two blocks fit an SM, as the kernel is built for, else the deepest one block
holds; neither is an unsupported reason), cached on disk under
$QUANTMLA_CACHE_DIR (default ~/.cache/quantmla/cuda), keyed by the source's hash and the options; loaded with the
CUDA driver API through ctypes into the current (PyTorch's primary) context; launched on
torch.cuda.current_stream(), so it is CUDA-graph capturable (build it once outside the capture).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

SRC = Path(__file__).with_name("mla_decode_int.cu")
NT = 64  # tokens per tile (a page must hold whole tiles)
ENV = "QUANTMLA_DECODE_KERNEL"  # triton | cuda | gluon | heads | auto
# Where "auto" picks the CUDA kernel (H200, benchmarks/results/decode_kernel_cuda_v4*.md, B 1-64, 4-64 K, int4
# and int2 content; benchmarks/decode_kernel_auto.py scores a rule on them): up to 32 heads it beat Triton's
# integer kernel in every cell. Above that it reads and dequantizes the cache once per 16 heads, and wins while
# the batch has few such head blocks; of the limits 4-128 blocks, 32 lost least on that grid (wrong in 13 of
# 138 cells, by at most 10.5 %; the same grid picked it). The fp8 cells measured later (decode_kernel_cuda_fp8.md)
# were not used to pick it: it is wrong in 1 of their 36 (128 heads, B = 1, 64 K: 10.7 %).
AUTO_CUDA_MAX_HEADS = 32
AUTO_CUDA_MAX_HEAD_BLOCKS = 32
# Against the many-heads Hopper kernel (`mla_decode_many_heads`, chosen above AUTO_CUDA_MAX_HEADS heads where it
# runs) the CUDA kernel wins only with very few head blocks: of the limits 0-32 blocks, 4 lost least on the H200
# grid of 33-128 heads (benchmarks/results/decode_kernel_heads.md: the CUDA kernel at 64 heads, B = 1; wrong in 4
# of 72 cells, by at most 14.2 %; the same grid picked it).
AUTO_CUDA_MAX_HEAD_BLOCKS_VS_MANY_HEADS = 4


def auto_cuda_max_batch(num_heads: int, many_heads: bool = False) -> int | None:
    """The largest batch for which "auto" picks the CUDA kernel at num_heads: None for any batch, 0 for none.
    many_heads: whether the many-heads kernel is the alternative (else Triton's)."""
    if num_heads <= AUTO_CUDA_MAX_HEADS:
        return None
    limit = AUTO_CUDA_MAX_HEAD_BLOCKS_VS_MANY_HEADS if many_heads else AUTO_CUDA_MAX_HEAD_BLOCKS
    return limit // -(-num_heads // 16)


def auto_prefers_cuda(num_heads: int, batch: int | None, many_heads: bool = False) -> bool:
    """Whether "auto" takes the CUDA kernel (where supported) at this head count and batch size, against the
    many-heads kernel (many_heads) or Triton's; batch None: for every batch size."""
    most = auto_cuda_max_batch(num_heads, many_heads)
    return most is None or (batch is not None and batch <= most)


def auto_kernel(num_heads: int, batch: int | None, cuda: bool, many_heads: bool) -> str:
    """"auto"'s pick among the kernels that can run (cuda: the CUDA kernel; many_heads: the many-heads kernel):
    the CUDA kernel where `auto_prefers_cuda`, else the many-heads kernel above AUTO_CUDA_MAX_HEADS heads, else
    Triton's."""
    many_heads = many_heads and num_heads > AUTO_CUDA_MAX_HEADS
    if cuda and auto_prefers_cuda(num_heads, batch, many_heads):
        return "cuda"
    return "heads" if many_heads else "triton"


def _bits(cache) -> tuple[int, int] | None:
    """(content, rope) as the kernel's CB / RB: int4 4, int2 2, fp8 (e4m3) 8, bf16 rope 16; None if unsupported."""
    c, r = cache.content.fmt, cache.rope.fmt
    ints = {"int4": 4, "int2": 2}
    if c.kind == "fp8":
        rope = {("fp8", 0): 8, ("bf16", 0): 16}.get((r.kind, r.group))
        return None if rope is None else (8, rope)
    return (ints[c.kind], ints[r.kind]) if c.kind in ints and r.kind in ints else None


def _fmt_reason(cache) -> str | None:
    """Why the kernel has no variant for these formats and dims, or None."""
    c, r = cache.content.fmt, cache.rope.fmt
    dc, dr = cache.kv_lora_rank, cache.rope_dim
    bits = _bits(cache)
    if bits is None:
        return f"needs int4/int2 on both paths, or fp8 content with fp8:0 or bf16 rope; got {c}/{r}"
    if dc not in (256, 512):
        return f"needs kv_lora_rank 256 or 512 (one warp per 64-channel group), got {dc}"
    if c.kind == "fp8":
        if c.group % 64:  # (a group divides dc: the format checks that)
            return f"needs fp8 content groups of 64 channels times a power of two, or 0; got {c.group}"
        if dr % 16:
            return f"needs rope dims in whole 16-channel steps, got {dr}"
        return None
    if c.group != 64:
        return f"needs content group 64, got {c.group}"
    rg, rb = r.group, bits[1]
    if dr % rg or rg % 16 or (rg * rb) % 128 or dc // 64 + dr // rg > 16:
        return (f"needs rope groups of whole 16-channel steps and 16 bytes per token (got rope dims {dr}, group "
                f"{rg}, {rb} bits) and at most 16 scale groups")
    return None


def unsupported_reason(cache, num_heads: int, device: torch.device) -> str | None:
    """None when `mla_decode_cuda` can run this cache on this device, else why not (one sentence). The last
    check builds and loads the kernel (once per device and formats): whether its shared memory fits a block."""
    if cache.content.block > 1 or cache.rope.block > 1:
        return (f"token-axis formats are not supported (got {cache.content.fmt}/{cache.rope.fmt}: scales per "
                "block of tokens and a longer BF16 ring)")
    if cache.content.fmt.rank or cache.rope.fmt.rank:
        return f"ranked formats are not supported (got {cache.content.fmt}/{cache.rope.fmt})"
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return "not a CUDA device"
    if torch.cuda.get_device_capability(device) < (8, 0):
        return "needs compute capability >= 8.0 (mma.sync bf16)"
    if (why := _fmt_reason(cache)) is not None:
        return why
    if cache.content.fmt.kind == "fp8" and torch.cuda.get_device_capability(device) < (8, 9):
        return "fp8 needs compute capability >= 8.9 (cvt e4m3 -> fp16)"
    tiles = cache.block_size // NT
    if cache.block_size % NT or tiles & (tiles - 1):
        return f"needs pages of {NT} tokens times a power of two, got {cache.block_size}"
    if cache.window and (cache.protected_content.dtype != torch.bfloat16 or cache.protected_rope.dtype != torch.bfloat16):
        return "needs bf16 protected rows"
    if not (cache.protected_content.is_contiguous() and cache.protected_rope.is_contiguous()):
        return "needs contiguous protected rows"
    for path in (cache.content, cache.rope):
        if (why := path.row_layout_problem(row_align=16, base_align=16)) is not None:
            return why
    if _nvcc() is None:
        return "nvcc not found"
    got = _kernel(device, cache)  # built and loaded once per device and formats
    return got if isinstance(got, str) else None


def decode_kernel_name(cache, num_heads: int, device, batch: int | None = None) -> str:
    """Which kernel `mla_decode` runs for this cache, head count, device and batch size: "cuda", "heads",
    "gluon" or "triton". batch None: the kernel that runs whatever the batch size (the larger-batch one where
    it depends on it).

    $QUANTMLA_DECODE_KERNEL: "triton" always Triton; "cuda" the CUDA kernel (mla_decode raises if it cannot
    run); "heads" the many-heads Hopper kernel of `mla_decode_many_heads` (raises ValueError if it cannot run);
    "gluon" the few-heads Hopper Gluon kernel of `mla_decode_gluon` (opt-in, never chosen by "auto"; raises
    ValueError if it cannot run); "auto" (default) `auto_kernel` among those that can run: the CUDA kernel up
    to AUTO_CUDA_MAX_HEADS heads or where the batch is at most `auto_cuda_max_batch`, else the many-heads
    kernel, else Triton (where each measured faster). A cache with a token-axis or a ranked path is always
    Triton's: the other kernels read neither token-axis scales nor partial rows."""
    choice = os.environ.get(ENV, "auto").lower()
    if choice not in ("triton", "cuda", "gluon", "heads", "auto"):
        raise ValueError(f"{ENV} must be triton, cuda, gluon, heads or auto, got {choice!r}")
    if choice == "triton" or cache.content.block > 1 or cache.rope.block > 1:
        return "triton"
    if cache.content.fmt.rank or cache.rope.fmt.rank:
        return "triton"
    if choice in ("cuda", "gluon", "heads"):
        return choice
    from quantmla.kernels import mla_decode_many_heads as _many

    many = num_heads > AUTO_CUDA_MAX_HEADS and _many.unsupported_reason(cache, num_heads, device) is None
    cuda = auto_prefers_cuda(num_heads, batch, many) and unsupported_reason(cache, num_heads, device) is None
    return auto_kernel(num_heads, batch, cuda, many)


# --- build ----------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _nvcc() -> str | None:
    for cand in (shutil.which("nvcc"), os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc"),
                 "/usr/local/cuda/bin/nvcc"):  # fmt: skip
        if cand and os.path.exists(cand):
            return cand
    return None


def _cache_dir() -> Path:
    return Path(os.environ.get("QUANTMLA_CACHE_DIR", Path.home() / ".cache" / "quantmla")) / "cuda"


def nvcc_options(defines: dict[str, int], arch: str) -> list[str]:
    """The nvcc options of mla_decode_int.cu for sm_<arch> with these -D defines."""
    opts = ["-std=c++17", "-O3", "-use_fast_math", f"-gencode=arch=compute_{arch},code=sm_{arch}"]
    return opts + [f"-D{k}={v}" for k, v in sorted(defines.items())]


def build_cubin(defines: dict[str, int], arch: str) -> bytes:
    """nvcc -cubin of mla_decode_int.cu with -D defines for sm_<arch>, through the on-disk cache."""
    src = SRC.read_bytes()
    opts = nvcc_options(defines, arch)
    key = hashlib.sha256(src + " ".join(opts).encode()).hexdigest()[:24]
    path = _cache_dir() / f"mla_decode_int_{key}.cubin"
    if path.exists():
        return path.read_bytes()
    nvcc = _nvcc()
    if nvcc is None:
        raise RuntimeError("nvcc not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin)")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "k.cubin")
        res = subprocess.run([nvcc, "-cubin", *opts, "-o", out, str(SRC)], capture_output=True, text=True)
        if res.returncode:
            raise RuntimeError(f"nvcc failed ({' '.join(opts)}):\n{res.stderr[-4000:]}")
        data = Path(out).read_bytes()
    tmp_path = path.with_suffix(f".{os.getpid()}.tmp")
    tmp_path.write_bytes(data)
    os.replace(tmp_path, path)  # atomic: concurrent builders write the same bytes
    return data


# --- driver API -----------------------------------------------------------------------------------------------

_lib = None
_lock = threading.Lock()
_kernels: dict[tuple, tuple[int, int, bool] | str] = {}  # (device, defines) -> (CUfunction, shared bytes, two
#                                                          blocks fit an SM) or why not


def _cu():
    global _lib
    if _lib is None:
        _lib = ctypes.CDLL("libcuda.so.1")
        _lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    return _lib


def _check(res: int, what: str) -> None:
    if res:
        msg = ctypes.c_char_p()
        _cu().cuGetErrorString(res, ctypes.byref(msg))
        raise RuntimeError(f"{what}: CUDA error {res} ({msg.value.decode() if msg.value else '?'})")


def _load(idx: int, defines: dict[str, int]) -> tuple[int, int, bool] | str:
    """Build and load the kernel with these defines on device idx: (CUfunction, dynamic shared bytes, whether
    two blocks fit an SM), or why it does not fit the device (its shared memory). Results are kept, failures
    too."""
    key = (idx, tuple(sorted(defines.items())))
    with _lock:
        if key in _kernels:
            return _kernels[key]
        major, minor = torch.cuda.get_device_capability(idx)
        image = build_cubin(defines, f"{major}{minor}")
        cu = _cu()
        with torch.cuda.device(idx):
            torch.cuda.current_stream(idx)  # makes PyTorch's primary context current on this thread
            ctx = ctypes.c_void_p()
            _check(cu.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
            if not ctx.value:
                torch.empty(1, device=f"cuda:{idx}")
                _check(cu.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
            mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
            _check(cu.cuModuleLoadData(ctypes.byref(mod), ctypes.c_char_p(image)), "cuModuleLoadData")
            _check(cu.cuModuleGetFunction(ctypes.byref(fn), mod, b"mla_decode_int"), "cuModuleGetFunction")
            # sizeof(Smem), published by the module (read once: a copy to the host, outside any capture)
            gptr, gsize = ctypes.c_uint64(), ctypes.c_size_t()
            _check(cu.cuModuleGetGlobal_v2(ctypes.byref(gptr), ctypes.byref(gsize), mod, b"kSmemBytes"), "cuModuleGetGlobal")
            smem = ctypes.c_int()
            _check(cu.cuMemcpyDtoH_v2(ctypes.byref(smem), gptr, ctypes.c_size_t(4)), "cuMemcpyDtoH")
            cudev = ctypes.c_int()
            _check(cu.cuCtxGetDevice(ctypes.byref(cudev)), "cuCtxGetDevice")

            def attribute(num: int) -> int:
                val = ctypes.c_int()
                _check(cu.cuDeviceGetAttribute(ctypes.byref(val), num, cudev), "cuDeviceGetAttribute")
                return val.value

            limit = attribute(97)  # opt-in maximum per block
            two = 2 * (smem.value + attribute(111)) <= attribute(81)  # (+ reserved per block) <= per SM
            if smem.value > limit:
                _check(cu.cuModuleUnload(mod), "cuModuleUnload")
                _kernels[key] = f"needs {smem.value} bytes of shared memory per block, the device allows {limit}"
                return _kernels[key]
            _check(cu.cuFuncSetAttribute(fn, 8, smem.value), "cuFuncSetAttribute(max dynamic shared memory)")
        _kernels[key] = (fn.value, smem.value, two)
        return _kernels[key]


def _kernel(device: torch.device, cache) -> tuple[int, int] | str:
    """The kernel for this cache on this device, (CUfunction, shared bytes): the deepest cp.async ring (3 or 2
    stages) with which two blocks fit an SM (the kernel's launch bounds ask for two), else the deepest whose
    shared memory fits one block; or why none does."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    why, one = "", None
    for stages in (3, 2):
        got = _load(idx, {**_defines(cache), "STAGES": stages})
        if isinstance(got, str):
            why = why or got
            continue
        if got[2]:
            return got[:2]
        one = one or got[:2]
    return one or why


def _defines(cache) -> dict[str, int]:
    cb, rb = _bits(cache)
    c, r = cache.content.fmt, cache.rope.fmt
    d = {"CB": cb, "RB": rb, "DC": cache.kv_lora_rank, "DR": cache.rope_dim, "RG": r.group if rb < 8 else cache.rope_dim}
    return d | ({"CG": c.group} if cb == 8 else {})


def prepare(cache, device) -> None:
    """Build and load the kernel for this cache's formats (do it before capturing a CUDA graph)."""
    got = _kernel(torch.device(device), cache)
    if isinstance(got, str):
        raise ValueError(f"the CUDA decode kernel cannot run this: {got}")


PROT_TILES = 12  # as PROT_TILES in mla_decode_int.cu


def body_splits(batch: int, num_heads: int, max_seq_len: int, num_sms: int, protected: bool = True,
                ctas_per_sm: int = 2) -> int:
    """Splits of the quantized body per sequence.

    Each split costs a prologue (the q fragments) and a partial output to combine; fewer, longer splits leave
    SMs idle. The balance point grows with the square root of the length, so a sequence gets about
    sqrt(max_seq_len) / 4 splits, within one wave of ctas_per_sm blocks per SM, and none shorter than 512
    tokens unless the batch's 256-token splits still fit one per SM (a short split pays for its prologue only
    on an SM that would otherwise idle). On the H200 (benchmarks/results/decode_kernel_splits.md, 16 heads,
    B = 1, 4, 16 at 4 K, 16 K, 64 K) this picks the fastest count measured in every cell.
    With protected rows, each sequence also has a protected split: leaving a slot for it (one body split
    fewer) costs a longer body split; not leaving one makes a few body CTAs start when the first protected
    splits end, about PROT_TILES tiles late (measured on the H200, decode_kernel_cuda_v2.md). The rule takes
    whichever costs fewer tiles.
    The kernel applies this rule to each sequence's own length (`body_splits_of` in mla_decode_int.cu, the
    same integer arithmetic, from `split_terms`' fit and ctas), within the grid's count for max_seq_len."""
    fit, ctas = split_terms(batch, num_heads, num_sms, ctas_per_sm)
    length = max(max_seq_len, 1)
    tiles = lambda n: -(-length // (NT * n))  # noqa: E731
    if protected and fit > 1 and tiles(fit - 1) - tiles(fit) <= PROT_TILES:
        fit -= 1
    shortest = 256 if ctas * -(-length // 256) <= num_sms else 512
    root = -(-(math.isqrt(length - 1) + 1) // 4)  # ceil(sqrt(length) / 4)
    return max(1, min(fit, root, -(-length // shortest)))


def split_terms(batch: int, num_heads: int, num_sms: int, ctas_per_sm: int = 2) -> tuple[int, int]:
    """(fit, ctas) of `body_splits`: blocks one sequence gets in one wave of ctas_per_sm blocks per SM, and
    blocks per split index (sequences x 16-head blocks)."""
    ctas = max(1, batch * -(-num_heads // 16))
    return max(1, (num_sms * ctas_per_sm) // ctas), ctas


def mla_decode_cuda(q_nope_absorbed, q_pe, cache, block_tables, seq_lens, slots, sm_scale, *, max_seq_len: int,
                    out_dtype=torch.float32, num_splits: int | None = None, num_sms: int = 132,
                    prot_splits: int = 1):
    """The CUDA kernel + the Triton split combine. Contract: the module docstring. num_splits: body splits
    (default `body_splits`); max_seq_len: an upper bound on seq_lens (sizes the splits; no host sync);
    prot_splits: CTAs per sequence for the protected rows, each a run of their 64-row tiles (none without a
    window; more than one is an experiment, benchmarks/decode_kernel_floor.py)."""
    from quantmla.kernels.mla_decode import LOG2E, combine_splits  # the Triton combine, shared

    reason = unsupported_reason(cache, q_nope_absorbed.shape[1], q_nope_absorbed.device)
    if reason:
        raise ValueError(f"the CUDA decode kernel cannot run this: {reason}")
    B, H, dc = q_nope_absorbed.shape
    dev = q_nope_absorbed.device
    fn, smem = _kernel(dev, cache)
    qn, qp = q_nope_absorbed, q_pe
    if qn.dtype not in (torch.bfloat16, torch.float32):
        qn = qn.float()
    if qp.dtype != qn.dtype:
        qp = qp.to(qn.dtype)
    qn, qp = (q.contiguous() for q in (qn, qp))
    qn, qp = (q.clone() if q.data_ptr() % 16 else q for q in (qn, qp))  # the kernel reads 16-byte rows
    bt = block_tables if block_tables.dtype == torch.int32 else block_tables.int()
    if bt.stride(-1) != 1:
        bt = bt.contiguous()
    lens = seq_lens.int().contiguous()
    slots = (torch.arange(B, dtype=torch.int32, device=dev) if slots is None else slots).int().contiguous()
    nsb = num_splits or body_splits(B, H, max_seq_len, num_sms, protected=cache.window > 0)
    # each sequence takes body_splits at its own length within nsb; a caller's num_splits holds for all (fit 0)
    fit, ctas = split_terms(B, H, num_sms) if not num_splits else (0, 0)
    if prot_splits < 1:
        raise ValueError(f"prot_splits must be at least 1, got {prot_splits}")
    nps = prot_splits if cache.window else 0
    nst = nsb + nps
    out = torch.empty(B, H, dc, dtype=out_dtype, device=dev)
    lse = torch.empty(B, H, dtype=torch.float32, device=dev)
    if B == 0 or H == 0:
        return out, lse
    po = torch.empty(B, nst, H, dc, dtype=torch.float32, device=dev)
    plse = torch.empty(B, nst, H, dtype=torch.float32, device=dev)
    c, r = cache.content, cache.rope
    P = ctypes.c_void_p

    def ptr(t):  # an absent scale / zero pool (fp8 has no zero; fp8:0 and bf16 no scale): null, never read
        return P(0 if t is None else t.data_ptr())

    def row(t):
        return ctypes.c_longlong(0 if t is None else t.stride(1))

    args = [
        P(qn.data_ptr()), P(qp.data_ptr()), ctypes.c_int(qn.dtype == torch.float32),
        P(c.codes.data_ptr()), ptr(c.scale), ptr(c.zero),
        P(r.codes.data_ptr()), ptr(r.scale), ptr(r.zero),
        P(cache.protected_content.data_ptr()), P(cache.protected_rope.data_ptr()),
        P(bt.data_ptr()), ctypes.c_int(bt.stride(0)), P(lens.data_ptr()), P(slots.data_ptr()),
        P(po.data_ptr()), P(plse.data_ptr()),
        ctypes.c_int(H), ctypes.c_int(nsb), ctypes.c_int(nps), ctypes.c_int(nst), ctypes.c_int(fit),
        ctypes.c_int(ctas), ctypes.c_int(num_sms), ctypes.c_float(sm_scale * LOG2E),
        ctypes.c_longlong(c.codes.stride(1)), row(c.scale),  # code rows in bytes, scale rows in elements
        ctypes.c_longlong(r.codes.stride(1) * r.codes.element_size()), row(r.scale),
        ctypes.c_int(cache.block_size), ctypes.c_int(cache.sink), ctypes.c_int(cache.window),
    ]  # fmt: skip
    params = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
    stream = torch.cuda.current_stream(dev).cuda_stream
    _check(_cu().cuLaunchKernel(P(fn), -(-H // 16), B, nst, 32 * (dc // 64), 1, 1, smem, P(stream), params, None), "cuLaunchKernel")
    combine_splits(po, plse, out, lse)
    return out, lse


__all__ = ["ENV", "auto_cuda_max_batch", "auto_kernel", "auto_prefers_cuda", "body_splits", "decode_kernel_name", "mla_decode_cuda", "prepare", "split_terms", "unsupported_reason"]
