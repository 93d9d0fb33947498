"""What every section module shares: the error type, the checks, the `Section` base."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

AUTO = "auto"
HOST_PORT = re.compile(r"^[^\s:/]+:\d{1,5}$")
_ADDRESS = re.compile(r"^(auto|(tcp://[^\s:]+:\d{1,5})|(ipc://\S+)|(inproc://\S+))$")
# The roles of a run's processes: the keys of per-role settings (resources, interpreters).
ROLES = ("controller", "trainer", "worker", "paramserver", "verifier")


# sysexits.h EX_CONFIG: what every `rlax <component>` returns when its config is rejected.
# The supervisor never restarts a process that exits with it: the same config would be
# rejected again, so the run stops with the component's message instead.
EXIT_CONFIG_ERROR = 78


class ConfigError(ValueError):
    """A run config is invalid; the message names the field path and the bad value."""


T = TypeVar("T")


def rejected_by(component: str, build: Callable[[], T]) -> T:
    """`build()`, with a component's `ValueError` (msgspec's `ValidationError` is one)
    reported as a `ConfigError` that names the component."""
    try:
        return build()
    except ConfigError:
        raise
    except ValueError as error:
        raise ConfigError(f"{component} rejects the config: {error}") from None


def check(ok: bool, field: str, value: Any, rule: str) -> None:
    # msgspec appends "- at `$.section`" to the message, so the field inside it is named here.
    if not ok:
        raise ValueError(f"{field} = {value!r}: {rule}")


def check_address(field: str, value: str) -> None:
    check(
        bool(_ADDRESS.match(value)), field, value, "must be 'auto' or a ZeroMQ endpoint like tcp://host:port"
    )


class Section(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A part of the run config: frozen, typed, unknown keys rejected."""
