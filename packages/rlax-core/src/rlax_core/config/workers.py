"""`workers:` the inference workers: how many, when they reload, and their engine's sizes.

The engine fields carry the names of `rlax_inference.EngineConfig`, whose defaults are
these (`EngineConfig` reads them from `WorkersSection`), so an option has one name and one
default whether it is set in a run config or on an engine made by hand.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from rlax_core.config.base import Section, check, check_address


class WorkersSection(Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Inference workers: how many, reload staleness j, back-pressure, and engine sizes.

    `j`: a worker reloads once the newest version is j ahead of the one it holds.
    `max_inflight_groups`: prompt groups the controller sends one worker at a time.
    `max_inflight_requests`: requests one worker holds (queued or generating); beyond it a
    request is answered `busy` at once, so the client sends it elsewhere. It must cover
    what the controller sends one worker (`max_inflight_groups`, and as many eval requests).
    `map_weights`: on the parameter server's host, map its state file of a version instead
    of receiving a copy (no weight bytes of the worker's own; about 15% slower weight-bound
    matmuls on XLA:CPU with 4 KiB file pages; false: copy as before).
    Engine (`rlax_inference.EngineConfig` of the same names): `max_num_seqs` sequences
    decoded together; `block_size` tokens per KV-cache block (the cache holds
    `max_num_seqs` sequences of `model.max_seq_len` tokens); `max_num_batched_tokens`
    tokens of one engine step; `attention` the decode attention backend; `num_decode_steps`
    decode steps per model call (same tokens, fewer host round trips; requests join
    between calls).
    `fold_prefill`: a step that decodes runs the prefill of requests that join it (a
    group arriving while others decode, a trajectory's next turn) in the same model call
    (`EngineConfig.fold_prefill`), through programs the worker compiles at its warm-up
    where groups can join running ones. Off by default: on the 2-core CPU the warm-up
    then takes ~35 s more per worker (multi-turn demo: 28.7 -> 63.5 s) and the
    benchmarked workloads gained nothing measurable (their turns arrive together, so few
    steps mix), while one mixed call is 1.06-1.44x faster than the two it replaces
    (docs/benchmarks.md): turn it on where steps interleave arrivals and decode is bound
    by reading the weights (an accelerator, a larger model).
    `lora_apply` (runs with `trainer.lora`): how a worker applies each version's adapters to
    the base it holds: "unmerged" (the low-rank path in every forward; a switch costs the
    adapters' pull alone) or "merged" (W + scale * A @ B, one merge per switch, a second
    copy of the adapted weights). On SmolLM2 on the CPU both decode at the same rate and
    an unmerged switch takes 0.02x a full reload, a merged one 0.37x (docs/lora.md).
    `on_new_version` (pinned versions, `controller.lag` > `segment_newest_lag`): "finish" generates each
    group whole with its one version; "interrupt" makes partial rollouts
    (`rlax_controller.partial_rollouts`): samples are generated in segments of
    `segment_tokens` tokens (0: data.max_new_tokens split evenly across the versions a
    group spans, rounded up), each with the newer version the controller's schedule names,
    so a long sample crosses weight updates and a worker switching versions waits for one
    segment, not for its longest sample. `segment_newest_lag`: the newest version a
    segment of step s may use is s - segment_newest_lag (< controller.lag); 1, the version
    trained just before s, puts the last segment on the critical path (it can only start
    when step s could), 2 lets it overlap step s - 1's training. Single-turn samples with
    workers.j 1 only. `resume_kv` (with "interrupt"): "recompute" prefills a resumed sample's
    tokens so far with the newer weights; "keep" lets it continue from the K/V the earlier
    weights computed for them where its worker still holds them (PipelineRL's choice: no
    prefill, but its new tokens attend to stale K/V, and whether a segment finds them
    depends on which worker it lands on, so a run is not repeatable to the bit)."""

    count: int = 2
    j: int = 1
    max_inflight_groups: int = 2
    addresses: list[str] = msgspec.field(default_factory=list)
    platform: str = "cpu"
    max_inflight_requests: int = 64
    map_weights: bool = True
    max_num_seqs: int = 64
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    attention: str = "auto"
    num_decode_steps: int = 1
    fold_prefill: bool = False
    lora_apply: Literal["merged", "unmerged"] = "unmerged"
    on_new_version: Literal["finish", "interrupt"] = "finish"
    segment_tokens: int = 0
    segment_newest_lag: int = 1
    resume_kv: Literal["recompute", "keep"] = "recompute"

    def __post_init__(self) -> None:
        check(self.count >= 1, "count", self.count, "must be >= 1")
        check(self.j >= 1, "j", self.j, "must be >= 1")
        check(self.max_inflight_groups >= 1, "max_inflight_groups", self.max_inflight_groups, "must be >= 1")
        check(self.max_num_seqs >= 1, "max_num_seqs", self.max_num_seqs, "must be >= 1")
        check(self.block_size >= 1, "block_size", self.block_size, "must be >= 1")
        check(
            self.max_num_batched_tokens >= self.max_num_seqs,
            "max_num_batched_tokens",
            self.max_num_batched_tokens,
            f"must be >= max_num_seqs={self.max_num_seqs} (one decode token per sequence)",
        )
        check(
            self.segment_tokens >= 0,
            "segment_tokens",
            self.segment_tokens,
            "must be >= 0 (0: max_new_tokens / the versions a group spans)",
        )
        check(self.segment_newest_lag >= 1, "segment_newest_lag", self.segment_newest_lag, "must be >= 1")
        check(self.num_decode_steps >= 1, "num_decode_steps", self.num_decode_steps, "must be >= 1")
        check(
            self.max_inflight_requests >= 2 * self.max_inflight_groups,
            "max_inflight_requests",
            self.max_inflight_requests,
            f"must be >= 2 * max_inflight_groups={self.max_inflight_groups} (training and eval requests)",
        )
        check(
            not self.addresses or len(self.addresses) == self.count,
            "addresses",
            self.addresses,
            f"needs one address per worker (count={self.count}) or none",
        )
        for i, address in enumerate(self.addresses):
            check_address(f"addresses[{i}]", address)
