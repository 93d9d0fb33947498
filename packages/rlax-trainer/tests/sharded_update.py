"""Run one learner update sharded over a mesh and write the updated params (npz, no pickle).

Executed by test_sharding.py in subprocesses (XLA_FLAGS sets the CPU device count):

    python sharded_update.py local OUT.npz
        one single-device update, then FSDP=4 and (fsdp=2, tensor=2) updates on 4 devices
    python sharded_update.py multihost OUT.npz PROCESS_ID NUM_PROCESSES PORT CKPT_DIR
        one FSDP update over every device of every process, joined by jax.distributed, then an
        orbax save + restore of the sharded state by all processes (fingerprints must agree);
        process 0 also runs the single-device reference and writes both
"""

from __future__ import annotations

import sys

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    ckpt_dir = sys.argv[6] if mode == "multihost" else None
    if mode == "multihost":
        pid, nproc, port = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{port}",
            num_processes=nproc,
            process_id=pid,
            initialization_timeout=120,
        )
    import numpy as np

    import rlax_model
    from rlax_trainer import Learner, LearnerConfig, MeshConfig, OptimizerConfig, make_mesh, preset

    mc = rlax_model.ModelConfig.tiny(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
    )
    params = rlax_model.init_params(mc, jax.random.key(0))
    rng = np.random.default_rng(0)
    b, s = 8, 12
    lengths = rng.integers(2, s - 2, size=b)
    valid = np.arange(s)[None, :] < (3 + lengths)[:, None]
    tokens = np.where(valid, rng.integers(3, 32, size=(b, s)), 0).astype(np.int32)
    mask = ((np.arange(s - 1)[None] >= 2) & (np.arange(s - 1)[None] < (2 + lengths)[:, None])).astype(
        np.float32
    )
    batch = {
        "tokens": tokens,
        "valid": valid,
        "mask": mask,
        "worker_logprobs": (-rng.uniform(1, 4, size=(b, s - 1)) * mask).astype(np.float32),
        "rewards": rng.integers(0, 2, size=b).astype(np.float32),
    }
    cfg = LearnerConfig(
        objective=preset("grpo"),
        group_size=4,
        global_batch=8,
        micro_batch=4,
        optimizer=OptimizerConfig(lr=1e-3, eps=1e-6),
    )

    def run(mesh_cfg: MeshConfig | None) -> dict[str, np.ndarray]:
        mesh = None if mesh_cfg is None else make_mesh(mesh_cfg)
        learner = Learner(mc, cfg, params, mesh=mesh)
        if mesh is not None:
            mu = learner.state.opt_state[1][0].mu["policy"]["layers"]["gate_proj"]
            assert "fsdp" in str(mu.sharding.spec), f"optimizer state not sharded: {mu.sharding.spec}"
        metrics = learner.update(batch)
        if mesh is not None and ckpt_dir is not None:
            from rlax_trainer.checkpoint import CheckpointManager, state_fingerprint

            with CheckpointManager(ckpt_dir) as ckpt:
                ckpt.save(learner.state, version=learner.step)
                ckpt.wait()
                state, info = ckpt.restore(learner.state)
            assert info.step == 1 and state_fingerprint(state) == state_fingerprint(learner.state)
            assert (
                state.params["policy"]["embed"].sharding == learner.state.params["policy"]["embed"].sharding
            )
        flat = jax.tree_util.tree_flatten_with_path(learner.host_params())[0]
        out = {jax.tree_util.keystr(k): np.asarray(v) for k, v in flat}
        out["__loss"] = np.float64(metrics["loss"])
        return out

    results = {}
    if mode == "local":
        results["single"] = run(None)
        results["fsdp4"] = run(MeshConfig(fsdp=4))
        results["fsdp2_tp2"] = run(MeshConfig(fsdp=2, tensor=2))
    else:
        results["multihost"] = run(MeshConfig(fsdp=jax.device_count()))
        if jax.process_index() != 0:
            return
        results["single"] = run(None)  # process 0's first device alone: the reference
    np.savez(out, **{f"{tag}|{k}": v for tag, tree in results.items() for k, v in tree.items()})


if __name__ == "__main__":
    main()
