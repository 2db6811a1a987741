"""Compile the Triton decode kernels for a GPU this machine does not have (no driver, no device needed).

`compile_decode` builds the launch `mla_decode` would make for a cache and head count (`triton_launch`, the
same arguments and constexprs), `compile_writer` the fused writer's (`cache_write.writer_launch`),
`compile_many_heads` / `compile_gluon` the Hopper Gluon kernels' (`many_heads_launch`, `gluon_launch`), and
compiles it for an NVIDIA target: Triton (or Gluon) front end, its passes, ptxas.
What it catches that the interpreter (TRITON_INTERPRET=1, the CPU tests) cannot: code the compiler refuses
(shapes of different constexpr branches, layouts), and launch configs whose shared memory exceeds the card's.
It needs a Triton with the NVIDIA backend (the pip wheels ship ptxas) and a process that does not interpret
(`TRITON_INTERPRET` unset): a kernel module imported under the interpreter holds no compilable kernels.
"""

from __future__ import annotations

import os

import torch

from quantmla.cache.paged import PagedMLACache
from quantmla.kernels.mla_decode import KernelConfig, default_config, triton_launch

# Dynamic shared memory one block may use, per compute capability (CUDA's "maximum shared memory per block").
SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448}
_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.uint8: "u8",
           torch.int8: "i8", torch.int32: "i32", torch.int64: "i64", torch.float8_e4m3fn: "fp8e4nv"}


def compile_decode(cache: PagedMLACache, num_heads: int, config: KernelConfig | None = None, *,
                   capability: int = 90, num_splits: int = 2, overrides: dict | None = None):
    """Compile `_mla_decode_kernel` for `cache` (any device; only its layout and dtypes matter) and
    `num_heads` heads with `config` (default: `default_config`, as `mla_decode` picks) for sm_`capability`;
    `overrides` replaces constexprs by name (experiments: `benchmarks/kernel_sass.py --const`).
    Returns Triton's compiled kernel (`.metadata.shared` bytes of shared memory, `.asm['cubin']`, ...); raises
    Triton's CompilationError where the compiler refuses the kernel."""
    _compiling_process()
    from quantmla.kernels.mla_decode import _mla_decode_kernel

    cfg = config or default_config(cache, num_heads)
    q, qp, table, lens = _queries(cache, num_heads)
    launch = triton_launch(q, qp, cache, table, lens, None, 1.0, cfg, num_splits, torch.float32,
                           asm=cfg.asm, interpreting=False)
    return _compile(_mla_decode_kernel, launch, capability, overrides)


def compile_writer(cache: PagedMLACache, *, capability: int = 90):
    """Compile the fused decode writer (`cache_write._append_decode_kernel`) for `cache`'s layout, as
    `append_decode_fused` launches it on a GPU, for sm_`capability`. Raises ValueError for a layout the
    torch writer serves instead (`fused_writes`)."""
    _compiling_process()
    from quantmla.kernels.cache_write import _append_decode_kernel, fused_writes, writer_launch

    if not fused_writes(cache):
        raise ValueError(f"the fused writer does not write {cache.content.fmt}/{cache.rope.fmt} "
                         "(the torch writer does)")
    dev = cache.content.codes.device
    c = torch.zeros(1, cache.kv_lora_rank, dtype=torch.bfloat16, device=dev)
    k_pe = torch.zeros(1, cache.rope_dim, dtype=torch.bfloat16, device=dev)
    ints = torch.zeros(1, dtype=torch.int32, device=dev)
    launch = writer_launch(cache, ints, ints[:, None], ints, c, k_pe, on_gpu=True)
    return _compile(_append_decode_kernel, launch, capability, None)


