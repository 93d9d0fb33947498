"""Which decoded requests the worker's engine thread admits next, and which it refuses unseen.

`RequestLimits`: the server's maximum for every size and count a `GenerateRequest` can ask
for (samples, prompt tokens, new tokens, top logprobs, stop ids and strings, agent turns,
tool time, record size, id length). The worker refuses a request beyond one at once
(``too_large``), naming the field, the value and the limit, before it waits for anything.

`AdmissionQueue`: the requests not yet in the engine, in arrival order, with their client.

- Round robin across clients: the next request admitted is the oldest one of the client
  served longest ago (a client never served, or not for a while, goes first), so one
  client's many requests cannot starve another's. A client's own requests keep their order.
- Versions the worker cannot load now (not published yet, or a failed load backing off) set
  their requests aside: they never hold up requests for the loaded weights. A request for
  another version the worker *can* load stops the admission of requests that arrived after
  it, so the engine drains and the worker switches versions (in arrival order, as before).

What a request generates does not depend on this order: the controller seeds every request
(`SamplingParams.seed`) and the engine's sampling keys depend only on (seed, sample, step).
Only an unseeded request draws its seed from the engine's stream in admission order, as it
drew it in arrival order before.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterator

import rlax_protocol as rp
from rlax_inference.worker_io import Job

__all__ = ["AdmissionQueue", "Queued", "RequestLimits"]

_MAX_CLIENT_TURNS = 4096  # remembered clients (served order); beyond it those not queued are forgotten


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """Server-side maxima of a `GenerateRequest` beyond those the engine's sizes set (`n` up to
    `max_num_seqs`, prompt tokens up to `max_model_len - 1`, `max_tokens` and an agent's
    `max_total_tokens` up to `max_model_len`): `WorkerConfig.limits`.

    max_top_logprobs: alternatives per token (the sampler compiles up to 64 without a new shape).
    max_stop_token_ids / max_stop_strings / max_stop_string_chars: stop conditions (each new
      token is checked against all of them; the text window decoded per token grows with the
      longest string).
    max_agent_turns / max_tool_timeout_s / max_agent_record_chars: a multi-turn request's model
      turns, the time one environment step may hold a tool thread, and its record (parsed by
      the environment).
    max_request_id_chars: the id echoed in every reply and log line.
    """

    max_top_logprobs: int = 64
    max_stop_token_ids: int = 256
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_agent_turns: int = 64
    max_tool_timeout_s: float = 60.0
    max_agent_record_chars: int = 1 << 20
    max_request_id_chars: int = 256

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "max_tool_timeout_s":
                ok = isinstance(value, int | float) and math.isfinite(value) and value > 0
            else:
                ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
            if not ok:
                raise ValueError(f"RequestLimits.{field.name} must be > 0, got {value!r}")

    def check(self, request: rp.GenerateRequest, *, max_num_seqs: int, max_model_len: int) -> str | None:
        """None, or why `request` asks for more than this server gives (field, value, limit)."""
        s = request.sampling
        stops = s.stop_strings
        checks: list[tuple[str, float, float, str]] = [
            ("request_id length", len(request.request_id), self.max_request_id_chars, "max_request_id_chars"),
            ("n", request.n, max_num_seqs, "max_num_seqs"),
            # A resumed partial rollout's prompt is the request's plus that sample's tokens so far.
            (
                "prompt length" + (" with the longest resumed sample" if request.resume else ""),
                len(request.prompt_token_ids) + max((len(r.token_ids) for r in request.resume), default=0),
                max_model_len - 1,
                "max_model_len - 1",
            ),
            ("sampling.max_tokens", s.max_tokens, max_model_len, "max_model_len"),
            ("sampling.top_logprobs", s.top_logprobs, self.max_top_logprobs, "max_top_logprobs"),
            (
                "len(sampling.stop_token_ids)",
                len(s.stop_token_ids),
                self.max_stop_token_ids,
                "max_stop_token_ids",
            ),
            ("len(sampling.stop_strings)", len(stops), self.max_stop_strings, "max_stop_strings"),
            (
                "the longest stop string's length",
                max(map(len, stops), default=0),
                self.max_stop_string_chars,
                "max_stop_string_chars",
            ),
        ]
        agent = request.agent
        if agent is not None:
            checks += [
                ("agent.max_turns", agent.max_turns, self.max_agent_turns, "max_agent_turns"),
                ("agent.max_total_tokens", agent.max_total_tokens, max_model_len, "max_model_len"),
                ("agent.tool_timeout_s", agent.tool_timeout_s, self.max_tool_timeout_s, "max_tool_timeout_s"),
                (
                    "len(agent.record)",
                    len(agent.record),
                    self.max_agent_record_chars,
                    "max_agent_record_chars",
                ),
            ]
        for field, value, limit, name in checks:
            if value > limit:
                return f"{field}={value} exceeds this worker's {name}={limit}"
        return None


@dataclasses.dataclass(frozen=True)
class Queued:
    """A request waiting for the engine: its job, when it reached the engine thread, its order."""

    job: Job
    since: float
    order: int

    @property
    def version(self) -> int | None:
        return self.job.request.weight_version

    @property
    def client(self) -> bytes:
        return self.job.client


class AdmissionQueue:
    """Requests decoded but not in the engine yet (see the module docstring)."""

    def __init__(self) -> None:
        self._items: list[Queued] = []  # arrival order
        self._arrivals = itertools.count()
        self._turns = itertools.count()
        self._served: dict[bytes, int] = {}  # client -> turn it was last served at

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Queued]:
        return iter(list(self._items))

    def add(self, job: Job, now: float) -> None:
        self._items.append(Queued(job, now, next(self._arrivals)))

    def remove(self, keys: set[int]) -> list[Queued]:
        """Take the requests named by `keys` out of the queue; returns them."""
        taken = [q for q in self._items if q.job.key in keys]
        if taken:
            self._items = [q for q in self._items if q.job.key not in keys]
        return taken

    def next_version(self, loaded: int | None, loadable: Callable[[int], bool]) -> int | None:
        """The version to load next: the one the oldest request that is not set aside names,
        when it is not the loaded one (None: admit what is queued for the loaded weights
        first, or nothing to switch to)."""
        for q in self._items:
            v = q.version
            if v is None or v == loaded:
                return None
            if loadable(v):
                return v
        return None

    def admissible(self, loaded: int | None, loadable: Callable[[int], bool]) -> list[Queued]:
        """The requests that may enter the engine now, in round-robin order across clients:
        those for the loaded weights (or naming none) that arrived before the oldest request
        for another version the worker can load. Call `served` for each one admitted."""
        per_client: dict[bytes, list[Queued]] = {}
        for q in self._items:
            v = q.version
            if v is not None and v != loaded:
                if loadable(v):
                    break  # the engine drains, then switches to v
                continue  # set aside: its version cannot be loaded now
            per_client.setdefault(q.client, []).append(q)
        turns = {client: self._served.get(client, -1) for client in per_client}
        heads = {client: 0 for client in per_client}
        # Later than every turn handed out so far, as the turns `served` will hand out are.
        upcoming = itertools.count(max(self._served.values(), default=-1) + 1)
        order: list[Queued] = []
        while heads:
            # Served longest ago first; clients never served by the arrival of their oldest request.
            client = min(heads, key=lambda c: (turns[c], per_client[c][heads[c]].order))
            order.append(per_client[client][heads[client]])
            turns[client] = next(upcoming)
            heads[client] += 1
            if heads[client] == len(per_client[client]):
                del heads[client]
        return order

    def served(self, queued: Queued) -> None:
        """`queued` left the queue for the engine (or was refused there): its client's turn."""
        self._items.remove(queued)
        self._served[queued.client] = next(self._turns)
        if len(self._served) > _MAX_CLIENT_TURNS:
            waiting = {q.client for q in self._items}
            self._served = {c: t for c, t in self._served.items() if c in waiting}
