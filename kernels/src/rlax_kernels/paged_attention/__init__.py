"""Attention over a paged KV cache: decode, chunked prefill and cache writes."""

from rlax_kernels.paged_attention.cache import slots_from_positions, write_kv
from rlax_kernels.paged_attention.cpu import paged_attention_cpu
from rlax_kernels.paged_attention.ops import (
    Backend,
    paged_attention,
    paged_prefill_attention,
    resolve_backend,
)
from rlax_kernels.paged_attention.reference import (
    default_scale,
    paged_attention_reference,
    paged_prefill_attention_reference,
)
from rlax_kernels.paged_attention.xla import paged_attention_xla

__all__ = [
    "Backend",
    "default_scale",
    "paged_attention",
    "paged_attention_cpu",
    "paged_attention_reference",
    "paged_attention_xla",
    "paged_prefill_attention",
    "paged_prefill_attention_reference",
    "resolve_backend",
    "slots_from_positions",
    "write_kv",
]
