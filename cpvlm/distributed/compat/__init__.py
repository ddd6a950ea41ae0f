"""The one place where cpvlm touches private or version-dependent torch APIs, one module a concern.

Everything here is a thin wrapper with a plain signature, so that a torch upgrade that renames or
changes one of these APIs is fixed in this package alone. cpvlm supports torch 2.11 to 2.15 and
tells the versions apart by feature detection (an attribute, an import, a meta kernel's output),
never by version string. Each module's docstring names what it wraps:

- collectives.py: the tensor collectives (``*_single`` names or the older ones);
- cpu_flash.py: torch's fused CPU flash attention (forward with lse, backward from a merged row);
- cuda_kernels.py: the fused CUDA flash and memory-efficient kernels, as custom ops;
- torch_ring.py: PyTorch's own context-parallel ring attention and head-tail balancer;
- dcp.py: DCP's asynchronous saves, their errors, checkpoint metadata;
- process.py: the default store, collective timeouts, dying with the parent process, group count;
- fake.py: fake tensors and a fake process group for dry runs, real host integers among them;
- memory_tracker.py: torch's MemTracker with cpvlm's categories and global peak.

Callers use the names re-exported here (``compat.cpu_flash_forward``); a test that patches one
patches it here, where callers look it up, or in the submodule for a name used inside it.
"""

from cpvlm.distributed.compat.collectives import (
    all_gather_tensor,
    legacy_collectives,
    reduce_scatter_tensor,
    uses_single_collectives,
)
from cpvlm.distributed.compat.cpu_flash import (
    cpu_flash_backward,
    cpu_flash_forward,
    cpu_flash_supported,
)
from cpvlm.distributed.compat.cuda_kernels import (
    CUDA_EFFICIENT,
    CUDA_FLASH,
    FusedAttentionKernel,
    Packing,
    cuda_fused_kernel,
    fused_kernel_for,
    lse_rows_from_sequences,
    lse_sequences_from_rows,
)
from cpvlm.distributed.compat.dcp import (
    async_save,
    checkpoint_error_types,
    checkpoint_failure,
    dcp_file_extents,
)
from cpvlm.distributed.compat.fake import (
    HostIntegers,
    fake_mode_active,
    fake_tensor_mode,
    init_fake_process_group,
    is_fake,
    real_tensors,
)
from cpvlm.distributed.compat.memory_tracker import (
    GATHERED,
    LOSS,
    TorchDispatchMode,
    memory_tracker,
)
from cpvlm.distributed.compat.process import (
    default_store,
    die_with_parent,
    is_collective_timeout,
    process_group_count,
)
from cpvlm.distributed.compat.torch_ring import (
    torch_head_tail_indices,
    torch_ring_attention_backward,
    torch_ring_attention_forward,
)

__all__ = [
    "CUDA_EFFICIENT",
    "CUDA_FLASH",
    "GATHERED",
    "LOSS",
    "FusedAttentionKernel",
    "HostIntegers",
    "Packing",
    "TorchDispatchMode",
    "all_gather_tensor",
    "async_save",
    "checkpoint_error_types",
    "checkpoint_failure",
    "cpu_flash_backward",
    "cpu_flash_forward",
    "cpu_flash_supported",
    "cuda_fused_kernel",
    "dcp_file_extents",
    "default_store",
    "die_with_parent",
    "fake_mode_active",
    "fake_tensor_mode",
    "fused_kernel_for",
    "init_fake_process_group",
    "is_collective_timeout",
    "is_fake",
    "legacy_collectives",
    "lse_rows_from_sequences",
    "lse_sequences_from_rows",
    "memory_tracker",
    "process_group_count",
    "real_tensors",
    "reduce_scatter_tensor",
    "torch_head_tail_indices",
    "torch_ring_attention_backward",
    "torch_ring_attention_forward",
    "uses_single_collectives",
]
