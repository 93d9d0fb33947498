"""`agent:` multi-turn rollouts."""

from __future__ import annotations

import math
from typing import Literal

from rlax_core.config.base import Section, check


class AgentSection(Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Multi-turn rollouts: each sample is a trajectory of model turns (at most
    `data.max_new_tokens` tokens each) and environment turns (tool results), run by the
    worker. `environment`: a registered `rlax_data.envs` name (`calculator`, `python`,
    `tools`, one a user registers, or a `package.module:factory` path); empty: single-turn rollouts. `max_turns`: model turns
    per trajectory; `max_total_tokens`: tokens after the prompt, both kinds of turn (0: as
    many as `model.max_seq_len` leaves after the longest prompt); `tool_timeout_s`: the limit
    of one environment step (and of each call in it: a turn's calls run at once);
    `tool_format`: how a call is written (`hermes`: `<tool_call>{json}</tool_call>`, Hermes
    and Qwen chat models; `llama3_json`: `{"name": ..., "parameters": {...}}`, Llama 3.x;
    `mistral`: `[TOOL_CALLS][{...}, ...]`; `bracket`: `[expression]`, the character-level
    tiny model; empty: the format the model's chat template was written for, `hermes` when
    it names none, `bracket` for `model.source: tiny`). `max_calls_per_turn`: the calls one
    model turn may make (1 to 64); more are answered with one error result. With 1 a Hermes
    turn stops at `</tool_call>`; with more it ends at the model's end-of-turn token, so it
    can hold several calls (Llama and Mistral turns always end there; `bracket` holds one).
    `where`: `local` runs the environment steps in the worker's threads; `service` in the
    run's verifier service (`verifier.mode: service`), so tools run off the worker's host."""

    environment: str = ""
    where: Literal["local", "service"] = "local"
    max_turns: int = 4
    max_total_tokens: int = 0
    tool_timeout_s: float = 10.0
    tool_format: Literal["", "hermes", "llama3_json", "mistral", "bracket"] = ""
    max_calls_per_turn: int = 1

    def __post_init__(self) -> None:
        check(self.max_turns >= 1, "max_turns", self.max_turns, "must be >= 1")
        check(self.max_total_tokens >= 0, "max_total_tokens", self.max_total_tokens, "must be >= 0")
        check(
            1 <= self.max_calls_per_turn <= 64,
            "max_calls_per_turn",
            self.max_calls_per_turn,
            "must be in [1, 64]",
        )
        check(
            self.tool_format != "bracket" or self.max_calls_per_turn == 1,
            "max_calls_per_turn",
            self.max_calls_per_turn,
            "must be 1 with tool_format: bracket (a turn stops at ']')",
        )
        check(
            math.isfinite(self.tool_timeout_s) and self.tool_timeout_s > 0,
            "tool_timeout_s",
            self.tool_timeout_s,
            "must be a finite number > 0",
        )

    @property
    def enabled(self) -> bool:
        return bool(self.environment)
