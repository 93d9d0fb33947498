"""Who may talk to a server, and what each role may ask: the run's control plane.

A run's launcher makes fresh secrets for every run (`RunKeys.generate`) and gives each
process the `Credential` of its role only (the environment variable `CREDENTIAL_ENV`,
never a file). ZeroMQ's own authentication (ZAP) checks a client *while it connects*,
before it can deliver a single message, so a stranger can neither send requests nor make
a server buffer bytes:

* ``plain`` (every address of the run is loopback): the client presents its role and the
  role's token (ZeroMQ PLAIN). The server holds only each token's SHA-256 and compares in
  constant time. Nothing is encrypted: on loopback only root can read the traffic, and
  root owns the machine anyway.
* ``curve`` (any address beyond loopback): each role has its own CURVE key pair and every
  server the run's server key pair; the server admits exactly the run's role keys, and
  the traffic is encrypted and authenticated both ways.

The role a connection authenticated as travels with every message it sends (ZeroMQ's
``User-Id`` message property), so a server checks each request against its
`Permissions` table: a worker cannot push weights, a stranger cannot ask for batches. A
message from an earlier run fails at the door: its secrets were that run's.

A process without a credential is *open*: it authenticates nobody. Servers refuse to
listen beyond loopback while open unless told explicitly (`INSECURE_ENV=1`, set by the
launchers for ``security.insecure: true``, or a server's ``insecure`` argument).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import ipaddress
import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any, Literal
from urllib.parse import urlsplit

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from rlax_protocol.messages import ErrorReply, Hello, Message

log = logging.getLogger(__name__)

CREDENTIAL_ENV = "RLAX_CREDENTIAL"
"""Environment variable holding a process's `Credential` as JSON."""

INSECURE_ENV = "RLAX_INSECURE"
"""``1``: this process may listen beyond loopback without authenticating anyone."""

CLIENT_ROLES = ("trainer", "worker", "controller", "observer")
"""Roles that connect to servers. ``observer`` may only ask read-only questions (status, stats)."""

ANY_ROLE = "*"
"""In a `Permissions` table: any authenticated role."""

Mechanism = Literal["plain", "curve"]


class InsecureBindError(RuntimeError):
    """A server without a credential was asked to listen beyond loopback."""


def is_loopback(address: str) -> bool:
    """True for ``tcp://127.x.x.x:P``, ``tcp://[::1]:P``, ``tcp://localhost:P``, ``ipc://``
    and ``inproc://``; False for a wildcard (``*``, ``0.0.0.0``), another host or name."""
    if address.startswith(("inproc://", "ipc://")):
        return True
    try:
        host = urlsplit(address).hostname or ""
    except ValueError:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclasses.dataclass(frozen=True)
class Credential:
    """One process's part of a run's secrets.

    role: what this process is when it connects (``trainer``, ``worker``, ``controller``,
        ``observer``; a pure server such as the parameter server is ``server``).
    mechanism: ``plain`` or ``curve`` (the same for every process of a run).
    secret: plain: this role's token (empty for a pure server).
    client_public / client_secret: curve: this role's key pair (z85 text).
    server_public / server_secret: curve: the run's server key pair (z85 text); every
        process that serves holds the secret half.
    accepted: what a server admits. plain: role -> SHA-256 of its token; curve: client
        public key (z85) -> role.
    run_id: names the run (logged, never trusted).
    """

    role: str
    mechanism: Mechanism
    accepted: Mapping[str, str]
    secret: str = ""
    client_public: str = ""
    client_secret: str = ""
    server_public: str = ""
    server_secret: str = ""
    run_id: str = ""

    def __post_init__(self) -> None:
        if self.mechanism not in ("plain", "curve"):
            raise ValueError(f"Credential.mechanism={self.mechanism!r}: must be 'plain' or 'curve'")
        if self.mechanism == "curve" and not (self.server_public and self.server_secret):
            raise ValueError("Credential: curve needs the run's server key pair")

    def __repr__(self) -> str:  # never print a secret
        return f"Credential(role={self.role!r}, mechanism={self.mechanism!r}, run_id={self.run_id!r})"

    # -- serialisation (an environment variable; the Ray launcher hands it over the same way)

    def to_json(self) -> str:
        return json.dumps({**dataclasses.asdict(self), "accepted": dict(self.accepted)})

    @classmethod
    def from_json(cls, text: str) -> Credential:
        try:
            fields = json.loads(text)
            if not isinstance(fields, dict) or not isinstance(fields.get("accepted"), dict):
                raise TypeError("not an object with an 'accepted' map")
            return cls(**fields)
        except (ValueError, TypeError) as error:
            raise ValueError(f"{CREDENTIAL_ENV} does not hold a credential: {error}") from None

    # -- client side

    def apply_client(self, socket: zmq.Socket[Any]) -> None:
        """Make `socket` (before `connect`) present this credential."""
        if self.mechanism == "plain":
            socket.plain_username = self.role.encode()
            socket.plain_password = self.secret.encode()
        else:
            socket.curve_publickey = self.client_public.encode()
            socket.curve_secretkey = self.client_secret.encode()
            socket.curve_serverkey = self.server_public.encode()

    # -- server side

    def role_of_plain(self, username: str, password: str) -> str | None:
        digest = self.accepted.get(username)
        if digest is None or not hmac.compare_digest(digest, _digest(password)):
            return None
        return username

    def role_of_curve(self, public_z85: str) -> str | None:
        return self.accepted.get(public_z85)


