from __future__ import annotations

import jax
import jax.numpy as jnp
import msgspec
import numpy as np
import pytest

import rlax_model
from rlax_protocol.procfs import memory_mb
from rlax_trainer import Learner, LearnerConfig, OptimizerConfig, learner_config_from_dict, preset


def flat(tree) -> np.ndarray:
    return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(tree)])


def own_logprobs(model_config, model_params, batch) -> np.ndarray:
    """Log-probs [rows, T-1] of an independent forward pass of `model_params` over the batch."""
    return np.asarray(
        rlax_model.logprobs(
            model_params,
            jnp.asarray(batch["tokens"]),
            config=model_config,
            attention_context=rlax_model.DenseContext(valid=jnp.asarray(batch["valid"])),
        )
    )


def rl_config(**kw) -> LearnerConfig:
    base = dict(
        objective=preset("grpo", importance={"tis_cap": None}),
        group_size=4,
        global_batch=8,
        optimizer=OptimizerConfig(lr=1e-3, max_grad_norm=1.0),
    )
    base.update(kw)
    return LearnerConfig(**base)


def test_micro_batching_and_aligned_remat_give_the_same_update(model_config, model_params, make_batch):
    batch = make_batch(0)
    whole = Learner(model_config, rl_config(), model_params)
    m_whole = whole.update(batch)
    split = Learner(model_config, rl_config(micro_batch=2, remat="nothing_saveable"), model_params)
    m_split = split.update(batch)
    np.testing.assert_allclose(flat(split.host_params()), flat(whole.host_params()), atol=1e-5, rtol=0)
    assert abs(m_split["loss"] - m_whole["loss"]) < 1e-5
    assert abs(m_split["grad_norm"] - m_whole["grad_norm"]) < 1e-4
    assert np.abs(flat(whole.host_params()) - flat({"policy": model_params})).max() > 1e-4


# Compiles several update programs (30-40 s): `nox -s slow`.
@pytest.mark.slow
def test_precompiled_lengths_serve_the_steps_that_meet_them(model_config, model_params, make_batch):
    """A length compiled ahead (in the background) is not compiled again by the step that
    meets it, and gives the update a step compiling it inline gives."""
    batch = make_batch(0)
    padded = rl_config(packing=False)  # length buckets; test_packing covers packed programs
    inline = Learner(model_config, padded, model_params)
    m_inline = inline.update(batch)
    seq = inline.last_seq_len
    assert m_inline["trainer_compile_seconds"] > 0
    assert inline.update(batch)["trainer_compile_seconds"] == 0.0  # compiled once per length
    ahead = Learner(model_config, padded, model_params)
    started = ahead.precompile([seq, seq + 8, seq])
    assert len(started) == 2  # one program per distinct length
    for future in started:
        future.result()
    m_ahead = ahead.update(batch)
    assert m_ahead["trainer_compile_seconds"] == 0.0
    assert m_ahead["loss"] == m_inline["loss"]
    ahead.update(batch)
    np.testing.assert_array_equal(flat(ahead.host_params()), flat(inline.host_params()))
    assert ahead.precompile([seq]) == []  # nothing left to compile for that length
    ahead.stop_precompile()


# Compiles several update programs (30-40 s): `nox -s slow`.
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_step_never_waits_on_a_background_compile_it_blocks(model_config, model_params, make_batch):
    """The background thread compiles only while no step holds `busy()`: a step that meets
    a length still queued there compiles it itself instead of waiting (a deadlock before)."""
    batch = make_batch(0)
    learner = Learner(model_config, rl_config(), model_params)
    probe = Learner(model_config, rl_config(), model_params)
    probe.update(batch)
    seq = probe.last_seq_len
    with learner.busy() as waited:
        assert waited == 0.0  # nothing was compiling
        queued = learner.precompile([seq, seq + 8])
        metrics = learner.update(batch)  # hung here when the step waited for the queued job
        assert metrics["trainer_compile_seconds"] > 0
    for future in queued:
        assert future.cancelled() or future.result() is not None
    assert learner.update(batch)["trainer_compile_seconds"] == 0.0
    learner.stop_precompile()


