"""The Triton decode kernel, the fused decode writer and the Hopper Gluon decode kernels compile for sm_90 on
this CPU machine, through `kernels.offline`.

The interpreter runs the kernel as plain Python, so code the real compiler refuses passes every other CPU
test: the ranked body's orientation helpers of 2026-12-01 (two returns of different shapes) passed the
interpreter tests and failed to compile on the H200 the next day. The Gluon kernels have no interpreter at
all, and Gluon's API changes between releases (the few-heads kernel stopped compiling with Triton 3.7 and
nobody noticed). These cases compile the launches `mla_decode` makes, the writer's and the Gluon kernels', in
a subprocess without TRITON_INTERPRET, and check each fits the H100/H200's shared memory.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# (content, rope, kv_lora_rank, rope_dim, heads, scores_t, values_t); None: the launch default's orientation.
CASES = [
    ("bf16", "bf16", 512, 64, 16, None, None),
    ("int4", "int4", 512, 64, 16, None, None),
    ("int4", "int4", 512, 64, 128, None, None),
    ("int2", "int4", 512, 64, 16, None, None),
    ("fp8", "bf16", 512, 64, 16, None, None),
    ("int4", "int4:t64", 512, 64, 16, None, None),
    ("int4", "int4", 256, 32, 16, None, None),  # MiniCPM3's dims
    ("int8r256", "int4", 512, 64, 128, None, None),
    ("int4:t64", "int4:t64", 512, 64, 16, None, None),  # token-axis content: one stage (default_config)
    ("int4", "int4:t64", 512, 64, 128, None, None),  # token-axis RoPE at many heads: likewise
    *(("int8r128", "int4", 512, 64, 16, s, v) for s in (False, True) for v in (False, True)),
]
# The fused decode writer, per layout it writes (heads and orientation do not apply: "writer").
CASES += [(c, r, dc, dr, "writer", None, None) for c, r, dc, dr in [
    ("int4", "int4", 512, 64), ("int2c0.9", "int4:32", 512, 64), ("fp8", "bf16", 512, 64), ("bf16", "bf16", 512, 64),
    ("fp8:0", "fp8:0", 512, 64), ("int8r128", "int4", 512, 64), ("int4", "int4", 256, 32)]]

# The Hopper Gluon kernels (sm_90 only): "many-heads:H" (mla_decode_many_heads, auto's pick above 32 heads) and
# "gluon:H" (mla_decode_gluon, opt-in). Gluon's API changes between Triton releases: these fail when the
# installed release is one the kernels claim (TRITON_VERSIONS) and they no longer compile with it.
CASES += [(c, r, dc, dr, k, None, None) for c, r, dc, dr, k in [
    ("int4", "int4", 512, 64, "many-heads:128"), ("int2", "int4", 512, 64, "many-heads:64"),
    ("fp8:0", "fp8:0", 512, 64, "many-heads:128"), ("fp8", "bf16", 512, 64, "many-heads:128"),
    ("int4", "int4:32", 256, 32, "many-heads:128"), ("int4", "int4", 512, 64, "gluon:16")]]

SCRIPT = r"""
import json, sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace

def one(case):
    from quantmla.cache.paged import PagedMLACache
    from quantmla.config import CacheConfig
    from quantmla.kernels.mla_decode import default_config
    from quantmla.kernels.offline import SHARED_LIMIT, compile_decode, compile_writer
    content, rope, dc, dr, heads, s_t, v_t = case
    try:
        config = CacheConfig(content, rope, sink=4, recent=128).fit(dc, dr)
        cache = PagedMLACache.allocate(config, dc, dr, 4, 2, block_size=64)
        if heads == "writer":
            k = compile_writer(cache, capability=90)
            return {"case": case, "shared": k.metadata.shared, "limit": SHARED_LIMIT[90]}
        if isinstance(heads, str):  # a Gluon kernel: "many-heads:H" / "gluon:H"
            from quantmla.kernels import mla_decode_gluon as mg
            from quantmla.kernels.offline import compile_gluon, compile_many_heads

            if mg.gluon is None or not mg.TRITON_VERSIONS[0] <= mg._triton_version() < mg.TRITON_VERSIONS[1]:
                return {"case": case, "skip": mg.hopper_reason(cache, "cpu") or mg._GLUON_ERROR}
            kernel, h = heads.split(":")
            k = (compile_many_heads if kernel == "many-heads" else compile_gluon)(cache, int(h))
            return {"case": case, "shared": k.metadata.shared, "limit": SHARED_LIMIT[90]}
        cfg = default_config(cache, heads)
        if s_t is not None:
            cfg = replace(cfg, scores_t=s_t, values_t=v_t)
        k = compile_decode(cache, heads, cfg, capability=90)
    except Exception as e:
        return {"case": case, "error": f"{type(e).__name__}: {e}"[-1500:]}
    return {"case": case, "shared": k.metadata.shared, "limit": SHARED_LIMIT[90]}

if __name__ == "__main__":
    cases = [tuple(c) for c in json.loads(sys.argv[1])]
    with ProcessPoolExecutor(2) as pool:
        print(json.dumps(list(pool.map(one, cases))))
"""


def _nvidia_backend() -> bool:
    if importlib.util.find_spec("triton") is None or importlib.util.find_spec("triton.backends.nvidia") is None:
        return False
    import triton

    return (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists()


@pytest.fixture(scope="module")
def compiled():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns when unset; 1 is its default
    run = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(CASES)], capture_output=True, text=True,
                         env=env, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return {tuple(r["case"]): r for r in json.loads(run.stdout.strip().splitlines()[-1])}


@pytest.mark.skipif(not _nvidia_backend(), reason="needs Triton's NVIDIA backend (ptxas) to compile for sm_90")
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-{c[2]}-{c[4]}-{c[5]}{c[6]}")
def test_kernels_compile_for_sm90(compiled, case):
    result = compiled[case]
    if "skip" in result:
        pytest.skip(f"the Gluon kernels are not built for this Triton: {result['skip']}")
    assert "error" not in result, result.get("error")
    assert result["shared"] <= result["limit"], f"{result['shared']} B of shared memory"
    if case[4] != "writer":  # the decode kernel stages its tiles in shared memory; the writer need not
        assert result["shared"] > 0
