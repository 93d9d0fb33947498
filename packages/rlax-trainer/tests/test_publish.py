from __future__ import annotations

import threading

import jax
import ml_dtypes
import numpy as np
import pytest

from rlax_paramserver import ParamClient
from rlax_paramserver.testing import running_server
from rlax_protocol import Committed
from rlax_trainer import Learner, LearnerConfig, OptimizerConfig, preset
from rlax_trainer.publish import PublishConfig, Publisher, host_weights


def rl_config() -> LearnerConfig:  # same as test_learner's: the compiled update is shared
    return LearnerConfig(
        objective=preset("grpo", importance={"tis_cap": None}),
        group_size=4,
        global_batch=8,
        optimizer=OptimizerConfig(lr=1e-3, max_grad_norm=1.0),
    )


def test_publishes_every_n_steps_as_bf16(tmp_path, model_config, model_params, make_batch):
    learner = Learner(model_config, rl_config(), model_params)
    with running_server(tmp_path / "ps", keep=5) as address:
        with Publisher(PublishConfig(address=address, every=2)) as pub:
            for i in range(4):
                learner.update(make_batch(i))
                pub.publish(learner.policy_params(), learner.step, {"note": "test"})
            pub.wait()
            assert [c.version for c in pub.committed] == [2, 4]
        with ParamClient(address, timeout_s=10) as client:
            assert client.latest() == 4
            pulled = client.pull()
            assert (
                pulled.version == 4
                and pulled.metadata["dtype"] == "bfloat16"
                and pulled.metadata["note"] == "test"
            )
            want = jax.tree.map(
                lambda x: np.asarray(x).astype(ml_dtypes.bfloat16), jax.device_get(learner.policy_params())
            )
            got_leaves = jax.tree.leaves(pulled.tree)
            assert len(got_leaves) == len(jax.tree.leaves(want))
            for a, b in zip(jax.tree.leaves(want), got_leaves, strict=True):
                assert b.dtype == ml_dtypes.bfloat16
                np.testing.assert_array_equal(a.view(np.uint16), np.asarray(b).view(np.uint16))
            assert client.stat().versions == (2, 4)


def test_float32_transfer_and_errors(tmp_path, model_params):
    with (
        running_server(tmp_path / "ps") as address,
        Publisher(PublishConfig(address=address, dtype="float32")) as pub,
    ):
        pub.publish(model_params, 3, force=True)
        pub.wait()
        with ParamClient(address, timeout_s=10) as client:
            pulled = client.pull(3)
        for a, b in zip(
            jax.tree.leaves(jax.device_get(model_params)), jax.tree.leaves(pulled.tree), strict=True
        ):
            np.testing.assert_array_equal(np.asarray(a), b)
        # Not newer than the server's latest: the push fails and the error surfaces, named.
        pub.publish(model_params, 2, force=True)
        with pytest.raises(RuntimeError, match="publishing weights to tcp://127.0.0.1"):
            pub.wait()
    with pytest.raises(ValueError, match="every must be >= 1, got 0"):
        PublishConfig(address="tcp://127.0.0.1:1", every=0)
    with pytest.raises(ValueError, match="transfer dtype must be one of"):
        host_weights(model_params, "int8")


class GatedClient:
    """A stand-in ParamClient whose pushes wait for `release` and fail for `fail_versions`."""

    def __init__(self, fail_versions: tuple[int, ...] = ()) -> None:
        self.fail_versions = fail_versions
        self.entered = threading.Event()  # a push has started
        self.release = threading.Event()
        self.pushed: list[int] = []

    def push(self, tree, version, metadata=None) -> Committed:
        self.pushed.append(version)
        self.entered.set()
        assert self.release.wait(timeout=30), "test gate never released"
        if version in self.fail_versions:
            raise ConnectionError(f"push of version {version} lost")
        return Committed(version=version, persisted=False)

    def close(self) -> None:
        pass


SMALL_TREE = {"w": np.arange(4, dtype=np.float32)}


def test_failed_push_does_not_drop_the_next_version():
    client = GatedClient(fail_versions=(2,))
    pub = Publisher(PublishConfig(address="tcp://127.0.0.1:1"), client=client)
    try:
        pub.publish(SMALL_TREE, 2)
        assert client.entered.wait(timeout=30)  # version 2 is on the wire
        pub.publish(SMALL_TREE, 4)  # waits behind it
        client.release.set()  # version 2 fails
        with pytest.raises(RuntimeError, match="push of version 2 lost"):
            pub.wait()
        assert client.pushed == [2, 4]
        assert [c.version for c in pub.committed] == [4]
    finally:
        client.release.set()
        pub.close()


def test_publish_never_waits_for_a_push_in_flight():
    client = GatedClient()
    pub = Publisher(PublishConfig(address="tcp://127.0.0.1:1"), client=client)
    try:
        pub.publish(SMALL_TREE, 1)
        assert client.entered.wait(timeout=30)  # version 1's push hangs on the socket
        # Two more versions while it hangs: the training loop must not block on either.
        loop = threading.Thread(target=lambda: [pub.publish(SMALL_TREE, v) for v in (2, 3)], daemon=True)
        loop.start()
        loop.join(timeout=30)
        assert not loop.is_alive(), "publish blocked behind a push in flight"
    finally:
        client.release.set()
    pub.wait()
    pub.close()
    # Version 2 never reached the wire: the newer 3 replaced it, and says so.
    assert client.pushed == [1, 3] and pub.superseded == [2]
    assert [c.version for c in pub.committed] == [1, 3]
