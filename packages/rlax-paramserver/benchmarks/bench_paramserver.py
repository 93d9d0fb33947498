"""Parameter-server push/pull throughput beside raw ZeroMQ PUSH/PULL of the same bytes.

Two weight trees: SmolLM2-135M's shapes (hidden 576, intermediate 1536, 9 query / 3
key-value heads of 64, 30 layers, vocab 49152, tied embeddings: ~538 MB in float32, ~269 MB
in bfloat16) and the tiny test model's (hidden 64, 2 layers, vocab 128: ~0.3 MB, where a
transfer's fixed costs show). The server and the raw sender each run in their own process
with the same number of ZeroMQ I/O threads; 1, 4 and 8 pullers run either as threads of
this process or as separate processes (as real workers are), and so do the raw receivers;
everything goes over tcp loopback; receivers keep every frame until the transfer ends, as a
pull does. A pull includes its lease, pipelined chunk fetches, joining multi-frame tensors
and verifying every tensor's xxh3_64; the raw reference only moves the frames. Medians of
several rounds; ratio = ours / raw.

RLAX_BENCH_JSON=FILE adds `push_over_raw_min` and `pull_over_raw_min` (the lowest ratio over
models, dtypes and puller counts run so far into FILE, issue 33) and each row's ratio.
"""

from __future__ import annotations

import os
import pathlib
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import ml_dtypes
import numpy as np
import pytest
import zmq

from rlax_paramserver import ParamClient
from rlax_paramserver.testing import running_server_process
from rlax_protocol import DEFAULT_CHUNK_BYTES, encode_tree
from rlax_protocol.atomic_files import atomic_write_bytes

# (hidden, intermediate, layers, vocab, key-value width) of each tree.
SHAPES = {"smollm2": (576, 1536, 30, 49152, 192), "tiny": (64, 128, 2, 128, 32)}
IO_THREADS = 2
ROUNDS = 5
PULLERS = (1, 4, 8)


def weights_tree(model: str, dtype: np.dtype) -> dict:
    hidden, intermediate, num_layers, vocab, kv = SHAPES[model]
    rng = np.random.default_rng(0)

    def w(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32).astype(dtype)

    layers = {
        str(i): {
            "attn": {"q": w(hidden, hidden), "k": w(kv, hidden), "v": w(kv, hidden), "o": w(hidden, hidden)},
            "mlp": {
                "gate": w(intermediate, hidden),
                "up": w(intermediate, hidden),
                "down": w(hidden, intermediate),
            },
            "input_norm": w(hidden),
            "post_attn_norm": w(hidden),
        }
        for i in range(num_layers)
    }
    return {"embed": w(vocab, hidden), "layers": layers, "final_norm": w(hidden)}


def timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def concurrently(k: int, work: Callable[[int], None]) -> None:
    errors: list[BaseException] = []
    barrier = threading.Barrier(k)

    def run(i: int) -> None:
        try:
            barrier.wait()
            work(i)
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(k)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