@dataclasses.dataclass(frozen=True)
class RunKeys:
    """Every secret of one run; the launcher keeps it in memory and hands out `credential(role)`."""

    mechanism: Mechanism
    tokens: Mapping[str, str]
    client_keys: Mapping[str, tuple[str, str]]
    server_key: tuple[str, str]
    run_id: str

    def __repr__(self) -> str:
        return f"RunKeys(mechanism={self.mechanism!r}, run_id={self.run_id!r})"

    @classmethod
    def generate(cls, mechanism: Mechanism, roles: Iterable[str] = CLIENT_ROLES) -> RunKeys:
        roles = tuple(roles)
        tokens: dict[str, str] = {}
        client_keys: dict[str, tuple[str, str]] = {}
        server_key = ("", "")
        if mechanism == "plain":
            tokens = {role: secrets.token_hex(32) for role in roles}
        else:
            for role in roles:
                public, secret = zmq.curve_keypair()
                client_keys[role] = (public.decode(), secret.decode())
            public, secret = zmq.curve_keypair()
            server_key = (public.decode(), secret.decode())
        return cls(mechanism, tokens, client_keys, server_key, run_id=secrets.token_hex(6))

    @classmethod
    def for_addresses(cls, addresses: Iterable[str]) -> RunKeys:
        """``plain`` when every address is loopback, else ``curve``."""
        local = all(is_loopback(a) for a in addresses)
        return cls.generate("plain" if local else "curve")

    def credential(self, role: str) -> Credential:
        """What a process of `role` gets: its own secret, what servers admit, never another role's secret."""
        if self.mechanism == "plain":
            accepted = {r: _digest(t) for r, t in self.tokens.items()}
            return Credential(
                role=role,
                mechanism="plain",
                accepted=accepted,
                secret=self.tokens.get(role, ""),
                run_id=self.run_id,
            )
        public, secret = self.client_keys.get(role, ("", ""))
        return Credential(
            role=role,
            mechanism="curve",
            accepted={pub: r for r, (pub, _) in self.client_keys.items()},
            client_public=public,
            client_secret=secret,
            server_public=self.server_key[0],
            server_secret=self.server_key[1],
            run_id=self.run_id,
        )

    def environment(self, role: str) -> dict[str, str]:
        """Environment variables that give a process of `role` its credential."""
        return {CREDENTIAL_ENV: self.credential(role).to_json()}


# --------------------------------------------------------------------------- the process's credential

_process_lock = threading.Lock()
_process_credential: Credential | None = None
_process_loaded = False


def process_credential() -> Credential | None:
    """This process's credential (read once from `CREDENTIAL_ENV`), or None when it runs open."""
    global _process_credential, _process_loaded
    with _process_lock:
        if not _process_loaded:
            text = os.environ.get(CREDENTIAL_ENV, "")
            _process_credential = Credential.from_json(text) if text else None
            _process_loaded = True
        return _process_credential


def set_process_credential(credential: Credential | None) -> None:
    """Replace this process's credential (tests; a Ray actor that received it as an argument)."""
    global _process_credential, _process_loaded
    with _process_lock:
        _process_credential = credential
        _process_loaded = True


