"""CURVE authentication and protocol-version mismatch."""

from __future__ import annotations

import numpy as np
import pytest

import rlax_protocol as rp
import rlax_protocol.transport as transport
from rlax_paramserver import ParamClient
from rlax_paramserver.testing import running_server_process


def test_curve_only_allowed_clients_push_or_pull(tmp_path) -> None:
    keys = tmp_path / "keys"
    allowed_dir = tmp_path / "allowed"
    _, server_secret = rp.save_curve_keypair(str(keys), "server")
    client_public, client_secret = rp.save_curve_keypair(str(keys), "worker")
    allowed_dir.mkdir()
    (allowed_dir / "worker.key").write_bytes(open(client_public, "rb").read())
    server_keys = rp.load_curve_keypair(server_secret)
    good = rp.CurveClientConfig(
        keypair=rp.load_curve_keypair(client_secret), server_public=server_keys.public
    )
    stranger = rp.CurveClientConfig(keypair=rp.generate_curve_keypair(), server_public=server_keys.public)
    tree = {"w": np.arange(8, dtype=np.float32)}
    args = ["--curve-keypair", server_secret, "--curve-allow", str(allowed_dir)]
    with running_server_process(tmp_path / "state", args=args) as server:
        for curve in (stranger, None):
            with ParamClient(server.address, timeout_s=0.5, retries=0, curve=curve) as intruder:
                with pytest.raises(rp.ProtocolTimeoutError):
                    intruder.push(tree, 1)
                with pytest.raises(rp.ProtocolTimeoutError):
                    intruder.pull()
        with ParamClient(server.address, timeout_s=10, curve=good) as client:
            assert client.latest() is None  # nothing the intruders sent got in
            client.push(tree, 1)
            pulled = client.pull()
            assert pulled is not None and np.array_equal(pulled.tree["w"], tree["w"])
        with ParamClient(server.address, timeout_s=0.5, retries=0, curve=stranger) as intruder:
            with pytest.raises(rp.ProtocolTimeoutError):
                intruder.pull()
        assert "rejected a client" in server.log()


def test_protocol_version_mismatch_is_clear_on_both_sides(monkeypatch) -> None:
    other = rp.PROTOCOL_VERSION + 1
    with running_server_process() as server:
        monkeypatch.setattr(transport, "PROTOCOL_VERSION", other)  # this client now speaks `other`
        with (
            ParamClient(server.address, timeout_s=5) as client,
            pytest.raises(rp.VersionMismatchError) as info,
        ):
            client.latest()
        monkeypatch.undo()
        client_side = str(info.value)
        assert (
            f"speaks version {other}" in client_side
            and f"speaks version {rp.PROTOCOL_VERSION}" in client_side
        )
        server_side = server.log()
        assert (
            f"speaks version {rp.PROTOCOL_VERSION}" in server_side
            and f"speaks version {other}" in server_side
        )
        # A manifest written by another protocol version is refused with both versions named.
        with ParamClient(server.address, timeout_s=5) as client:
            manifest = rp.TensorManifest(protocol_version=other, chunk_bytes=8, tensors=())
            with pytest.raises(
                rp.RemoteError, match=f"version {other}.*version {rp.PROTOCOL_VERSION}"
            ) as refused:
                client._rpc.call(rp.PushBegin(version=1, manifest=manifest))
            assert refused.value.code == "version_mismatch"
