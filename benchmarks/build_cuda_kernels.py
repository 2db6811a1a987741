"""Build the CUDA decode kernel's cubins on a machine without a GPU, so that a GPU session does not spend its
minutes in nvcc.

    PYTHONPATH=src QUANTMLA_CACHE_DIR=$PWD/kcache python benchmarks/build_cuda_kernels.py [--arch 90]
        [--formats int4/int4:512:64,fp8/bf16:512:64,...] [--jobs 8]

Each FORMAT/ROPE:DC:DR builds `mla_decode_int.cu` with the defines the launcher uses for that cache
(`mla_decode_cuda._defines`) and each ring depth it may load (3 and 2 stages), through the launcher's own on-disk
cache (`build_cubin`: $QUANTMLA_CACHE_DIR/cuda, keyed by the source's hash and the options), so the GPU machine
finds them there: carry the directory (about 2 MB for the default list) and set QUANTMLA_CACHE_DIR to it. The
default list holds every format the GPU tests and the decode benchmarks run. Needs nvcc.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

FORMATS = ("int4/int4:512:64,int2/int4:512:64,int4/int4:32:256:32,int2/int4:32:256:32,int2/int2:512:64,"
           "int4/int2:512:64,fp8/bf16:512:64,fp8:0/fp8:0:512:64,fp8:64/bf16:512:64,fp8:512/fp8:0:512:64,"
           "fp8/bf16:256:32,fp8:0/fp8:0:256:32")


def parse(spec: str) -> tuple[str, str, int, int]:
    """'CONTENT/ROPE:DC:DR' -> (content, rope, dc, dr); a format may hold ':' itself (int4:32, fp8:0)."""
    fmts, dc, dr = spec.rsplit(":", 2)
    content, rope = fmts.split("/")
    return content, rope, int(dc), int(dr)


def build(specs: list[str], arch: str = "90", jobs: int = 2) -> int:
    """Build the cubins of every CONTENT/ROPE:DC:DR spec (both ring depths) from `mla_decode_cuda.SRC` into the
    launcher's cache; returns how many. Exits naming a spec the CUDA kernel does not run."""
    from quantmla.cache.paged import PagedMLACache
    from quantmla.config import CacheConfig
    from quantmla.kernels import mla_decode_cuda as mdc

    if mdc._nvcc() is None:
        sys.exit("nvcc not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin)")
    defines = []
    for spec in specs:
        content, rope, dc, dr = parse(spec)
        cache = PagedMLACache.allocate(CacheConfig(content, rope), dc, dr, 1, 1, block_size=64, device="meta")
        if (why := mdc._fmt_reason(cache)) is not None:
            sys.exit(f"{spec}: the CUDA kernel {why}")
        defines += [{**mdc._defines(cache), "STAGES": stages} for stages in (3, 2)]
    with cf.ThreadPoolExecutor(jobs) as pool:
        list(pool.map(lambda d: mdc.build_cubin(d, arch), defines))
    return len(defines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="90", help="compute capability without the dot (90: H100 / H200)")
    ap.add_argument("--formats", default=FORMATS, help="CONTENT/ROPE:DC:DR, comma-separated")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="nvcc processes at once")
    args = ap.parse_args()

    from quantmla.kernels import mla_decode_cuda as mdc

    t0 = time.time()
    n = build(args.formats.split(","), args.arch, args.jobs)
    print(f"{n} cubins for sm_{args.arch} in {time.time() - t0:.0f} s, in {mdc._cache_dir()}")


if __name__ == "__main__":
    main()