def insecure_allowed() -> bool:
    return os.environ.get(INSECURE_ENV, "") == "1"


# --------------------------------------------------------------------------- ZAP


class _RoleAuthenticator(ThreadAuthenticator):
    """ZAP handler admitting the run's roles; the role becomes the connection's User-Id.

    pyzmq's PLAIN handler compares passwords with ``==`` and logs them at debug level;
    this one compares digests in constant time and logs neither.
    """

    def __init__(self, context: zmq.Context[Any], credential: Credential, server: str) -> None:
        super().__init__(context)
        self.credential = credential
        self.server = server
        self.refused = 0
        self._last_log = 0.0
        if credential.mechanism == "curve":
            self.configure_curve_callback(domain="*", credentials_provider=self)

    def _refuse(self, why: str) -> None:
        self.refused += 1
        now = time.monotonic()
        if now - self._last_log > 1.0:  # a flood of strangers must not flood the log
            self._last_log = now
            log.warning("%s: refused a connection (%s; %d refused so far)", self.server, why, self.refused)

    def _authenticate_plain(self, domain: str, username: str, password: str) -> tuple[bool, bytes]:
        if self.credential.mechanism == "plain" and self.credential.role_of_plain(username, password):
            return True, b"OK"
        self._refuse(f"PLAIN credential for role {username[:32]!r} not of this run")
        return False, b"Invalid credentials"

    def callback(self, domain: str, key: bytes) -> bool:  # CURVE: the credentials provider
        if self.credential.role_of_curve(key.decode("ascii", "replace")) is not None:
            return True
        self._refuse("CURVE key not of this run")
        return False

    def curve_user_id(self, client_public_key: bytes) -> str:
        return self.credential.role_of_curve(z85.encode(client_public_key).decode()) or ""