def test_trainer_recomputes_pi_old_and_reports_mismatch(model_config, model_params, make_batch):
    batch = make_batch(1)
    a = Learner(model_config, rl_config(), model_params)
    m_a = a.update(batch)
    shifted = dict(batch, worker_logprobs=batch["worker_logprobs"] - 0.7 * batch["mask"])
    b = Learner(model_config, rl_config(), model_params)
    m_b = b.update(shifted)
    # Worker logprobs never act as pi_old: without TIS the update ignores them entirely.
    np.testing.assert_array_equal(flat(a.host_params()), flat(b.host_params()))
    # The mismatch metrics compare the trainer's own forward pass with the worker's numbers.
    own = own_logprobs(model_config, model_params, batch)
    delta = np.abs(own - batch["worker_logprobs"])[batch["mask"] > 0]
    assert m_a["logprob_delta_max"] == pytest.approx(delta.max(), abs=1e-4)
    assert m_a["logprob_delta_p50"] == pytest.approx(np.quantile(delta, 0.5), abs=1e-4)
    assert m_a["logprob_delta_p95"] == pytest.approx(np.quantile(delta, 0.95), abs=1e-4)
    assert m_b["logprob_delta_p50"] != pytest.approx(m_a["logprob_delta_p50"], abs=1e-3)
    # A dict batch without versions counts as stale: no same-version tokens.
    assert m_a["on_policy_tokens"] == 0 and m_a["logprob_mismatch_p95"] == 0.0
    # Half the rollouts from the weights the update starts from (version 0), half older (-1):
    # the mismatch metrics see only the first half.
    b_rows = batch["tokens"].shape[0]
    versions = np.where(np.arange(b_rows) < b_rows // 2, 0, -1).astype(np.int32)
    c = Learner(model_config, rl_config(), model_params)
    m_c = c.update(dict(shifted, versions=versions))
    fresh = batch["mask"][: b_rows // 2] > 0
    delta_fresh = np.abs(np.asarray(own) - shifted["worker_logprobs"])[: b_rows // 2][fresh]
    assert m_c["on_policy_tokens"] == fresh.sum()
    assert m_c["logprob_mismatch_max"] == pytest.approx(delta_fresh.max(), abs=1e-4)
    assert m_c["logprob_mismatch_p95"] == pytest.approx(np.quantile(delta_fresh, 0.95), abs=1e-4)
    # On-policy single update: the trainer's pi_theta equals its pi_old.
    assert m_a["is_ratio_mean"] == pytest.approx(1.0, abs=1e-5) and m_a["clip_fraction"] == 0.0
    lengths = batch["mask"].sum(1)
    assert m_a["response_length_mean"] == pytest.approx(lengths.mean())
    assert m_a["reward_mean"] == pytest.approx(batch["rewards"].mean())
    for key in ("entropy", "kl", "grad_norm", "advantage_std", "is_ratio_max", "learning_rate"):
        assert np.isfinite(m_a[key]), key


def test_minibatches_clip_and_tis(model_config, model_params, make_batch, minibatch_config):
    batch = make_batch(2)
    learner = Learner(model_config, minibatch_config, model_params)
    before = flat(learner.host_params())
    learner.update(make_batch(5))
    m = learner.update(batch)
    # The second minibatch sees a policy that moved: ratios leave 1 and some tokens get clipped.
    assert m["is_ratio_max"] > 1.0 + 1e-3 and m["clip_fraction"] > 0.0
    assert learner.step == 2 and not np.array_equal(before, flat(learner.host_params()))


def test_ppo_value_head_trains(model_config, model_params, make_batch):
    cfg = rl_config(objective=preset("ppo"), micro_batch=4, optimizer=OptimizerConfig(lr=1e-2))
    learner = Learner(model_config, cfg, model_params)
    batch = make_batch(3)
    losses = [learner.update(batch)["value_loss"] for _ in range(3)]
    assert losses[-1] < losses[0]
    assert float(jnp.abs(learner.state.params["value"]["w"]).sum()) > 0


def test_sft_bf16_params_fp32_master(model_config, model_params, make_batch):
    cfg = LearnerConfig(
        mode="sft",
        global_batch=8,
        micro_batch=4,
        param_dtype="bfloat16",
        optimizer=OptimizerConfig(lr=1e-2, warmup_steps=2, schedule="cosine", decay_steps=10),
    )
    learner = Learner(model_config, cfg, model_params)
    batch = make_batch(4)
    metrics = [learner.update(batch) for _ in range(4)]
    assert metrics[-1]["nll"] < metrics[0]["nll"] - 0.1
    assert [round(m["learning_rate"], 6) for m in metrics[:3]] == [
        round(1e-2 / 3, 6),
        round(2e-2 / 3, 6),
        1e-2,
    ]
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(learner.state.params))


def test_config_errors_name_the_field(model_config, model_params, make_batch):
    with pytest.raises(ValueError, match="micro_batch=3 must divide the 8 rollouts"):
        rl_config(micro_batch=3)
    with pytest.raises(ValueError, match="global_batch=6 must be a positive multiple of group_size=4"):
        rl_config(global_batch=6)
    with pytest.raises(ValueError, match="lr = -1: must be a finite number > 0"):
        OptimizerConfig(lr=-1)
    with pytest.raises(
        msgspec.ValidationError, match=r"eps_high must be >= 0, got -0.5 - at `\$.objective.importance`"
    ):
        learner_config_from_dict(
            {
                "objective": {"base": "dapo", "importance": {"eps_high": -0.5}},
                "group_size": 2,
                "global_batch": 4,
            }
        )
    with pytest.raises(ValueError, match="unknown objective preset 'grpoo'"):
        learner_config_from_dict({"objective": {"base": "grpoo"}})
    cfg = learner_config_from_dict(
        {
            "objective": {"base": "cispo"},
            "group_size": 2,
            "global_batch": 4,
            "optimizer": {"lr": 3e-6, "schedule": "cosine"},
        }
    )
    assert cfg.objective == preset("cispo") and cfg.optimizer.lr == 3e-6
    learner = Learner(model_config, rl_config(), model_params)
    bad = make_batch(0)
    bad["mask"] = bad["mask"][:, :-1]
    with pytest.raises(ValueError, match=r"batch field mask has shape \(8, 10\), expected \(8, 11\)"):
        learner.update(bad)
    with pytest.raises(ValueError, match="batch has 4 rollouts, expected global_batch=8"):
        learner.update({k: v[:4] for k, v in make_batch(0).items()})


def test_release_free_memory_returns_freed_pages_to_the_os() -> None:
    import ctypes
    import ctypes.util

    from rlax_trainer.memory import release_free_memory

    def rss_mb() -> float:
        return memory_mb("self", "VmRSS") or 0.0

    # Many small blocks (below glibc's mmap threshold) freed: the heap keeps them until trimmed.
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(64 * 1024) for _ in range(4096)]  # 256 MiB
    for b in blocks:
        ctypes.memset(b, 1, 64 * 1024)
    held = rss_mb()
    for b in blocks[:-1]:  # the last one pins the heap's top: only a real trim returns the rest
        libc.free(b)
    before = rss_mb()
    assert release_free_memory()
    after = rss_mb()
    libc.free(blocks[-1])
    assert held - after > 200 and before - after > 100, (held, before, after)


def test_one_minibatch_without_reference_reuses_the_gradient_pass_as_pi_old(
    model_config, model_params, make_batch, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One optimizer step per batch: pi_old is the policy the gradient pass evaluates, so its
    # log-probs (without gradient) replace the separate forward pass. Same update, same metrics.
    from rlax_trainer import learner_update

    config = rl_config(
        objective=preset("grpo", kl={"coef": 0.0}, importance={"tis_cap": None}), micro_batch=4
    )
    batch = make_batch(2)
    reused = Learner(model_config, config, model_params)
    m_reused = reused.update(batch)
    traced: list[bool] = []
    monkeypatch.setattr(
        learner_update, "_reuses_policy_pass", lambda *args, **kwargs: traced.append(True) or False
    )
    learner_update.batch_update_jit.clear_cache()  # the same spec must trace the other branch
    separate = Learner(model_config, config, model_params)
    m_separate = separate.update(batch)
    learner_update.batch_update_jit.clear_cache()
    assert traced, "the separate-pass branch was not traced"
    np.testing.assert_allclose(flat(reused.host_params()), flat(separate.host_params()), atol=1e-6, rtol=0)
    for key in (
        "loss",
        "pg_loss",
        "grad_norm",
        "logprob_delta_p50",
        "logprob_delta_p95",
        "logprob_delta_max",
    ):
        assert m_reused[key] == pytest.approx(m_separate[key], abs=1e-5), key
    # And against an independent forward pass of the initial weights, as the worker's numbers are judged.
    own = own_logprobs(model_config, model_params, batch)
    delta = np.abs(own - batch["worker_logprobs"])[batch["mask"] > 0]
    assert m_reused["logprob_delta_max"] == pytest.approx(delta.max(), abs=1e-4)
    assert m_reused["on_policy_tokens"] == m_separate["on_policy_tokens"]


def test_minibatch_order_rows_shuffles_every_rollout_groups_keeps_each_prompt_together():
    from rlax_trainer.learner import minibatch_order

    def config(split: str, minibatches: int = 4) -> LearnerConfig:
        return LearnerConfig(
            objective=preset("grpo"),
            group_size=4,
            global_batch=32,
            minibatches=minibatches,
            minibatch_split=split,
        )

    key = jax.random.key(3)
    rows = np.asarray(minibatch_order(key, 32, config("rows")))
    assert sorted(rows.tolist()) == list(range(32)) and rows.tolist() != list(range(32))
    # Each minibatch of 8 rows holds samples of several prompts (TRL's shuffle-then-split).
    assert all(len(set((rows[m * 8 : (m + 1) * 8] // 4).tolist())) > 2 for m in range(4))
    other = np.asarray(minibatch_order(jax.random.key(4), 32, config("rows")))
    assert other.tolist() != rows.tolist()  # seeded by the train state's key
    groups = np.asarray(minibatch_order(key, 32, config("groups"))).reshape(8, 4)
    assert (groups == groups[:, :1] + np.arange(4)).all() and (groups[:, 0] % 4 == 0).all()
    assert sorted(groups[:, 0].tolist()) == list(range(0, 32, 4))
    one = np.asarray(minibatch_order(key, 32, config("rows", minibatches=1)))
    assert one.tolist() == list(range(32))  # one minibatch: batch order (its pass is pi_old's)


def test_minibatches_of_rows_need_not_hold_whole_groups():
    # 8 rollouts of group 4 in 4 minibatches of 2: fine as rows, impossible as whole groups.
    LearnerConfig(objective=preset("grpo"), group_size=4, global_batch=8, minibatches=4)
    with pytest.raises(ValueError, match="minibatch_split='groups'.*whole groups of 4"):
        LearnerConfig(
            objective=preset("grpo"), group_size=4, global_batch=8, minibatches=4, minibatch_split="groups"
        )
    with pytest.raises(ValueError, match="must divide global_batch=8"):
        LearnerConfig(objective=preset("grpo"), group_size=4, global_batch=8, minibatches=3)


def test_small_logits_run_dense_and_match_the_chunked_projection(
    model_config, model_params, make_batch, monkeypatch
):
    """Below `DENSE_LOGITS_ELEMENTS` the update skips the chunked vocabulary projection; forced
    to chunk (the limit at 0, a config of its own so the update traces anew) it gives the same
    update."""
    from rlax_trainer import learner_passes
    from rlax_trainer.learner_passes import UpdateSpec, logprob_chunk_size

    def config(chunk: int) -> LearnerConfig:
        return LearnerConfig(
            objective=preset("grpo"),
            group_size=4,
            global_batch=8,
            minibatches=2,
            logprob_chunk_size=chunk,
            optimizer=OptimizerConfig(lr=0.01),
        )

    tokens = np.zeros((8, 12), np.int32)
    assert logprob_chunk_size(UpdateSpec(model_config, config(5)), tokens) is None  # 8 x 11 x 32 logits
    big = np.zeros((4096, 1025), np.int32)
    assert logprob_chunk_size(UpdateSpec(model_config, config(5)), big) == 5
    batch = make_batch(11)
    dense = Learner(model_config, config(8), model_params)
    m_dense = dense.update(batch)
    monkeypatch.setattr(learner_passes, "DENSE_LOGITS_ELEMENTS", 0)
    chunked = Learner(model_config, config(5), model_params)
    m_chunked = chunked.update(batch)
    assert np.abs(flat(dense.host_params()) - flat({"policy": model_params})).max() > 1e-4  # moved
    np.testing.assert_allclose(flat(chunked.host_params()), flat(dense.host_params()), atol=1e-5, rtol=0)
    assert abs(m_chunked["loss"] - m_dense["loss"]) < 1e-5
