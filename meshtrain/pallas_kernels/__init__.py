"""Pallas kernels for the hot loops: flash attention, fused RMSNorm, fused cross-entropy.

Each kernel runs compiled (Triton) on GPU and in Pallas interpret mode on CPU (`interpret=None`
picks by the platform the program is compiled for: the mesh's devices, which may be a GPU target
compiled ahead of time on a CPU host), and has a pure-jnp `*_reference` beside it.
Playbook sections: "Fused Kernels", "Flash Attention 1-3".
"""

from meshtrain.pallas_kernels._common import target_platform
from meshtrain.pallas_kernels.cross_entropy import (
    CrossEntropyBlockSizes,
    fused_cross_entropy,
    fused_cross_entropy_reference,
)
from meshtrain.pallas_kernels.flash_attention import (
    FlashBlockSizes,
    document_tiles,
    flash_attention,
    flash_attention_reference,
    flash_attention_with_lse,
    flash_attention_with_lse_reference,
    runs_are_documents,
)
from meshtrain.pallas_kernels.rms_norm import (
    RMSNormBlockSizes,
    rms_norm,
    rms_norm_reference,
)

__all__ = [
    "CrossEntropyBlockSizes",
    "FlashBlockSizes",
    "RMSNormBlockSizes",
    "document_tiles",
    "flash_attention",
    "flash_attention_reference",
    "flash_attention_with_lse",
    "flash_attention_with_lse_reference",
    "runs_are_documents",
    "fused_cross_entropy",
    "fused_cross_entropy_reference",
    "rms_norm",
    "rms_norm_reference",
    "target_platform",
]
