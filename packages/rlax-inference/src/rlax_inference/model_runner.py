"""Jit-compiled prefill and decode steps over a paged KV cache, at bucketed shapes.

The cache is `{"k": ..., "v": ...}`, each `[num_layers, num_kv_heads, num_pages, page_size,
head_dim]`: per layer, the layout of `rlax_kernels`
(`[num_kv_heads, total_pages, page_size, head_dim]`). K/V are written with
one scatter after the layer scan (padding rows carry slot -1 and are skipped) and decode attention is
`rlax_kernels.paged_attention` on TPU/GPU (Pallas) and the native `rlax_kernels.paged_attention_cpu`
on CPU (`attention="xla"` runs `rlax_kernels.paged_attention_xla` instead; see below). Page 0
is never handed out by the block pool: padded decode rows point their block table at it.

Shapes are rounded up to buckets so that new request lengths reuse compiled code: decode
is compiled per (row bucket, block-table width bucket, steps per call: 1 or the engine's
`num_decode_steps`), prefill per (chunk-row bucket, chunk-length bucket, block-table width
bucket of the cached context, sample-row bucket). Each jitted function counts its traces in
`ModelRunner.num_compilations`.

The cache never travels through the model's layer scan, on any backend: each layer's
attention reads the whole (read-only) cache in place through its layer index and block
tables, adds the current token to the softmax itself, and hands the token's new K/V out of
the scan; one scatter writes all layers into the donated cache afterwards (threading the
cache through the scan copies all of it every step). The Pallas kernels take the 5-D cache
and a traced layer index (scalar-prefetched on TPU, an address offset on GPU); on XLA:CPU in
interpret mode their decode step compiles to 0.18 MiB of temporaries for an 8 MiB cache
(it was 12-17 MiB, 1.5-2.1x the cache, when the layer's pages went through the scan).
Prefill runs one chunk of a prompt per row (chunked prefill; a whole prompt is a chunk that
starts at 0): the chunk attends to the row's tokens already in the cache -- earlier chunks,
prefix-cached or shared blocks -- gathered through its block table from the read-only cache,
and causally to itself, in one exact float32 softmax; its K/V leave the scan like decode's.

`ModelRunner(aligned=True)` (`EngineConfig.aligned`) computes as the trainer's
batch-invariant pass does, so that a sampled token's float32 log-prob is the trainer's to
the bit: see `ModelRunner`.

A model with `ModelConfig.sliding_window` (Mistral-style) sees only that many tokens in
prefill (the causal mask) and in decode, on every backend (the decode paths skip the
pages before the window).
"""

from __future__ import annotations

import collections
import functools
import itertools
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import rlax_kernels
from rlax_inference.runner_attention import (
    PREFILL_PAGES_PER_STEP,
    FusedDecodeContext,
    KVCache,
    MixedContext,
    PrefillContext,
    aligned_prefill_attention,
    decode_attend,
    make_aligned_decode_attention,
    make_fused_decode_attention,
    make_mixed_attention,
    prefill_attention,
    write_all_layers,
)
from rlax_inference.sampler import SamplerOutput, SamplingBatch, sample
from rlax_inference.shape_buckets import bucket, buckets_up_to
from rlax_model import ModelConfig, Params, hidden_states, project_logits
from rlax_model.layers import ALIGNED_COMPILER_OPTIONS, ALIGNED_ROW_BLOCK, matmul_row_blocks

AttentionBackend = Literal["auto", "cpu", "xla", "pallas_tpu", "pallas_gpu"]
# Backends that keep a float32 cache (see `ModelRunner.cache_dtype`).
_FLOAT32_CACHE = ("cpu", "xla")


COMPILATIONS: collections.Counter[str] = collections.Counter()


