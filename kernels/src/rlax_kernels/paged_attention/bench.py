"""Decode paged-attention benchmark: our kernels vs the XLA reference vs the kernels JAX ships.

Run by ``kernels/benchmarks/bench_paged_attention.py`` (``nox -s bench``) or directly:
``python -m rlax_kernels.paged_attention.bench``.

What runs depends on ``jax.default_backend()``:

- tpu: our Pallas TPU kernel, the XLA reference, and
  ``jax.experimental.pallas.ops.tpu.paged_attention``, all compiled for the chip;
- gpu: our Pallas Triton kernel, the XLA reference, and
  ``jax.experimental.pallas.ops.gpu.paged_attention``;
- cpu: our native CPU kernel (``cpu.py``, what the CPU engine runs; labelled ``native``),
  the XLA reference and our XLA decode path (``xla.py``), both compiled and labelled
  ``xla``, and all four Pallas kernels in
  interpret mode (labelled ``interpret``; JAX's TPU kernel under
  ``pltpu.force_tpu_interpret_mode``). Interpret timings measure the interpreter, not a
  device: the ratios between them say how much work each kernel issues, nothing more.

Achieved bandwidth counts the useful bytes of a decode step -- the K and V rows of every
valid token, the queries and the outputs -- over the median wall time, and is reported as
a fraction of the device's peak memory bandwidth when the device kind is in
``PEAK_BANDWIDTH_GBPS``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from rlax_kernels.paged_attention.ops import Backend, _platform, paged_attention
from rlax_kernels.paged_attention.reference import default_scale, paged_attention_reference
from rlax_kernels.paged_attention.testing import make_paged_case

# Peak HBM bandwidth per chip (GB/s) from the vendors' spec sheets; matched by substring
# of `device.device_kind`, first match wins (so more specific names come first).
PEAK_BANDWIDTH_GBPS: tuple[tuple[str, float], ...] = (
    ("TPU v2", 700.0),
    ("TPU v3", 900.0),
    ("TPU v4 lite", 614.0),
    ("TPU v4", 1228.0),
    ("TPU v5 lite", 819.0),
    ("TPU v5e", 819.0),
    ("TPU v5p", 2765.0),
    ("TPU v5", 2765.0),
    ("TPU v6 lite", 1640.0),
    ("TPU v6e", 1640.0),
    ("TPU7x", 7370.0),
    ("H200", 4800.0),
    ("GH200", 4000.0),
    ("H100 PCIe", 2000.0),
    ("H100", 3350.0),
    ("H800", 3350.0),
    ("B200", 8000.0),
    ("A100-SXM4-80GB", 2039.0),
    ("A100 80GB PCIe", 1935.0),
    ("A100", 1555.0),
    ("L40S", 864.0),
    ("L4", 300.0),
    ("A10G", 600.0),
    ("V100", 900.0),
    ("T4", 320.0),
    ("RTX 4090", 1008.0),
)


def peak_bandwidth_gbps(device_kind: str) -> float | None:
    """The peak memory bandwidth of a device kind in GB/s, or None when it is not known."""
    for needle, gbps in PEAK_BANDWIDTH_GBPS:
        if needle in device_kind:
            return gbps
    return None


@dataclasses.dataclass(frozen=True)
class DecodeBenchConfig:
    """One decode batch: ``batch`` sequences of random lengths around ``mean_length``."""

    batch: int = 32
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 16
    mean_length: int = 1024
    dtype: str = "bfloat16"
    pages_per_compute_block: int = 8
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("batch", "num_heads", "num_kv_heads", "head_dim", "page_size", "mean_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"DecodeBenchConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"DecodeBenchConfig.num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"DecodeBenchConfig.dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")
        ppb = self.pages_per_compute_block
        if ppb < 1 or ppb & (ppb - 1):
            raise ValueError(f"DecodeBenchConfig.pages_per_compute_block must be a power of two, got {ppb}")


# Interpret mode runs every grid step through Python callbacks: keep the CPU case small.
CPU_CONFIG = DecodeBenchConfig(
    batch=4,
    num_heads=8,
    num_kv_heads=2,
    head_dim=64,
    page_size=16,
    mean_length=192,
    dtype="float32",
    pages_per_compute_block=4,
)


def default_config() -> DecodeBenchConfig:
    """The device-sized config on TPU/GPU, the small one on CPU."""
    return CPU_CONFIG if _platform() == "cpu" else DecodeBenchConfig()


@dataclasses.dataclass(frozen=True)
class BenchCase:
    q: jax.Array
    k_pages: jax.Array
    v_pages: jax.Array
    lengths: jax.Array
    block_tables: jax.Array
    useful_bytes: int


def make_case(config: DecodeBenchConfig) -> BenchCase:
    """Random lengths in ``[mean/2, 3*mean/2]``; the table is padded to a multiple of
    ``16 * pages_per_compute_block`` columns so JAX's kernels accept it (their block and
    split counts must divide the table width); unused entries point at page 0."""
    rng = np.random.default_rng(config.seed)
    lo, hi = max(1, config.mean_length // 2), max(1, 3 * config.mean_length // 2)
    lengths = rng.integers(lo, hi + 1, size=config.batch).tolist()
    dtype = jnp.float32 if config.dtype == "float32" else jnp.bfloat16
    case = make_paged_case(
        config.seed,
        seq_lens=lengths,
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        page_size=config.page_size,
        dtype=dtype,
        poison=False,
        extra_table_columns=0,
    )
    multiple = 16 * config.pages_per_compute_block
    width = -(-case.block_tables.shape[1] // multiple) * multiple
    tables = np.asarray(case.block_tables)
    total_pages = case.k_pages.shape[1]
    tables = np.where(tables < total_pages, tables, 0)
    tables = np.pad(tables, ((0, 0), (0, width - tables.shape[1])))
    itemsize = jnp.dtype(dtype).itemsize
    kv = 2 * sum(lengths) * config.num_kv_heads * config.head_dim * itemsize
    qo = 2 * config.batch * config.num_heads * config.head_dim * itemsize
    return BenchCase(
        case.q, case.k_pages, case.v_pages, case.seq_lens, jnp.asarray(tables, jnp.int32), kv + qo
    )


# (implementation, mode) per platform, in report order.
PLAN: dict[str, tuple[tuple[str, str], ...]] = {
    "tpu": (("rlax_pallas_tpu", "native"), ("xla_reference", "xla"), ("jax_pallas_tpu", "native")),
    "gpu": (("rlax_pallas_gpu", "native"), ("xla_reference", "xla"), ("jax_pallas_gpu", "native")),
    "cpu": (
        ("xla_reference", "xla"),
        ("rlax_cpu", "native"),
        ("rlax_xla", "xla"),
        ("rlax_pallas_tpu", "interpret"),
        ("jax_pallas_tpu", "interpret"),
        ("rlax_pallas_gpu", "interpret"),
        ("jax_pallas_gpu", "interpret"),
    ),
}


def implementation_names() -> list[str]:
    """Names of the implementations compared on this platform."""
    return [name for name, _ in PLAN.get(_platform(), PLAN["cpu"])]


@dataclasses.dataclass(frozen=True)
class Implementation:
    name: str
    mode: str  # "native" (compiled for the device), "interpret" or "xla"
    fn: Callable[[], jax.Array]


def implementations(case: BenchCase, config: DecodeBenchConfig) -> list[Implementation]:
    """What to compare on this platform; each ``fn`` runs one decode step and returns the output."""
    platform = _platform() if _platform() in PLAN else "cpu"
    args = (case.q, case.k_pages, case.v_pages, case.lengths, case.block_tables)
    ppb = config.pages_per_compute_block
    width = case.block_tables.shape[1]
    # JAX's kernels apply no softmax scale: hand them pre-scaled queries.
    scaled_q = (case.q.astype(jnp.float32) * default_scale(config.head_dim)).astype(case.q.dtype)
    jax_args = (scaled_q, *args[1:])

    def ours(backend: Backend, interpret: bool) -> Callable[[], jax.Array]:
        return lambda: paged_attention(
            *args, backend=backend, interpret=interpret, pages_per_compute_block=ppb
        )

    def jax_tpu() -> Callable[[], jax.Array]:
        from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as jax_paged_tpu

        fn = jax.jit(lambda *a: jax_paged_tpu(*a, pages_per_compute_block=ppb))
        if platform == "tpu":
            return lambda: fn(*jax_args)
        from jax.experimental.pallas import tpu as pltpu

        def interpreted() -> jax.Array:
            with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
                out: jax.Array = jax.block_until_ready(fn(*jax_args))
                return out

        return interpreted

    def jax_gpu(interpret: bool) -> Callable[[], jax.Array]:
        from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention as jax_paged_gpu

        k_splits = max(1, min(16, width // ppb))
        fn = jax.jit(
            lambda q, k, v, lens, tables: jax_paged_gpu(
                q, k, v, tables, lens, pages_per_compute_block=ppb, k_splits=k_splits, interpret=interpret
            )
        )
        return lambda: fn(*jax_args)

    reference = jax.jit(paged_attention_reference)
    builders: dict[str, Callable[[bool], Callable[[], jax.Array]]] = {
        "xla_reference": lambda interpret: lambda: reference(*args),
        "rlax_cpu": lambda interpret: ours("cpu", False),
        "rlax_xla": lambda interpret: ours("xla", False),
        "rlax_pallas_tpu": lambda interpret: ours("pallas_tpu", interpret),
        "rlax_pallas_gpu": lambda interpret: ours("pallas_gpu", interpret),
        "jax_pallas_tpu": lambda interpret: jax_tpu(),
        "jax_pallas_gpu": jax_gpu,
    }
    return [Implementation(name, mode, builders[name](mode == "interpret")) for name, mode in PLAN[platform]]


def median_seconds(fn: Callable[[], jax.Array], *, iters: int, warmup: int = 1) -> float:
    """Median wall time of ``fn`` (results are waited for; the first ``warmup`` calls compile)."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@dataclasses.dataclass(frozen=True)
