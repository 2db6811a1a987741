"""Guards in the slots of vLLM's MLA backends that the plugin does not replace.

vLLM picks an MLA backend per platform and GPU (FlashMLA, FlashInfer, CUTLASS, ... on CUDA; AMX on CPUs with
AMX). Only TRITON_MLA (CUDA) and CPU_MLA (CPU) carry quantmla's cache; any other one would serve vLLM's own
BF16 cache while the checkpoint or QUANTMLA_VLLM_CACHE asks for a quantized one. `guards.<NAME>` (NAME a member
of vLLM's `AttentionBackendEnum`) is vLLM's own backend class for that slot, unchanged, except that its impl
refuses to start when quantmla's cache was asked for, naming the --attention-backend that gives it. The
classes are built on first access (vLLM resolves the registered path with getattr), so a backend is imported
only where vLLM would import it anyway.
"""

from __future__ import annotations

import importlib

from vllm.config import get_current_vllm_config_or_none

from quantmla.integrations.vllm import settings

# The slot that carries quantmla's cache on the platform of each guarded backend.
OURS = {"AMX_MLA": "CPU_MLA"}  # any other: CUDA's TRITON_MLA


def cuda_guarded() -> list[str]:
    """vLLM's dense MLA backends on CUDA besides TRITON_MLA (sparse ones serve DeepSeek-V3.2 and later, which
    quantmla does not adapt; ROCm and XPU ones are other platforms')."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    skip = ("TRITON_MLA", "CPU_MLA", "AMX_MLA")
    return [m.name for m in AttentionBackendEnum if "MLA" in m.name and m.name not in skip
            and not any(k in m.name for k in ("SPARSE", "ROCM", "AITER", "XPU"))]  # fmt: skip


def refuse_if_asked(but: str) -> None:
    """Raise ValueError if QUANTMLA_VLLM_CACHE or the checkpoint's section asks for quantmla's cache, which the
    backend being built does not give: `but` says why ({model} is the model's name)."""
    vllm_config = get_current_vllm_config_or_none()
    model_config = vllm_config.model_config if vllm_config else None
    asked = settings.quantization_asked(model_config.hf_config if model_config else None)
    if asked:
        model = model_config.model if model_config else "this model"
        raise ValueError(f"{asked} asks for quantmla's cache, but " + but.format(model=model))


def guarded(backend: type, name: str, but: str) -> type:
    """A subclass of vLLM backend class `backend` whose impl calls refuse_if_asked(but) before its own init."""
    impl = backend.get_impl_cls()

    def __init__(self, *args, **kwargs):
        refuse_if_asked(but)
        impl.__init__(self, *args, **kwargs)

    guard_impl = type(f"{impl.__name__}Guard", (impl,), {"__init__": __init__, "__module__": __name__})
    return type(name, (backend,), {"get_impl_cls": staticmethod(lambda: guard_impl), "__module__": __name__,
                                   "__qualname__": name, "__doc__": f"vLLM's {name} backend, guarded."})


def __getattr__(name: str) -> type:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    if name not in AttentionBackendEnum.__members__ or not AttentionBackendEnum[name].value:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, cls = AttentionBackendEnum[name].value.rsplit(".", 1)  # vLLM's own class, not the override
    ours = OURS.get(name, "TRITON_MLA")
    guard = guarded(getattr(importlib.import_module(module), cls), name,
                    f"vLLM picked its {name} backend for {{model}}, which quantmla does not replace: pass "
                    f"--attention-backend {ours} to get quantmla's backend, or set {settings.ENV}=bf16 to run it "
                    "unquantized.")  # fmt: skip
    globals()[name] = guard
    return guard
