"""`security:` who may talk to the run's servers."""

from __future__ import annotations

from rlax_core.config.base import Section


class SecuritySection(Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Who may talk to the run's servers (`rlax_protocol.auth`).

    By default every launch makes fresh secrets for the run and gives each process its
    role's credential: on loopback a token checked when a client connects (ZeroMQ PLAIN,
    nothing encrypted), beyond loopback a CURVE key pair per role (authenticated and
    encrypted). Each server also checks which role may send which message.
    `insecure: true` turns all of it off: any process that reaches a port can steer the
    run; servers then listen beyond loopback only because this says so."""

    insecure: bool = False
