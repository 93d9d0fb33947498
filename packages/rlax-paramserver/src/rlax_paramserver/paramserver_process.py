"""`rlax-paramserver` command line: serve until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import logging
import os
import pathlib
import signal
import sys
import threading

from rlax_paramserver.config import DEFAULT_BIND, ServerConfig
from rlax_paramserver.server import ParamServer
from rlax_protocol import CurveServerConfig, load_curve_keypair, load_curve_public_key
from rlax_protocol.auth import InsecureBindError

# sysexits.h EX_CONFIG, the exit code of every RLAX component whose config is rejected.
EXIT_CONFIG_ERROR = 78


def _allowed_keys(paths: list[str]) -> frozenset[bytes]:
    keys: set[bytes] = set()
    for raw in paths:
        path = pathlib.Path(raw)
        files = sorted(path.glob("*.key")) if path.is_dir() else [path]
        if not files:
            raise SystemExit(f"--curve-allow {raw}: no *.key public key files found")
        keys.update(load_curve_public_key(str(f)) for f in files)
    return frozenset(keys)


def parse_config(argv: list[str] | None = None) -> tuple[ServerConfig, pathlib.Path | None, str]:
    parser = argparse.ArgumentParser(
        prog="rlax-paramserver", description="RLAX parameter server (versioned weight store)."
    )
    parser.add_argument(
        "--bind", default=DEFAULT_BIND, help="ZeroMQ endpoint; tcp://127.0.0.1:* picks a free port"
    )
    parser.add_argument("--keep", type=int, default=3, help="newest versions to hold in memory")
    parser.add_argument(
        "--state-dir",
        type=pathlib.Path,
        default=None,
        help="persist the newest --keep versions here (and load them at start)",
    )
    parser.add_argument(
        "--rest-dir",
        type=pathlib.Path,
        default=None,
        help="with a --state-dir in memory (e.g. under /dev/shm): where the versions rest while "
        "the server is stopped (copied back on start when --state-dir is empty)",
    )
    parser.add_argument(
        "--no-fsync",
        action="store_true",
        help="persist without fsync: a version survives a SIGKILL, not a crash of the machine",
    )
    parser.add_argument("--workers", type=int, default=4, help="request-handling threads")
    parser.add_argument("--io-threads", type=int, default=2, help="ZeroMQ I/O threads")
    parser.add_argument(
        "--lease-ttl", type=float, default=30.0, help="seconds before an idle pull lease expires"
    )
    parser.add_argument(
        "--push-idle-timeout", type=float, default=120.0, help="seconds before an idle push is dropped"
    )
    parser.add_argument("--max-frame-bytes", type=int, default=256 * 1024 * 1024)
    parser.add_argument("--max-message-bytes", type=int, default=64 * 1024 * 1024)
    parser.add_argument(
        "--max-clients", type=int, default=4096, help="handshaken connections remembered at most"
    )
    parser.add_argument("--max-waiters", type=int, default=4096, help="long-polls held at most")
    parser.add_argument(
        "--curve-keypair", help="ZeroMQ secret certificate file of this server (enables CURVE)"
    )
    parser.add_argument(
        "--curve-allow", action="append", default=[], help="public key file or folder of *.key files"
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="listen beyond loopback without authentication (normally the run's credential, "
        "RLAX_CREDENTIAL, authenticates every client)",
    )
    parser.add_argument("--ready-file", type=pathlib.Path, help="write the bound address here once serving")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    curve = None
    if args.curve_keypair:
        if not args.curve_allow:
            parser.error("--curve-keypair needs at least one --curve-allow")
        curve = CurveServerConfig(
            keypair=load_curve_keypair(args.curve_keypair), allowed_clients=_allowed_keys(args.curve_allow)
        )
    elif args.curve_allow:
        parser.error("--curve-allow needs --curve-keypair")
    try:
        config = ServerConfig(
            bind=args.bind,
            keep=args.keep,
            state_dir=args.state_dir,
            rest_dir=args.rest_dir,
            fsync=not args.no_fsync,
            workers=args.workers,
            io_threads=args.io_threads,
            lease_ttl_s=args.lease_ttl,
            push_idle_timeout_s=args.push_idle_timeout,
            max_frame_bytes=args.max_frame_bytes,
            max_message_bytes=args.max_message_bytes,
            max_clients=args.max_clients,
            max_waiters=args.max_waiters,
            insecure=True if args.insecure else None,
            curve=curve,
        )
    except ValueError as err:
        # EX_CONFIG, like every RLAX component: a supervisor does not restart a rejected config.
        print(f"rlax-paramserver: invalid config: {err}", file=sys.stderr)
        raise SystemExit(EXIT_CONFIG_ERROR) from None
    return config, args.ready_file, args.log_level


def main(argv: list[str] | None = None) -> int:
    config, ready_file, level = parse_config(argv)
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server = ParamServer(config)
    try:
        address = server.start()
    except InsecureBindError as err:
        print(f"rlax-paramserver: {err}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if ready_file is not None:
        tmp = ready_file.with_name(ready_file.name + ".tmp")
        tmp.write_text(address)
        os.replace(tmp, ready_file)
    print(f"rlax-paramserver serving on {address}", flush=True)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
