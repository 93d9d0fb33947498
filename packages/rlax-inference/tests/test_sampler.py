import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from rlax_inference.sampler import SamplingBatch, cdf_block_size, fine_uniform, inverse_cdf_draw, sample_jit

V = 12
LOGITS = np.random.default_rng(0).normal(size=V).astype(np.float32) * 1.5


def expected_probs(logits, temperature, top_p, top_k):
    """Independent numpy reference: softmax(logits / T), keep top-k, then the top-p nucleus."""
    z = logits.astype(np.float64) / temperature
    order = np.argsort(-z, kind="stable")
    p = np.exp(z[order] - z[order].max())
    if top_k:
        p[top_k:] = 0
    p /= p.sum()
    cum = 0.0
    keep = np.zeros(V, bool)
    for i in range(V):
        if cum >= top_p:
            break
        keep[i] = True
        cum += p[i]
    p = np.where(keep, p, 0)
    out = np.zeros(V)
    out[order] = p / p.sum()
    return out


def draws(n, temperature, top_p, top_k, seed0=0):
    batch = SamplingBatch.from_rows([(temperature, top_p, top_k, seed0 + i, 0, 0) for i in range(n)])
    logits = jnp.broadcast_to(jnp.asarray(LOGITS), (n, V))
    return sample_jit(logits, batch, use_filters=True)


@pytest.mark.parametrize(
    "temperature,top_p,top_k",
    [(1.0, 1.0, 0), (0.7, 1.0, 0), (1.3, 0.8, 0), (1.0, 1.0, 5), (0.9, 0.7, 6)],
)
def test_chi_square_matches_restricted_softmax(temperature, top_p, top_k):
    n = 20_000
    out = draws(n, temperature, top_p, top_k)
    counts = np.bincount(np.asarray(out.tokens), minlength=V)
    p = expected_probs(LOGITS, temperature, top_p, top_k)
    assert counts[p == 0].sum() == 0, "drew a token outside the top-k/top-p set"
    support = p > 0
    chi2, pvalue = stats.chisquare(counts[support], n * p[support])
    assert pvalue > 1e-3, (chi2, pvalue, counts, n * p)
    # Logprob of each draw is that of the restricted distribution it came from.
    np.testing.assert_allclose(np.asarray(out.logprobs), np.log(p[np.asarray(out.tokens)]), atol=2e-5)


def test_unfiltered_fast_path_equals_filtered_path_without_filters():
    batch = SamplingBatch.from_rows([(0.8, 1.0, 0, i, 3, 7) for i in range(64)])
    logits = jax.random.normal(jax.random.key(1), (64, 100)) * 3
    a = sample_jit(logits, batch, use_filters=True)
    b = sample_jit(logits, batch, use_filters=False)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_greedy_and_top_logprobs():
    logits = jax.random.normal(jax.random.key(2), (3, 50))
    batch = SamplingBatch.from_rows([(0.0, 0.5, 3, i, 0, 0) for i in range(3)])
    out = sample_jit(logits, batch, use_filters=True, num_top=4)
    np.testing.assert_array_equal(out.tokens, np.argmax(logits, -1))
    ref = jax.nn.log_softmax(logits)
    np.testing.assert_allclose(out.logprobs, ref[np.arange(3), out.tokens], atol=1e-6)
    np.testing.assert_allclose(out.top_logprobs, jnp.sort(ref, -1)[:, ::-1][:, :4], atol=1e-6)
    np.testing.assert_array_equal(out.top_ids[:, 0], out.tokens)


def test_same_seed_same_output_alone_or_in_batch():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(16, 40)).astype(np.float32)
    rows = [(1.0, 0.9, 10, 1000 + i, i % 4, i) for i in range(16)]
    together = sample_jit(jnp.asarray(logits), SamplingBatch.from_rows(rows), use_filters=True)
    perm = rng.permutation(16)
    shuffled = sample_jit(jnp.asarray(logits[perm]), SamplingBatch.from_rows([rows[i] for i in perm]))
    for i in range(16):
        alone = sample_jit(jnp.asarray(logits[i : i + 1]), SamplingBatch.from_rows([rows[i]]))
        assert int(alone.tokens[0]) == int(together.tokens[i])
        np.testing.assert_allclose(alone.logprobs[0], together.logprobs[i], atol=1e-6)
    np.testing.assert_array_equal(np.asarray(shuffled.tokens), np.asarray(together.tokens)[perm])
    # A different step or sample index changes the draws (keys really depend on them).
    moved = sample_jit(
        jnp.asarray(logits), SamplingBatch.from_rows([(r[0], r[1], r[2], r[3], r[4], r[5] + 1) for r in rows])
    )
    assert not np.array_equal(np.asarray(moved.tokens), np.asarray(together.tokens))