class RawPeer:
    """The raw ZeroMQ peer subprocess, with PULL receivers and a PUSH sender here."""

    def __init__(self, frames: list[memoryview], streams: int) -> None:
        script = pathlib.Path(__file__).with_name("raw_zmq_peer.py")
        args = [sys.executable, str(script), str(streams), str(IO_THREADS), *(str(f.nbytes) for f in frames)]
        self.process = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
        assert self.process.stdout is not None
        control_port, pull_port, *ports = map(int, self.process.stdout.readline().split())
        context = zmq.Context.instance()
        self.control = context.socket(zmq.REQ)
        self.control.connect(f"tcp://127.0.0.1:{control_port}")
        self.pusher = context.socket(zmq.PUSH)
        self.pusher.connect(f"tcp://127.0.0.1:{pull_port}")
        self.ports = ports
        self.pullers = []
        for port in ports[: len(ports) // 2]:  # the other half is for puller processes
            socket = context.socket(zmq.PULL)
            socket.connect(f"tcp://127.0.0.1:{port}")
            self.pullers.append(socket)
        self.frames = frames

    def _command(self, command: str) -> None:
        self.control.send_string(command)

    def _done(self) -> None:
        if not self.control.poll(120_000):
            raise TimeoutError("raw peer: no answer within 120 s")
        assert self.control.recv_string() == "done"

    def pull(self, k: int) -> None:
        """k receivers here each get every frame (kept until all arrived, as a pull keeps them)."""
        if k > len(self.pullers):
            raise ValueError(f"pull({k}): this peer has {len(self.pullers)} in-process receivers")

        def receive(i: int) -> None:
            socket = self.pullers[i]
            held = []
            for _ in self.frames:
                if not socket.poll(120_000):
                    raise TimeoutError("raw PULL: no frame within 120 s")
                held.append(socket.recv(copy=False))

        receivers = [threading.Thread(target=receive, args=(i,)) for i in range(k)]
        for thread in receivers:
            thread.start()
        self._command(f"send {k} 0")
        for thread in receivers:
            thread.join()
        self._done()

    def push(self) -> None:
        """Every frame from here to the peer, which keeps them until all arrived."""
        self._command("recv")
        for frame in self.frames:
            self.pusher.send(frame, copy=False)
        self._done()

    def close(self) -> None:
        self._command("quit")
        self.control.poll(10_000)
        for socket in (*self.pullers, self.pusher, self.control):
            socket.close(linger=0)
        self.process.wait(30)
        if self.process.stdout is not None:
            self.process.stdout.close()


class PullerProcesses:
    """k puller processes (ours or raw); `run()` starts them at once and waits for all."""

    def __init__(self, args: list[list[str]], raw: RawPeer | None = None, raw_offset: int = 0) -> None:
        script = str(pathlib.Path(__file__).with_name("puller_process.py"))
        self.raw = raw
        self.raw_offset = raw_offset
        self.processes = [
            subprocess.Popen(
                [sys.executable, script, *a], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
            )
            for a in args
        ]
        for process in self.processes:
            assert process.stdout is not None and process.stdout.readline().strip() == "ready"

    def run(self) -> None:
        for process in self.processes:
            assert process.stdin is not None
            process.stdin.write("go\n")
            process.stdin.flush()
        if self.raw is not None:
            self.raw._command(f"send {len(self.processes)} {self.raw_offset}")
        for process in self.processes:
            assert process.stdout is not None
            if process.stdout.readline().strip() != "done":
                raise RuntimeError(f"puller process failed (exit code {process.poll()})")
        if self.raw is not None:
            self.raw._done()

    def close(self) -> None:
        for process in self.processes:
            assert process.stdin is not None and process.stdout is not None
            process.stdin.write("quit\n")
            process.stdin.close()
            process.wait(30)
            process.stdout.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("model", ["tiny", "smollm2"])
def test_push_pull_vs_raw_zmq(benchmark, tmp_path, model: str, dtype: str) -> None:
    np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(np.float32)
    tree = weights_tree(model, np_dtype)
    encoded = encode_tree(tree, chunk_bytes=DEFAULT_CHUNK_BYTES)
    nbytes = sum(f.nbytes for f in encoded.frames)
    raw = RawPeer(encoded.frames, streams=2 * max(PULLERS))
    server_args = ["--io-threads", str(IO_THREADS), "--workers", "4"]
    rows: list[tuple[str, float, float]] = []
    version = 0
    try:
        with running_server_process(None, keep=2, args=server_args) as server:
            clients = [ParamClient(server.address, timeout_s=60) for _ in range(max(PULLERS))]
            try:
                raw.pull(1)  # warm up both paths
                raw.push()
                version += 1
                clients[0].push(tree, version)
                clients[0].pull()

                def push_once() -> None:
                    nonlocal version
                    version += 1
                    clients[0].push(tree, version)

                def compare(
                    name: str, k: int, ours: Callable[[], None], reference: Callable[[], None]
                ) -> None:
                    # Rounds alternate between the two paths so that load on the machine hits both alike.
                    times = [(timed(ours), timed(reference)) for _ in range(ROUNDS)]
                    mine, theirs = (statistics.median(t) for t in zip(*times))
                    rows.append((name, k * nbytes / mine, k * nbytes / theirs))

                compare("push, 1 pusher", 1, push_once, raw.push)
                for k in PULLERS:
                    compare(
                        f"pull, {k} puller thread{'s' if k > 1 else ''}",
                        k,
                        lambda k=k: concurrently(k, lambda i: clients[i].pull()),
                        lambda k=k: raw.pull(k),
                    )
                # Diagnostic: the share of checksum verification (it competes for the CPU with the transfer).
                unverified = ParamClient(server.address, timeout_s=60, verify=False)
                try:
                    compare("pull, 1 thread, verify=False", 1, lambda: unverified.pull(), lambda: raw.pull(1))
                finally:
                    unverified.close()
                # Pullers as separate processes, as real inference workers are.
                for k in PULLERS:
                    ours_procs = PullerProcesses([["ours", server.address]] * k)
                    raw_procs = PullerProcesses(
                        [
                            ["raw", str(port), str(len(encoded.frames))]
                            for port in raw.ports[max(PULLERS) :][:k]
                        ],
                        raw=raw,
                        raw_offset=max(PULLERS),
                    )
                    try:
                        ours_procs.run()  # warm up: first connection and handshake
                        raw_procs.run()
                        compare(
                            f"pull, {k} puller process{'es' if k > 1 else ''}",
                            k,
                            ours_procs.run,
                            raw_procs.run,
                        )
                    finally:
                        ours_procs.close()
                        raw_procs.close()
                # The figure pytest-benchmark records: one full single pull (lease, fetch, verify).
                benchmark.pedantic(lambda: clients[0].pull(), rounds=ROUNDS, iterations=1)
            finally:
                for client in clients:
                    client.close()
    finally:
        raw.close()

    name = "SmolLM2-135M" if model == "smollm2" else "tiny test model"
    print(
        f"\n{name}-shaped weights, {dtype}: {len(encoded.manifest.tensors)} tensors, {nbytes / 1e6:.1f} MB, tcp loopback"
    )
    print(f"{'operation':<28} {'rlax-paramserver':>17} {'raw ZeroMQ':>12} {'ratio':>7}")
    for label, ours_bps, raw_bps in rows:
        print(
            f"{label:<28} {ours_bps / 1e9:>13.2f} GB/s {raw_bps / 1e9:>8.2f} GB/s {ours_bps / raw_bps:>7.2f}"
        )
    benchmark.extra_info.update(
        {label: {"ours_GBps": o / 1e9, "raw_GBps": r / 1e9, "ratio": o / r} for label, o, r in rows}
    )
    if path := os.environ.get("RLAX_BENCH_JSON"):
        ratios = {
            f"{model}_{dtype}_{row.replace(', ', '_').replace(' ', '_').replace('=', '_')}": o / r
            for row, o, r in rows
        }
        pushes = [o / r for row, o, r in rows if row.startswith("push")]
        # verify=False is a diagnostic, not a pull a worker makes.
        pulls = [o / r for row, o, r in rows if row.startswith("pull") and "verify" not in row]
        _merge_json(
            pathlib.Path(path),
            ratios,
            lowest={"push_over_raw_min": min(pushes), "pull_over_raw_min": min(pulls)},
        )


def test_smollm2_push_to_a_state_dir_by_file_vs_over_the_socket(benchmark, tmp_path) -> None:
    """A trainer on the parameter server's host: a push through the server's staging file
    (written by the pusher, hashed and renamed by the server) against the same push sent
    as frames (received, written to the state file by the server). Both end persisted and
    served from the file. Rounds alternate; medians; ratio = by file / over the socket."""
    tree = weights_tree("smollm2", np.dtype(np.float32))
    nbytes = sum(int(a.nbytes) for a in _leaves(tree))
    server_args = ["--io-threads", str(IO_THREADS), "--workers", "4"]
    with running_server_process(tmp_path, keep=2, args=server_args) as server:
        by_file = ParamClient(server.address, timeout_s=60, local=True)
        by_socket = ParamClient(server.address, timeout_s=60, local=False)
        version = 0

        def push(client: ParamClient) -> float:
            nonlocal version
            version += 1
            return timed(lambda: client.push(tree, version))

        try:
            push(by_file), push(by_socket)  # warm up both paths
            times = [(push(by_file), push(by_socket)) for _ in range(ROUNDS)]
            benchmark.pedantic(lambda: push(by_file), rounds=1, iterations=1)
        finally:
            by_file.close()
            by_socket.close()
    file_s, socket_s = (statistics.median(t) for t in zip(*times))
    figures = {
        "push_bytes": nbytes,
        "push_by_file_seconds": file_s,
        "push_over_socket_seconds": socket_s,
        "push_by_file_over_socket": file_s / socket_s,
    }
    print(
        f"\nSmolLM2-135M-shaped weights, float32, {nbytes / 1e6:.0f} MB, pushed and persisted on one host:"
        f"\n  by file {file_s:.3f} s, over the socket {socket_s:.3f} s: ratio {file_s / socket_s:.2f}"
    )
    benchmark.extra_info.update(figures)
    if path := os.environ.get("RLAX_BENCH_JSON"):
        _merge_json(pathlib.Path(path), figures)


def _leaves(tree: dict) -> list[np.ndarray]:
    out: list[np.ndarray] = []
    for value in tree.values():
        out.extend(_leaves(value) if isinstance(value, dict) else [value])
    return out


def _merge_json(path: pathlib.Path, figures: dict, lowest: dict | None = None) -> None:
    """Add `figures` to the JSON object at `path`, and each of `lowest` as the lower of it and
    the value already there (written to a temporary name, then renamed)."""
    import json

    current = json.loads(path.read_text()) if path.exists() else {}
    merged = {**current, **figures}
    for key, value in (lowest or {}).items():
        merged[key] = min(value, current.get(key, value))
    atomic_write_bytes(path, json.dumps(merged, indent=2).encode())