def compile_many_heads(cache: PagedMLACache, num_heads: int, *, num_splits: int = 2):
    """Compile the many-heads Gluon kernel's launch (`mla_decode_many_heads.many_heads_launch`) for `cache` and
    `num_heads` heads, for sm_90 (the kernel is Hopper-only). Raises ValueError where the kernel refuses the
    cache or this Triton release (`unsupported_reason`, device aside), else as `compile_decode`."""
    _compiling_process()
    from quantmla.kernels import mla_decode_many_heads as mh

    _gluon_refusal(mh.unsupported_reason(cache, num_heads, "cpu"))
    q, qp, table, lens = _queries(cache, num_heads)
    launch = mh.many_heads_launch(q, qp, cache, table, lens, None, 1.0, num_splits, num_splits, 1, torch.float32)
    return _compile(mh._many_heads_kernel, launch, 90, None, gluon=True)


def compile_gluon(cache: PagedMLACache, num_heads: int = 16, *, num_splits: int = 2, consts: dict | None = None):
    """Compile the few-heads Gluon kernel's launch (`mla_decode_gluon.gluon_launch`, opt-in) for `cache` for
    sm_90, with its default constexprs unless `consts` (DENORM, STAGES, PROT_VEC, PROT_PREFETCH) says otherwise.
    Raises as `compile_many_heads`."""
    _compiling_process()
    from quantmla.kernels import mla_decode_gluon as mg

    _gluon_refusal(mg.unsupported_reason(cache, num_heads, "cpu"))
    q, qp, table, lens = _queries(cache, num_heads)
    defaults = dict(DENORM=mg._denorm(), STAGES=mg._stages(), PROT_VEC=mg._prot_vec(),
                    PROT_PREFETCH=mg._prot_prefetch())
    launch = mg.gluon_launch(q, qp, cache, table, lens, None, 1.0, num_splits, torch.float32,
                             {**defaults, **(consts or {})})
    return _compile(mg._gluon_decode_kernel, launch, 90, None, gluon=True)


def _gluon_refusal(why: str | None) -> None:
    if why is not None and why != "not a CUDA device":  # compiling needs no device
        raise ValueError(f"the kernel refuses this: {why}")


def _queries(cache: PagedMLACache, num_heads: int):
    dev = cache.content.codes.device
    return (torch.zeros(1, num_heads, cache.kv_lora_rank, dtype=torch.bfloat16, device=dev),
            torch.zeros(1, num_heads, cache.rope_dim, dtype=torch.bfloat16, device=dev),
            torch.zeros(1, 1, dtype=torch.int32, device=dev), torch.zeros(1, dtype=torch.int32, device=dev))


def _compiling_process() -> None:
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise RuntimeError("compiling for a GPU needs a process without TRITON_INTERPRET=1 (its kernels are "
                           "interpreted Python functions there)")


def _compile(kernel, launch, capability: int, overrides: dict | None, gluon: bool = False):
    """Compile `kernel` (a Gluon kernel where `gluon`) for `launch`'s arguments, specialized as the JIT
    specializes them at that launch."""
    import triton
    from triton.backends.compiler import GPUTarget

    if gluon:
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource
    else:
        from triton.compiler import ASTSource

    # 16-byte aligned pointers and integers divisible by 16 are known to be, except for parameters marked
    # do_not_specialize (the loads vectorize and pipeline on it, which changes the kernel's shared memory).
    signature, constexprs, attrs = {}, {}, {}
    for i, (param, arg) in enumerate(zip(kernel.params, launch.args, strict=True)):
        if param.is_constexpr:
            signature[param.name], constexprs[param.name] = "constexpr", arg
            continue
        if isinstance(arg, torch.Tensor):
            signature[param.name] = "*" + _DTYPES[arg.dtype]
            aligned = arg.data_ptr() % 16 == 0
        elif isinstance(arg, float):
            signature[param.name], aligned = "fp32", False
        else:
            signature[param.name], aligned = "i32", arg % 16 == 0
        if aligned and not getattr(param, "do_not_specialize", False):
            attrs[(i,)] = [["tt.divisibility", 16]]
    unknown = set(overrides or {}) - set(constexprs)
    if unknown:
        raise ValueError(f"not constexprs of the kernel: {', '.join(sorted(unknown))}")
    constexprs.update(overrides or {})
    source = ASTSource(kernel, signature, constexprs, attrs)
    return triton.compile(source, target=GPUTarget("cuda", capability, 64), options=launch.options)
