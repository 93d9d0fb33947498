"""The trainer's peak memory: host RSS on CPU, device memory on accelerators."""

from __future__ import annotations

import resource
import sys

import jax

__all__ = ["peak_memory_metrics"]


def peak_rss_mb() -> float:
    """This process's peak resident set size so far, in MiB (ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def peak_memory_metrics() -> dict[str, float]:
    """{"trainer_peak_rss_mb"} always, plus {"trainer_peak_device_mb"} (the largest peak over
    this process's accelerators) where the backend reports `peak_bytes_in_use`."""
    out = {"trainer_peak_rss_mb": peak_rss_mb()}
    peaks = []
    for device in jax.local_devices():
        if device.platform == "cpu":
            continue  # host memory: already the RSS
        stats = device.memory_stats() or {}
        if "peak_bytes_in_use" in stats:
            peaks.append(stats["peak_bytes_in_use"])
    if peaks:
        out["trainer_peak_device_mb"] = max(peaks) / 2**20
    return out