def _counted(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def traced(*args: Any, **kwargs: Any) -> Any:
            COMPILATIONS[name] += 1  # runs only while jax traces, i.e. once per compiled shape
            return fn(*args, **kwargs)

        return traced

    return wrap


_STEP_STATICS = ("config", "use_filters", "num_top", "aligned")


def _jits(fn: Callable[..., Any], **jit_kwargs: Any) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """`fn` jitted as is, and jitted with `ALIGNED_COMPILER_OPTIONS` (called with aligned=True)."""
    return jax.jit(fn, **jit_kwargs), jax.jit(fn, compiler_options=ALIGNED_COMPILER_OPTIONS, **jit_kwargs)


def _prefill_impl(
    params: Params,
    cache: KVCache,
    tokens: jax.Array,
    starts: jax.Array,
    lengths: jax.Array,
    slots: jax.Array,
    block_tables: jax.Array,
    *,
    config: ModelConfig,
    aligned: bool = False,
) -> tuple[jax.Array, KVCache]:
    """Prefill one chunk per row: row i's `lengths[i]` tokens sit at positions `starts[i]`... and
    attend to the row's `starts[i]` cached tokens (block_tables) and causally to each other.
    Returns each row's last hidden state [rows, hidden] (sampled by `_sample_impl`) and the cache.
    aligned: the trainer's batch-invariant formulation (`ModelRunner`'s `aligned`)."""
    positions = starts[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
    with matmul_row_blocks(ALIGNED_ROW_BLOCK if aligned else 0):
        hidden, new = hidden_states(
            params,
            tokens,
            positions,
            config=config,
            attention=aligned_prefill_attention if aligned else prefill_attention,
            attention_context=PrefillContext(cache, starts, lengths, block_tables, config.sliding_window),
            kv_cache=jnp.arange(config.num_layers, dtype=jnp.int32),
        )
        layers, rows, length = config.num_layers, tokens.shape[0], tokens.shape[1]
        flat = {n: a.reshape(layers, rows * length, *a.shape[3:]) for n, a in new.items()}
        cache = write_all_layers(cache, flat["k"], flat["v"], slots.reshape(-1))
        last = hidden[jnp.arange(rows), jnp.maximum(lengths - 1, 0)]  # [rows, hidden]
    return last, cache


def _sample_impl(
    params: Params,
    last: jax.Array,
    row_of_sample: jax.Array,
    sampling: SamplingBatch,
    *,
    config: ModelConfig,
    use_filters: bool,
    num_top: int,
    aligned: bool = False,
) -> SamplerOutput:
    """Sample one token per sample row from the prefill rows' last hidden states.

    last: [rows, hidden]; row_of_sample: [samples] int32, the row each sample reads (the n
    samples of a request share one row). A program of its own, so that the prefill's programs
    do not multiply by the number of sample rows (`ModelRunner.compile_shapes`)."""
    with matmul_row_blocks(ALIGNED_ROW_BLOCK if aligned else 0):
        logits = project_logits(last[row_of_sample], params, config)
    return sample(logits, sampling, use_filters=use_filters, num_top=num_top, aligned=aligned)


_prefill_step, _prefill_step_aligned = _jits(
    _counted("prefill")(_prefill_impl), static_argnames=("config", "aligned"), donate_argnums=(1,)
)
_sample_step, _sample_step_aligned = _jits(_counted("sample")(_sample_impl), static_argnames=_STEP_STATICS)


def _decode_one(
    params: Params,
    cache: KVCache,
    tokens: jax.Array,
    slots: jax.Array,
    block_tables: jax.Array,
    lengths: jax.Array,
    sampling: SamplingBatch,
    *,
    config: ModelConfig,
    attention: str,
    interpret: bool,
    use_filters: bool,
    num_top: int,
    aligned: bool,
) -> tuple[SamplerOutput, KVCache]:
    """One decode step of every row: token i sits at position lengths[i] - 1 and its K/V go to slots[i]."""
    positions = (lengths - 1)[:, None]
    if aligned:
        attend = make_aligned_decode_attention(config.sliding_window)
    else:
        attend = make_fused_decode_attention(decode_attend(attention, interpret), config.sliding_window)
    with matmul_row_blocks(ALIGNED_ROW_BLOCK if aligned else 0):
        hidden, new = hidden_states(
            params,
            tokens[:, None],
            positions,
            config=config,
            attention=attend,
            attention_context=FusedDecodeContext(cache, lengths, block_tables),
            kv_cache=jnp.arange(config.num_layers, dtype=jnp.int32),
        )
        cache = write_all_layers(cache, new["k"], new["v"], slots)
        logits = project_logits(hidden[:, 0], params, config)
    return sample(logits, sampling, use_filters=use_filters, num_top=num_top, aligned=aligned), cache


def _decode_impl(
    params: Params,
    cache: KVCache,
    tokens: jax.Array,
    slots: jax.Array,
    block_tables: jax.Array,
    lengths: jax.Array,
    sampling: SamplingBatch,
    *,
    config: ModelConfig,
    attention: str,
    interpret: bool,
    use_filters: bool,
    num_top: int,
    aligned: bool = False,
) -> tuple[SamplerOutput, KVCache]:
    """`num_steps = slots.shape[0]` decode steps in one program, each step's token fed to the next.

    tokens, lengths: [rows] for the first step; slots: [num_steps, rows], -1 where a row has
    no more tokens to make (it then repeats its last allowed position, writing nothing: its
    outputs from there on are discarded by the caller). Sampling keys advance with the step,
    so the tokens equal those of `num_steps` single steps. Returns outputs stacked [num_steps, rows, ...].
    """
    statics: dict[str, Any] = dict(
        config=config,
        attention=attention,
        interpret=interpret,
        use_filters=use_filters,
        num_top=num_top,
        aligned=aligned,
    )
    num_steps = slots.shape[0]
    if num_steps == 1:
        out, cache = _decode_one(params, cache, tokens, slots[0], block_tables, lengths, sampling, **statics)
        return jax.tree_util.tree_map(lambda x: x[None], out), cache
    allowed = (slots >= 0).sum(axis=0)  # [rows] tokens each row makes in this call
    last_allowed = jnp.maximum(allowed - 1, 0)

    def one(
        carry: tuple[KVCache, jax.Array], step: tuple[jax.Array, jax.Array]
    ) -> tuple[tuple[KVCache, jax.Array], SamplerOutput]:
        cache, tok = carry
        i, step_slots = step
        offset = jnp.minimum(i, last_allowed)
        step_sampling = sampling._replace(step=sampling.step + offset)
        out, cache = _decode_one(
            params, cache, tok, step_slots, block_tables, lengths + offset, step_sampling, **statics
        )
        return (cache, jnp.where(i < allowed, out.tokens, tok)), out

    (cache, _), outs = jax.lax.scan(one, (cache, tokens), (jnp.arange(num_steps), slots))
    return outs, cache


_decode_steps, _decode_steps_aligned = _jits(
    _counted("decode")(_decode_impl),
    static_argnames=(*_STEP_STATICS, "attention", "interpret"),
    donate_argnums=(1,),
)


def _mixed_impl(
    params: Params,
    cache: KVCache,
    decode: tuple[jax.Array, jax.Array, jax.Array, jax.Array],
    prefill: tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array],
    sample_positions: jax.Array,
    sampling: SamplingBatch,
    *,
    config: ModelConfig,
    attention: str,
    interpret: bool,
    use_filters: bool,
    num_top: int,
) -> tuple[tuple[SamplerOutput, SamplerOutput | None], KVCache]:
    """A decode step of `R` rows and one chunk of `P` prompts in one pass over the weights,
    then the decode rows' further steps.

    decode: (tokens [R], slots [num_steps, R], block_tables [R, width], lengths [R]) as
    `_decode_impl`'s; prefill: (tokens [P, C], starts [P], lengths [P], slots [P, C],
    block_tables [P, width']) as `_prefill_impl`'s. The first step's R + P * C tokens form
    one packed row (`make_mixed_attention`). sample_positions: [S] int32 (S >= R), the
    packed token whose logits each sample row reads: row i < R decode row i's own token,
    then each prefill sample its chunk's last token; `sampling` has S rows. Steps
    2..num_steps are `_decode_impl`'s on the R decode rows. Returns (the first step's S
    sampled rows, the further steps' [num_steps - 1, R, ...] or None) and the cache.
    """
    dec_tokens, step_slots, dec_tables, dec_lengths = decode
    dec_slots = step_slots[0]
    pre_tokens, pre_starts, pre_lengths, pre_slots, pre_tables = prefill
    chunk = pre_tokens.shape[1]
    pre_positions = pre_starts[:, None] + jnp.arange(chunk, dtype=jnp.int32)[None, :]
    tokens = jnp.concatenate([dec_tokens, pre_tokens.reshape(-1)])[None]
    positions = jnp.concatenate([dec_lengths - 1, pre_positions.reshape(-1)])[None]
    context = MixedContext(
        FusedDecodeContext(cache, dec_lengths, dec_tables),
        PrefillContext(cache, pre_starts, pre_lengths, pre_tables, config.sliding_window),
    )
    hidden, new = hidden_states(
        params,
        tokens,
        positions,
        config=config,
        attention=make_mixed_attention(decode_attend(attention, interpret), config.sliding_window),
        attention_context=context,
        kv_cache=jnp.arange(config.num_layers, dtype=jnp.int32),
    )
    cache = write_all_layers(cache, new["k"], new["v"], jnp.concatenate([dec_slots, pre_slots.reshape(-1)]))
    logits = project_logits(hidden[0, sample_positions], params, config)
    first = sample(logits, sampling, use_filters=use_filters, num_top=num_top)
    if step_slots.shape[0] == 1:
        return (first, None), cache
    rows = dec_tokens.shape[0]
    decode_sampling = jax.tree_util.tree_map(lambda x: x[:rows], sampling)
    rest, cache = _decode_impl(
        params, cache, first.tokens[:rows], step_slots[1:], dec_tables, dec_lengths + 1,
        decode_sampling._replace(step=decode_sampling.step + 1), config=config, attention=attention,
        interpret=interpret, use_filters=use_filters, num_top=num_top,
    )  # fmt: skip
    return (first, rest), cache


_mixed_step = jax.jit(
    _counted("mixed")(_mixed_impl),
    static_argnames=("config", "attention", "interpret", "use_filters", "num_top"),
    donate_argnums=(1,),
)

# Prefill rows of a mixed step: one bucket, so that mixed programs multiply only by the
# decode row and chunk length buckets; a step's further chunks run in prefill calls.
MIXED_PREFILL_ROWS = 4


@functools.partial(jax.jit, donate_argnums=(0,))
@_counted("copy")
def _copy_blocks(cache: KVCache, src: jax.Array, dst: jax.Array) -> KVCache:
    return {name: pages.at[:, :, dst].set(pages[:, :, src]) for name, pages in cache.items()}


def _decode_arrays(
    tokens: Sequence[int],
    slots: Sequence[Sequence[int]],
    block_tables: Sequence[Sequence[int]],
    lengths: Sequence[int],
    rows: int,
    width: int,
    num_steps: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Decode rows padded to `rows`: (tokens [rows], slots [num_steps, rows] (-1: none),
    block tables [rows, width], lengths [rows]); a padded row attends to one token of the
    (zero) null page and writes nothing."""
    n = len(tokens)
    tok = np.zeros(rows, np.int32)
    slot_arr = np.full((num_steps, rows), -1, np.int32)
    lens = np.ones(rows, np.int32)
    tables = np.zeros((rows, width), np.int32)
    tok[:n], lens[:n] = tokens, lengths
    for i, (t, s) in enumerate(zip(block_tables, slots, strict=True)):
        tables[i, : len(t)] = t
        slot_arr[: len(s), i] = s
    return tok, slot_arr, tables, lens


class PrefillChunk(NamedTuple):
    """One row of a prefill call: `tokens` at positions `start`.., after `start` cached tokens."""

    tokens: Sequence[int]
    start: int  # tokens of the sequence already in the cache (read through block_table)
    slots: Sequence[int]  # where each token's K/V go; -1: not written
    block_table: Sequence[int]  # the sequence's blocks; those holding the first `start` tokens are read


class StepResult(NamedTuple):
    """Host copies of the sampled tokens, one row per sequence (prefill: [n, ...]; decode: [num_steps, n, ...])."""

    tokens: np.ndarray  # [n] / [num_steps, n] int32
    logprobs: np.ndarray  # float32, like tokens
    top_ids: np.ndarray  # [..., n, num_top] int32
    top_logprobs: np.ndarray  # [..., n, num_top] float32


class ModelRunner:
    """Holds the weights and the paged cache; runs bucketed prefill/decode+sample steps.

    aligned: compute as the trainer's batch-invariant pass does (`trainer.batch_invariant`),
    so that a sampled token's float32 log-prob is bitwise the trainer's recomputation:
    prefill and decode attention are `dense_attention_reference(key_block=KEY_BLOCK)` over
    the gathered pages with every key at its position's index (decode does not use the
    `attention` backend's kernel), matmuls run in blocks of `ALIGNED_ROW_BLOCK` rows, the
    programs compile with `ALIGNED_COMPILER_OPTIONS` (no YNNPACK on XLA:CPU), and the sampler's log-prob is the trainer's formula. A tied output projection
    is then held as its own transposed copy (`embed.T` laid out [hidden, vocab], one more
    copy of the embedding): with the option, XLA:CPU's matmul against the embedding as
    stored ran 3x slower at 8 rows (49 vs 16 ms; the copy 20 ms) and gives the same bits.
    """

    def __init__(
        self,
        config: ModelConfig,
        params: Params,
        *,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        max_prefill_rows: int = 16,
        min_len_bucket: int = 16,
        attention: AttentionBackend = "auto",
        interpret: bool = False,
        aligned: bool = False,
    ) -> None:
        self.config = config
        self.aligned = aligned
        # The programs' model config: an aligned runner's tied output projection is a copy.
        self.step_config = config.replace(tie_word_embeddings=False) if aligned else config
        self.params = params
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.max_prefill_rows = max_prefill_rows
        self.min_len_bucket = min(min_len_bucket, max_model_len)
        self.max_pages_per_seq = -(-max_model_len // block_size)
        # Short block tables share one program: padding a few pages is cheaper than compiling.
        self.min_width_bucket = min(self.max_pages_per_seq, max(1, 64 // block_size))
        # The one block-table width of the default prefill (its attention reads only the pages needed).
        self.prefill_width = -(-self.max_pages_per_seq // PREFILL_PAGES_PER_STEP) * PREFILL_PAGES_PER_STEP
        # Resolved now, so an unusable backend fails here and "auto" compiles one program.
        self.attention = rlax_kernels.resolve_backend(attention, interpret)
        self.interpret = interpret
        # The mixed programs this runner has run (`mixed_program` keys): compiled ones.
        self.mixed_programs: set[tuple[int, int, int, int, int, bool]] = set()
        shape = (config.num_layers, config.num_kv_heads, num_blocks + 1, block_size, config.head_dim)
        self.cache: KVCache = {
            "k": jnp.zeros(shape, self.cache_dtype),
            "v": jnp.zeros(shape, self.cache_dtype),
        }

    @property
    def params(self) -> Params:
        """The weights (assigning new ones also refreshes the aligned mode's output projection)."""
        return self._params

    @params.setter
    def params(self, params: Params) -> None:
        self._params = params
        self._step_params = params
        if self.aligned and self.config.tie_word_embeddings:
            # A materialised transpose: jnp's transpose of a concrete array is laid out anew.
            self._step_params = {**params, "lm_head": jnp.transpose(jnp.asarray(params["embed"]))}

    @property
    def cache_dtype(self) -> jnp.dtype:
        """The KV cache's dtype: the compute dtype, except float32 on the CPU/XLA paths.

        The CPU kernel reads float32 pages, and XLA on CPU gathers 16-bit elements ~14x slower
        than 32-bit ones; a float32 cache holds bfloat16 K/V exactly (the attention math is
        float32 either way), at twice the memory.
        """
        dtype: jnp.dtype = jnp.dtype(
            jnp.float32 if self.attention in _FLOAT32_CACHE else self.config.compute_jnp_dtype
        )
        return dtype

    @property
    def num_compilations(self) -> collections.Counter[str]:
        """Traces (= compilations) of each jitted step, process-wide (programs are shared by runners)."""
        return COMPILATIONS

    # -- host-side entry points ------------------------------------------------------
    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy whole blocks (src -> dst) in every layer (copy-on-write); padding copies page 0 onto itself."""
        if not copies:
            return
        n = bucket(len(copies), 8, max(8, self.max_num_seqs))
        src = np.zeros(n, np.int32)
        dst = np.zeros(n, np.int32)
        src[: len(copies)], dst[: len(copies)] = zip(*copies)
        self.cache = _copy_blocks(self.cache, src, dst)

    def prefill(
        self,
        prompts: Sequence[Sequence[int]],
        slots: Sequence[Sequence[int]],
        samples: Sequence[tuple[int, tuple[float, float, int, int, int, int]]],
        *,
        num_top: int = 0,
    ) -> StepResult:
        """Prefill whole `prompts` from an empty cache (their K/V into `slots`); see `prefill_chunks`."""
        return self.prefill_chunks(
            [PrefillChunk(p, 0, s, []) for p, s in zip(prompts, slots, strict=True)], samples, num_top=num_top
        )

    def prefill_chunks(
        self,
        chunks: Sequence[PrefillChunk],
        samples: Sequence[tuple[int, tuple[float, float, int, int, int, int]]],
        *,
        num_top: int = 0,
    ) -> StepResult:
        """Prefill one chunk of each of several prompts and sample one token per sample row.

        Chunk i's tokens sit at positions `start`.. and attend to the `start` tokens already
        in the cache (through its block table) and causally to each other; their K/V go to
        its slots (-1: not written). samples: `(chunk index, (temperature, top_p, top_k, seed,
        sample_index, step))` rows, sampled from the logits of the chunk's last token;
        several rows may share one chunk (the n samples of a request).
        """
        return self._sample(self._prefill_last(chunks), samples, num_top)

    def _prefill_last(self, chunks: Sequence[PrefillChunk]) -> jax.Array:
        """Run the prefill of `chunks` (K/V into their slots); -> their last hidden states [rows, hidden]."""
        rows = self.prefill_rows_bucket(len(chunks))
        length = self.prefill_length_bucket(max(len(c.tokens) for c in chunks))
        pages = max(-(-c.start // self.block_size) for c in chunks)
        # Default attention loops over only the pages it needs: one table width for every call.
        width = self.width_bucket(max(pages, 1)) if self.aligned else self.prefill_width
        tokens, starts, lengths, slot_arr, tables = self._prefill_arrays(chunks, rows, length, width)
        last, self.cache = (_prefill_step_aligned if self.aligned else _prefill_step)(
            self._step_params, self.cache, tokens, starts, lengths, slot_arr, tables,
            config=self.step_config, aligned=self.aligned,
        )  # fmt: skip
        last_hidden: jax.Array = last
        return last_hidden

    def _prefill_arrays(
        self, chunks: Sequence[PrefillChunk], rows: int, length: int, width: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """`chunks` padded to `rows` x `length`: (tokens [rows, length], starts [rows], lengths
        [rows], slots [rows, length] (-1: padding, never written), block tables [rows, width])."""
        tokens = np.zeros((rows, length), np.int32)
        slot_arr = np.full((rows, length), -1, np.int32)  # negative: padding, never written
        lengths = np.zeros(rows, np.int32)
        starts = np.zeros(rows, np.int32)
        tables = np.zeros((rows, width), np.int32)
        for i, c in enumerate(chunks):
            if len(c.slots) != len(c.tokens):
                raise ValueError(f"chunk {i}: {len(c.tokens)} tokens but {len(c.slots)} slots")
            tokens[i, : len(c.tokens)] = c.tokens
            slot_arr[i, : len(c.slots)] = c.slots
            lengths[i], starts[i] = len(c.tokens), c.start
            used = -(-c.start // self.block_size)
            tables[i, :used] = c.block_table[:used]
        return tokens, starts, lengths, slot_arr, tables

    def _sample(
        self,
        last: jax.Array | np.ndarray,
        samples: Sequence[tuple[int, tuple[float, float, int, int, int, int]]],
        num_top: int,
    ) -> StepResult:
        """Sample `samples` (`(row, sampling row)`) from the last hidden states [rows, hidden]."""
        n = len(samples)
        sample_rows = self.sample_rows_bucket(n)
        row_of_sample = np.zeros(sample_rows, np.int32)
        row_of_sample[:n] = [r for r, _ in samples]
        batch = self._sampling_batch([s for _, s in samples], sample_rows)
        out = (_sample_step_aligned if self.aligned else _sample_step)(
            self._step_params, last, row_of_sample, batch, config=self.step_config,
            use_filters=self._needs_filters(samples), num_top=self._top_bucket(num_top), aligned=self.aligned,
        )  # fmt: skip
        return self._host(out, n, num_top)

    def decode(
        self,
        tokens: Sequence[int],
        slots: Sequence[Sequence[int]],
        block_tables: Sequence[Sequence[int]],
        lengths: Sequence[int],
        sampling: Sequence[tuple[float, float, int, int, int, int]],
        *,
        num_steps: int = 1,
        num_top: int = 0,
    ) -> StepResult:
        """Decode steps: row `i` feeds `tokens[i]` (at position `lengths[i] - 1`), then its own samples.

        slots[i]: the slots of the K/V of the 1..num_steps tokens row i feeds (its first token's,
        then each sampled token's but the last); a row makes `len(slots[i])` tokens.
        block_tables[i] must already cover them. Returns StepResult arrays of shape
        [num_steps, n, ...]; entries past a row's token count are meaningless.
        """
        n = len(tokens)
        rows = bucket(n, min(8, self.max_num_seqs), self.max_num_seqs)
        width = self.width_bucket(max(len(t) for t in block_tables))
        tok, slot_arr, tables, lens = _decode_arrays(
            tokens, slots, block_tables, lengths, rows, width, num_steps
        )
        batch = self._sampling_batch(sampling, rows)
        out, self.cache = (_decode_steps_aligned if self.aligned else _decode_steps)(
            self._step_params, self.cache, tok, slot_arr, tables, lens, batch, config=self.step_config, attention=self.attention, interpret=self.interpret,
            use_filters=self._needs_filters([(0, s) for s in sampling]), num_top=self._top_bucket(num_top), aligned=self.aligned,
        )  # fmt: skip
        return self._host(out, n, num_top, stacked=True)

    def decode_with_prefill(
        self,
        tokens: Sequence[int],
        slots: Sequence[Sequence[int]],
        block_tables: Sequence[Sequence[int]],
        lengths: Sequence[int],
        sampling: Sequence[tuple[float, float, int, int, int, int]],
        chunks: Sequence[PrefillChunk],
        samples: Sequence[tuple[int, tuple[float, float, int, int, int, int]]],
        *,
        num_steps: int = 1,
        num_top: int = 0,
    ) -> tuple[StepResult, StepResult]:
        """Decode steps of `len(tokens)` rows with one chunk of each of `chunks` in the first, in one call.

        The decode rows are `decode`'s; `chunks` and `samples` are `prefill_chunks`' (at
        most `MIXED_PREFILL_ROWS` chunks; a sample's index is its chunk's). Returns the
        decode rows' tokens ([num_steps, len(tokens), ...], as `decode`) and the samples'
        ([len(samples), ...], as `prefill_chunks`). The call's program is `mixed_program`'s;
        the decode attention reads the longest table width (its cost follows each row's
        length, not the width).
        """
        n_dec, n_samples = len(tokens), len(samples)
        all_rows = [*sampling, *(s for _, s in samples)]
        key = self.mixed_program(n_dec, n_samples, chunks, num_steps, num_top, all_rows)
        if key is None:
            raise ValueError(
                f"a mixed step takes 1..{MIXED_PREFILL_ROWS} chunks and at most as many samples as "
                f"its decode rows' bucket holds again: got {len(chunks)} chunks, {n_samples} samples, {n_dec} decode rows"
            )
        rows, sample_rows, chunk_len = key[:3]
        decode = _decode_arrays(tokens, slots, block_tables, lengths, rows, self.max_pages_per_seq, num_steps)
        prefill = self._prefill_arrays(chunks, MIXED_PREFILL_ROWS, chunk_len, self.prefill_width)
        positions = np.zeros(sample_rows, np.int32)
        positions[:n_dec] = np.arange(n_dec)
        for j, (chunk_index, _) in enumerate(samples):
            last = max(len(chunks[chunk_index].tokens) - 1, 0)
            positions[n_dec + j] = rows + chunk_index * chunk_len + last
        batch = self._sampling_batch(all_rows, sample_rows)
        (first, rest), self.cache = _mixed_step(
            self._step_params, self.cache, decode, prefill, positions, batch,
            config=self.step_config, attention=self.attention, interpret=self.interpret,
            use_filters=key[5], num_top=key[4],
        )  # fmt: skip
        self.mixed_programs.add(key)
        got = self._host(first, n_dec + n_samples, num_top)
        decoded = StepResult(*(a[None, :n_dec] for a in got))
        if rest is not None:
            more = self._host(rest, n_dec, num_top, stacked=True)
            decoded = StepResult(*(np.concatenate([a, b]) for a, b in zip(decoded, more, strict=True)))
        return decoded, StepResult(*(a[n_dec:] for a in got))

    def mixed_program(
        self,
        num_decodes: int,
        num_samples: int,
        chunks: Sequence[PrefillChunk],
        num_steps: int,
        num_top: int,
        sampling: Sequence[tuple[float, float, int, int, int, int]],
    ) -> tuple[int, int, int, int, int, bool] | None:
        """The program of a `decode_with_prefill` call: (decode row bucket, sample row bucket,
        chunk-length bucket, step count, top bucket, filters used); None when the call does
        not fit a mixed step (more than `MIXED_PREFILL_ROWS` chunks, or samples that would
        more than double the decode rows' bucket: the programs stay row pairs (R, R) and
        (R, 2R)). The program has run (been compiled) here when it is in `mixed_programs`."""
        if not chunks or len(chunks) > MIXED_PREFILL_ROWS or num_decodes < 1:
            return None
        rows = bucket(num_decodes, min(8, self.max_num_seqs), self.max_num_seqs)
        sample_rows = bucket(num_decodes + num_samples, rows, max(self.max_num_seqs, rows))
        if sample_rows > 2 * rows:
            return None
        return (
            rows,
            sample_rows,
            self.prefill_length_bucket(max(len(c.tokens) for c in chunks)),
            num_steps,
            self._top_bucket(num_top),
            self._needs_filters([(0, s) for s in sampling]),
        )

    def width_bucket(self, pages: int) -> int:
        """Block-table width for `pages`: steps of `min_width_bucket` up to 8 steps, then powers of two.

        Attention reads every page of the width, so padding costs time; linear steps keep it
        small for the common lengths while the number of programs stays bounded.
        """
        if pages > self.max_pages_per_seq:
            raise ValueError(f"{pages} pages exceed max_pages_per_seq={self.max_pages_per_seq}")
        step = self.min_width_bucket
        width = -(-pages // step) * step
        if width > 8 * step:
            width = bucket(width, 8 * step, max(self.max_pages_per_seq, 8 * step))
        return min(width, self.max_pages_per_seq)

    def widthbuckets_up_to(self) -> list[int]:
        """Every block-table width decode compiles for."""
        return sorted({self.width_bucket(p) for p in range(1, self.max_pages_per_seq + 1)})

    def prefill_rows_bucket(self, num_chunks: int) -> int:
        """Rows of a prefill call holding `num_chunks` chunks: 4, 8, ... `max_prefill_rows`."""
        return bucket(num_chunks, min(4, self.max_prefill_rows), max(self.max_prefill_rows, num_chunks))

    def prefill_length_bucket(self, num_tokens: int) -> int:
        """Columns of a prefill call whose longest chunk has `num_tokens` tokens."""
        return bucket(num_tokens, self.min_len_bucket, self.max_model_len)

    def sample_rows_bucket(self, num_samples: int) -> int:
        """Rows of a sampling call (after a prefill) for `num_samples` samples."""
        return bucket(max(num_samples, 1), min(8, self.max_num_seqs), max(self.max_num_seqs, num_samples))

    def compile_shapes(
        self,
        *,
        max_chunk_tokens: int,
        decode_rows: int,
        decode_steps: Sequence[int] = (1,),
        sampling: Sequence[tuple[float, float, int, int, int, int]] = ((1.0, 1.0, 0, 0, 0, 0),),
        num_top: int = 0,
        mixed: bool = False,
    ) -> None:
        """Compile every program a run within these bounds can call, so none compiles while it serves.

        max_chunk_tokens: the longest prefill chunk (the engine's token budget or chunk size);
        decode_rows: the most sequences decoding at once; decode_steps: the step counts of a
        decode call; sampling: sampling rows (`_sampling_row`) whose filter use must be
        covered; num_top: the most top log-probs a request may ask for (0: none). Covered: block copies
        (every bucket), decode (every row bucket up to `decode_rows`, every block-table width,
        every step count), prefill (every row and length bucket; the default prefill has one
        table width, the aligned one every width) and sampling (every sample-row bucket after
        every prefill row bucket) and, with `mixed` (`EngineConfig.fold_prefill`), the mixed
        steps (`compile_mixed`). Padding rows, page-0 self-copies and unwritten slots only:
        the cache's contents do not change.
        """
        copies = 8
        while True:
            self.copy_blocks([(0, 0)] * copies)
            if copies >= max(8, self.max_num_seqs):
                break
            copies *= 2
        tops = [0, *buckets_up_to(1, num_top, max(num_top, 64))]  # `_top_bucket`'s values up to num_top
        sampling = list(dict.fromkeys(sampling))
        for rows in buckets_up_to(min(8, self.max_num_seqs), decode_rows, self.max_num_seqs):
            for steps, width, top, row in itertools.product(
                decode_steps, self.widthbuckets_up_to(), tops, sampling
            ):
                self.decode(
                    [0] * rows, [[-1] * steps] * rows, [[0] * width] * rows, [1] * rows, [row] * rows,
                    num_steps=steps, num_top=top,
                )  # fmt: skip
        if max_chunk_tokens < 1:
            return
        lengths = buckets_up_to(
            self.min_len_bucket, min(max_chunk_tokens, self.max_model_len), self.max_model_len
        )
        # Aligned prefill reads a width bucket of pages: a chunk after `start` cached tokens per width.
        starts = (
            [0] if not self.aligned else [(w - 1) * self.block_size + 1 for w in self.widthbuckets_up_to()]
        )
        for rows in buckets_up_to(
            min(4, self.max_prefill_rows), self.max_prefill_rows, self.max_prefill_rows
        ):
            for length, start in itertools.product(lengths, starts):
                chunk = PrefillChunk([0] * length, start, [-1] * length, [0] * self.max_pages_per_seq)
                last = self._prefill_last([chunk] * rows)
            for samples, top, row in itertools.product(
                buckets_up_to(min(8, self.max_num_seqs), self.max_num_seqs, self.max_num_seqs), tops, sampling
            ):
                self._sample(last, [(0, row)] * samples, top)
        if mixed and not self.aligned:
            self.compile_mixed(decode_rows, max_chunk_tokens, sampling, num_top, decode_steps)

    def compile_mixed(
        self,
        rows: int,
        max_chunk_tokens: int,
        sampling: Sequence[tuple[float, float, int, int, int, int]] = ((1.0, 1.0, 0, 0, 0, 0),),
        num_top: int = 0,
        decode_steps: Sequence[int] = (1,),
    ) -> None:
        """Compile the mixed steps (`decode_with_prefill`) of up to `rows` decode and sample rows
        with chunks of up to `max_chunk_tokens` tokens: every decode row bucket R with R and 2R
        sample rows x chunk-length bucket x step count (x top log-prob bucket x filter use).
        Padding rows and unwritten slots only."""
        tops = [0, *buckets_up_to(1, num_top, max(num_top, 64))]
        lengths = buckets_up_to(
            self.min_len_bucket, min(max_chunk_tokens, self.max_model_len), self.max_model_len
        )
        row_buckets = buckets_up_to(
            min(8, self.max_num_seqs), min(rows, self.max_num_seqs), self.max_num_seqs
        )
        pairs = [(r, t) for r in row_buckets for t in dict.fromkeys((r, min(2 * r, self.max_num_seqs)))]
        for (count, total), length, steps, top, row in itertools.product(
            pairs, lengths, decode_steps, tops, dict.fromkeys(sampling)
        ):
            decodes = max(count - 1, 1)
            chunk = PrefillChunk([0] * length, 0, [-1] * length, [0] * self.max_pages_per_seq)
            samples = [(0, row)] * (total - decodes)
            if self.mixed_program(decodes, len(samples), [chunk], steps, top, [row]) is None:
                continue
            self.decode_with_prefill(
                [0] * decodes, [[-1] * steps] * decodes, [[0]] * decodes, [1] * decodes, [row] * decodes,
                [chunk], samples, num_steps=steps, num_top=top,
            )  # fmt: skip

    def warmup(self, num_seqs: int, num_steps: Sequence[int] = (1,)) -> None:
        """Compile decode for `num_seqs` rows at every width and step count, and every block-copy
        bucket (`compile_shapes` compiles everything a run can call)."""
        self.compile_shapes(max_chunk_tokens=0, decode_rows=num_seqs, decode_steps=num_steps)

    # -- helpers ----------------------------------------------------------------------
    @staticmethod
    def _needs_filters(samples: Sequence[tuple[int, tuple[float, float, int, int, int, int]]]) -> bool:
        return any(s[0] > 0 and (s[1] < 1.0 or s[2] > 0) for _, s in samples)

    @staticmethod
    def _top_bucket(num_top: int) -> int:
        return 0 if num_top == 0 else bucket(num_top, 1, max(num_top, 64))

    @staticmethod
    def _sampling_batch(rows: Sequence[tuple[float, float, int, int, int, int]], size: int) -> SamplingBatch:
        padded = list(rows) + [(0.0, 1.0, 0, 0, 0, 0)] * (size - len(rows))
        return SamplingBatch.from_rows(padded)

    @staticmethod
    def _host(out: SamplerOutput, n: int, num_top: int, *, stacked: bool = False) -> StepResult:
        tokens, lps, ids, top = jax.device_get(tuple(out))
        if stacked:  # [num_steps, rows, ...]
            return StepResult(tokens[:, :n], lps[:, :n], ids[:, :n, :num_top], top[:, :n, :num_top])
        return StepResult(tokens[:n], lps[:n], ids[:n, :num_top], top[:n, :num_top])