class _SharedAuthenticators:
    """ZAP is one handler per context (``inproc://zeromq.zap.01``): servers sharing a
    context share it; it stops when the last of them closes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_context: dict[int, tuple[_RoleAuthenticator, int]] = {}

    def acquire(self, context: zmq.Context[Any], credential: Credential, server: str) -> _RoleAuthenticator:
        with self._lock:
            held = self._by_context.get(id(context))
            if held is not None:
                self._by_context[id(context)] = (held[0], held[1] + 1)
                return held[0]
            auth = _RoleAuthenticator(context, credential, server)
            auth.start()
            self._by_context[id(context)] = (auth, 1)
            return auth

    def release(self, context: zmq.Context[Any]) -> None:
        with self._lock:
            held = self._by_context.get(id(context))
            if held is None:
                return
            if held[1] > 1:
                self._by_context[id(context)] = (held[0], held[1] - 1)
                return
            del self._by_context[id(context)]
        held[0].stop()


_AUTHENTICATORS = _SharedAuthenticators()


# --------------------------------------------------------------------------- permissions

Permissions = Mapping[type[Message], frozenset[str]]
"""Message type -> roles that may send it (`ANY_ROLE`: any authenticated role). `Hello`
is always allowed; a type that is not listed is refused."""


def roles(*names: str) -> frozenset[str]:
    return frozenset(names)


class ServerAuth:
    """One server's side of the control plane: authentication at connect, permissions per message.

    `permissions` None lets any authenticated role send anything. Call
    `secure(context, socket, address)` before binding; it refuses an address beyond
    loopback when the server runs open (no credential) unless `insecure`. Then, for each
    request, `refusal(frame, message)` returns the `ErrorReply` for a message its
    sender's role may not send (None when allowed). `frame` is any frame of the request
    as received from the socket (`copy=False`), which carries the connection's role.
    """

    def __init__(
        self,
        server: str,
        permissions: Permissions | None,
        *,
        credential: Credential | None = None,
        insecure: bool | None = None,
        max_message_bytes: int | None = None,
    ) -> None:
        self.server = server
        self.permissions = permissions
        self.credential = credential if credential is not None else process_credential()
        self.insecure = insecure_allowed() if insecure is None else insecure
        self.max_message_bytes = max_message_bytes
        self.refused = 0
        self._last_log = 0.0
        self._context: zmq.Context[Any] | None = None

    @property
    def enforced(self) -> bool:
        return self.credential is not None

    def secure(self, context: zmq.Context[Any], socket: zmq.Socket[Any], address: str) -> None:
        """Before `socket.bind(address)`: authentication and the inbound size limit."""
        if self.max_message_bytes is not None:
            # ZeroMQ drops a peer that sends a bigger frame before buffering it whole.
            socket.maxmsgsize = self.max_message_bytes
        credential = self.credential
        if credential is None:
            if not is_loopback(address) and not self.insecure:
                raise InsecureBindError(
                    f"{self.server}: refusing to listen on {address} without authentication: give the "
                    f"process a credential ({CREDENTIAL_ENV}, made by `rlax launch`) or allow it "
                    f"explicitly (security.insecure: true / {INSECURE_ENV}=1)"
                )
            return
        _AUTHENTICATORS.acquire(context, credential, self.server)
        self._context = context
        if credential.mechanism == "plain":
            socket.plain_server = True
        else:
            socket.curve_server = True
            socket.curve_secretkey = credential.server_secret.encode()
            socket.curve_publickey = credential.server_public.encode()

    def close(self) -> None:
        """Stop this server's share of the context's ZAP handler (after closing the socket)."""
        if self._context is not None:
            _AUTHENTICATORS.release(self._context)
            self._context = None

    @staticmethod
    def role_of(frame: Any) -> str:
        """The authenticated role of the connection `frame` came from ('' when open)."""
        try:
            return str(frame.get("User-Id") or "")
        except (zmq.ZMQError, AttributeError, TypeError):
            return ""

    def _refuse_unauthenticated(self, message: Message) -> ErrorReply:
        self.refused += 1
        return ErrorReply(
            code="forbidden",
            message=f"{self.server} does not accept {type(message).__name__} unauthenticated",
        )

    def refusal(self, role: str, message: Message) -> ErrorReply | None:
        """The reply refusing `message` from `role`, or None when it may be served."""
        if not self.enforced or isinstance(message, Hello):
            return None
        if self.permissions is None:  # any authenticated role may send anything
            return None if role else self._refuse_unauthenticated(message)
        allowed = self.permissions.get(type(message), frozenset())
        if role and (ANY_ROLE in allowed or role in allowed):
            return None
        self.refused += 1
        name = type(message).__name__
        now = time.monotonic()
        if now - self._last_log > 1.0:
            self._last_log = now
            log.warning(
                "%s: refused %s from role %r (allowed: %s; %d refused so far)",
                self.server,
                name,
                role,
                sorted(allowed) or "nobody",
                self.refused,
            )
        who = f"role {role!r}" if role else "an unauthenticated connection"
        listed = ", ".join(sorted(allowed)) or "nobody"
        return ErrorReply(
            code="forbidden", message=f"{self.server} does not accept {name} from {who} (allowed: {listed})"
        )


def client_credential(explicit: Credential | None = None) -> Credential | None:
    """The credential a client socket presents: `explicit`, else the process's."""
    return explicit if explicit is not None else process_credential()


# --------------------------------------------------------------------------- `rlax keys`


def write_credentials(
    directory: str, keys: RunKeys, roles: Iterable[str] = (*CLIENT_ROLES, "server")
) -> list[str]:
    """Write one credential file per role (``ROLE.json``, mode 0600, written to a
    temporary name and renamed) for components started by hand; returns the paths.
    Hand each node only its role's file: ``RLAX_CREDENTIAL="$(cat worker.json)"``."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    paths = []
    for role in roles:
        path = os.path.join(directory, f"{role}.json")
        tmp = f"{path}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(keys.credential(role).to_json())
        os.replace(tmp, path)
        paths.append(path)
    return paths


def keys_main(argv: list[str] | None = None) -> int:
    """`rlax keys DIR [--mechanism plain|curve]`: a run's credentials for components
    started by hand (`rlax launch` makes its own and writes none)."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="rlax keys",
        description="write a run's credentials, one file per role, for components started by hand",
    )
    parser.add_argument("directory", help="where to write ROLE.json (mode 0600)")
    parser.add_argument(
        "--mechanism",
        choices=("plain", "curve"),
        default="curve",
        help="curve (default: authenticated and encrypted, for any network) or plain (loopback only)",
    )
    args = parser.parse_args(argv)
    keys = RunKeys.generate(args.mechanism)
    for path in write_credentials(args.directory, keys):
        print(path)
    print(
        f'give each process its role\'s file: RLAX_CREDENTIAL="$(cat {args.directory}/worker.json)" rlax worker ...'
    )
    return 0