class BenchResult:
    name: str
    mode: str
    seconds: float
    gbps: float
    peak_fraction: float | None
    max_abs_error: float


def run(config: DecodeBenchConfig | None = None, *, iters: int | None = None) -> list[BenchResult]:
    """Time every implementation on one case and check each against the reference output."""
    config = default_config() if config is None else config
    platform = _platform()
    iters = (3 if platform == "cpu" else 50) if iters is None else iters
    case = make_case(config)
    peak = peak_bandwidth_gbps(jax.devices()[0].device_kind) if platform != "cpu" else None
    impls = implementations(case, config)
    expected = np.asarray(impls[[i.name for i in impls].index("xla_reference")].fn(), np.float32)
    results = []
    for impl in impls:
        error = float(np.max(np.abs(np.asarray(impl.fn(), np.float32) - expected)))
        seconds = median_seconds(impl.fn, iters=iters)
        gbps = case.useful_bytes / seconds / 1e9
        results.append(
            BenchResult(impl.name, impl.mode, seconds, gbps, None if peak is None else gbps / peak, error)
        )
    return results


def format_table(results: list[BenchResult], config: DecodeBenchConfig) -> str:
    """A text table with each result's time, bandwidth, fraction of peak and speed ratios."""
    by_name = {r.name: r for r in results}
    ref = by_name["xla_reference"].seconds
    device = jax.devices()[0].device_kind
    lines = [
        f"paged decode attention on {device} ({_platform()}): batch={config.batch} heads={config.num_heads}/"
        f"{config.num_kv_heads} head_dim={config.head_dim} page_size={config.page_size} "
        f"mean_length={config.mean_length} {config.dtype}",
        f"{'implementation':<18} {'mode':<10} {'ms':>10} {'GB/s':>9} {'of peak':>8} "
        f"{'ref/this':>9} {'jax/this':>9} {'max|err|':>9}",
    ]
    for r in results:
        peer = by_name.get(r.name.replace("rlax_", "jax_")) if r.name.startswith("rlax_") else None
        peak = "n/a" if r.peak_fraction is None else f"{r.peak_fraction:.1%}"
        vs_peer = "" if peer is None else f"{peer.seconds / r.seconds:.2f}x"
        lines.append(
            f"{r.name:<18} {r.mode:<10} {r.seconds * 1e3:>10.3f} {r.gbps:>9.2f} {peak:>8} "
            f"{ref / r.seconds:>8.2f}x {vs_peer:>9} {r.max_abs_error:>9.2e}"
        )
    if _platform() == "cpu":
        lines.append(
            "cpu: 'interpret' rows time Pallas' interpreter (not a device) and are comparable only with "
            "each other; 'rlax_cpu' is the native kernel the CPU engine runs, 'rlax_xla' the XLA decode "
            "path, 'xla_reference' the gather-everything reference both are tested against."
        )
    return "\n".join(lines)


def write_json(results: list[BenchResult], config: DecodeBenchConfig, path: str) -> None:
    """Record a run as JSON (temp file, fsync, rename)."""
    record = {
        "device_kind": jax.devices()[0].device_kind,
        "platform": _platform(),
        "config": dataclasses.asdict(config),
        "results": [dataclasses.asdict(r) for r in results],
    }
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.add_argument("--iters", type=int, default=None, help="timed calls per implementation")
    args = parser.parse_args(argv)
    config = default_config()
    results = run(config, iters=args.iters)
    print(format_table(results, config))
    if args.json:
        write_json(results, config, args.json)


if __name__ == "__main__":
    main()
