"""RLAX kernels: Pallas TPU/GPU kernels with pure-jnp references beside them.

Cache layout used throughout: ``k_pages``/``v_pages`` are
``[num_kv_heads, total_pages, page_size, head_dim]`` (see ``rlax_kernels.paged_attention``).
"""

from rlax_kernels.paged_attention import (
    Backend,
    default_scale,
    paged_attention,
    paged_attention_cpu,
    paged_attention_reference,
    paged_attention_xla,
    paged_prefill_attention,
    paged_prefill_attention_reference,
    resolve_backend,
    slots_from_positions,
    write_kv,
)

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
