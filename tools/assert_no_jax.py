"""Fails when installing the JAX-free packages pulled JAX (or jaxlib) into the environment."""

import importlib.metadata
import sys

FORBIDDEN = {"jax", "jaxlib", "flax", "torch"}

installed = {dist.metadata["Name"].lower() for dist in importlib.metadata.distributions()}
leaked = sorted(installed & FORBIDDEN)
if leaked:
    sys.exit(f"JAX-free install pulled in: {', '.join(leaked)}")
import rlax_protocol  # noqa: E402,F401

print(f"ok: no JAX among {len(installed)} installed distributions")