@pytest.mark.parametrize("vocab", [7, 256, 1000, 49152])
def test_two_level_inverse_cdf_equals_full_cumsum_search(vocab):
    rng = np.random.default_rng(vocab)
    weights = rng.exponential(size=vocab).astype(np.float32)
    weights[rng.random(vocab) < 0.3] = 0.0  # zero-width entries (filtered tokens) must never be drawn
    weights[0] = weights[-1] = 0.0
    total = float(weights.astype(np.float64).sum())
    cdf = np.cumsum(weights.astype(np.float64))
    # Random targets plus the edges: 0, the very end of the mass, and past it (float32 rounding
    # of the caller's total can land there): the draw stays on the last entry of nonzero weight.
    edges = [0.0, np.nextafter(np.float32(total), 0), total * 0.999999, total, total * 1.001]
    targets = np.concatenate([rng.random(300) * total, edges])
    drawn = np.asarray(
        jax.vmap(inverse_cdf_draw, in_axes=(None, 0))(jnp.asarray(weights), jnp.asarray(targets, jnp.float32))
    )
    expected = np.minimum(
        np.searchsorted(cdf, targets.astype(np.float32), side="right"), np.flatnonzero(weights)[-1]
    )
    assert (weights[drawn] > 0).all(), "drew an entry of weight zero"
    # Float32 sums differ from the float64 reference only for targets within rounding of a boundary.
    near = np.abs(cdf[np.minimum(expected, vocab - 1)] - targets) < 1e-4 * total
    assert (drawn == expected)[~near].all()


def test_large_vocabulary_chi_square():
    vocab, n = 1000, 20_000  # several CDF blocks, unlike the 12-token tests above
    logits = np.random.default_rng(5).normal(size=vocab).astype(np.float32) * 2
    batch = SamplingBatch.from_rows([(1.0, 1.0, 0, i, 0, 0) for i in range(n)])
    out = sample_jit(jnp.broadcast_to(jnp.asarray(logits), (n, vocab)), batch, use_filters=False)
    p = np.exp(logits - logits.max()).astype(np.float64)
    p /= p.sum()
    top = np.argsort(-p)[:40]  # pool the tail so every expected count is large
    counts = np.bincount(np.asarray(out.tokens), minlength=vocab)
    observed = np.append(counts[top], n - counts[top].sum())
    expected = np.append(n * p[top], n * (1 - p[top].sum()))
    assert stats.chisquare(observed, expected).pvalue > 1e-3
    np.testing.assert_allclose(np.asarray(out.logprobs), np.log(p[np.asarray(out.tokens)]), atol=2e-5)


def float32_neighbours(values, reach=4):
    """Every float32 within `reach` ulps of each value: [n] -> [n * (2 * reach + 1)] float32."""
    out = [np.asarray(values, np.float32)]
    for direction in (np.inf, -np.inf):
        step = out[0]
        for _ in range(reach):
            step = np.nextafter(step, np.float32(direction))
            out.append(step)
    return np.concatenate(out)


