from __future__ import annotations

import os

import pytest

from rlax_data.verify import Sandbox, SandboxConfig


@pytest.fixture(scope="session")
def sandbox() -> Sandbox:
    return Sandbox(SandboxConfig(timeout_s=10, cpu_s=5, memory_mb=512, workers=min(4, os.cpu_count() or 1)))