@pytest.mark.parametrize("vocab", [4000, 49152])
def test_no_filtered_entry_at_any_block_or_entry_boundary(vocab):
    """Targets on and around every block boundary (each way a float32 prefix sum can be
    rounded) and every entry boundary: the draw is always an entry of positive weight.

    Weights span ~30 orders of magnitude, the first and last entries of every block are 0
    (a top-k/top-p filtered token) and whole blocks are 0, so that a block's start placed
    by rounding above the previous block's end would land on a zero entry.
    """
    rng = np.random.default_rng(vocab + 1)
    block = cdf_block_size(vocab)
    weights = np.exp(rng.normal(size=vocab) * 8 - 20).astype(np.float32)
    padded = np.pad(weights, (0, -vocab % block)).reshape(-1, block)
    padded[:, 0] = padded[:, -1] = 0.0
    padded[rng.random(len(padded)) < 0.2] = 0.0
    weights = padded.reshape(-1)[:vocab].copy()
    padded = np.pad(weights, (0, -vocab % block)).reshape(-1, block)
    sums32 = padded.sum(axis=-1, dtype=np.float32)
    boundaries = [
        np.cumsum(sums32, dtype=np.float32),  # sequential float32
        np.asarray(jnp.cumsum(jnp.asarray(padded).sum(axis=-1))),  # XLA's own sums and scan
        np.cumsum(padded.astype(np.float64).sum(axis=-1)),  # exact-ish
        np.cumsum(sums32, dtype=np.float32) - sums32,  # block start placed from its end
    ]
    entry_cdf = np.cumsum(weights.astype(np.float64))
    stride = max(1, vocab // 2000)  # every other entry boundary at 4000, a spread of them at 49152
    targets = float32_neighbours(np.concatenate([*boundaries, entry_cdf[::stride]]))
    total = float(entry_cdf[-1])
    targets = np.clip(targets, 0, np.float32(total * 1.001))
    drawn = np.asarray(jax.jit(jax.vmap(inverse_cdf_draw, in_axes=(None, 0)))(jnp.asarray(weights), targets))
    bad = np.flatnonzero(weights[drawn] == 0)
    assert bad.size == 0, (
        f"{bad.size} of {targets.size} targets drew a zero-weight entry, e.g. {targets[bad[:3]]}"
    )
    # Away from rounding distance of a boundary the draw is the float64 searchsorted one.
    expected = np.minimum(
        np.searchsorted(entry_cdf, targets.astype(np.float64), side="right"), np.flatnonzero(weights)[-1]
    )
    near = np.abs(entry_cdf[np.minimum(expected, vocab - 1)] - targets) < 1e-5 * total
    near |= np.abs(entry_cdf[np.maximum(expected - 1, 0)] - targets) < 1e-5 * total
    assert (drawn == expected)[~near].all()


def test_fine_uniform_resolves_probabilities_below_float32_uniform_grid():
    """P(u < x) = x for x far below 2^-23, counted exactly over every low word with a zero high
    word (any other high word gives u >= 2^-23): a 23-bit uniform gives P(u < x) = 2^-23 there."""
    low = np.arange(1 << 23, dtype=np.uint32) << 9
    bits = np.stack([np.zeros_like(low), low], axis=-1)
    u = np.asarray(jax.jit(fine_uniform)(jnp.asarray(bits)))
    for x in (1e-9, 3e-12, 2.0**-40):
        probability = np.count_nonzero(u < x) / 2.0**46
        assert abs(probability - x) <= 2.0**-46, (x, probability)
    top = np.asarray(fine_uniform(jnp.full((1, 2), 0xFFFFFFFF, jnp.uint32)))
    assert (top < 1).all()


def test_tiny_probability_first_token_is_not_drawn_when_the_coarse_uniform_is_zero():
    """Seed 5752247 (sample 0, step 0) made a 23-bit uniform exactly 0, which drew token 0
    although its probability is e^-70 ~ 4e-31 (logprob -76.9): found by scanning seeds with
    the former one-uniform sampler. The draw must resolve such a probability instead."""
    logits = np.zeros((1, 1000), np.float32)
    logits[0, 0] = -70.0
    out = sample_jit(
        jnp.asarray(logits), SamplingBatch.from_rows([(1.0, 1.0, 0, 5752247, 0, 0)]), use_filters=False
    )
    assert int(out.tokens[0]) != 0
    np.testing.assert_allclose(np.asarray(out.logprobs), np.log(1 / (999 + np.exp(-70.0))), rtol=1e-6)


def test_top_p_draws_at_large_vocabulary_are_always_in_the_nucleus():
    rows, vocab = 64, 4096
    logits = jax.random.normal(jax.random.key(7), (rows, vocab)) * 4
    batch = SamplingBatch.from_rows([(1.0, 0.9, 0, i, 1, 2) for i in range(rows)])
    out = sample_jit(logits, batch, use_filters=True)
    assert np.isfinite(np.asarray(out.logprobs)).all()
