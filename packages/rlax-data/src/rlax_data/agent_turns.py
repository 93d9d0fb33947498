"""Multi-turn trajectories as token ids: how the run's model sees an environment's turns.

The worker's agent loop (`rlax_inference.agent_loop`) works on token ids; this is where
text meets tokens, on every node alike (worker, trainer for SFT demonstrations, controller
for scoring):

- a model turn's text is what the environment parses;
- an environment turn is the observation wrapped as the chat template wraps a `tool`
  message, closing the model's turn first (a turn that stopped on a tool call's stop
  string has not written its end-of-turn token yet). The results of a turn's several
  calls (joined by `TOOL_MESSAGE_SEPARATOR`) are consecutive tool messages, framed as the
  template frames them (Qwen's share one turn, Llama's are `ipython` messages each). A
  template that JSON-encodes a tool message's content (Meta's Llama 3.1) gets the
  observation JSON-encoded the same way. For a model without a chat template (the
  character-level tiny model) it is the observation's characters alone. The template's
  framing is encoded with its special tokens; the observation is plain text
  (`special_tokens=False`): a tool that prints `<|im_end|>` or `<eos>` gets the ordinary
  tokens that spell it, so it cannot end its message, forge an assistant turn or end the
  sequence;
- the tool format is the one the chat template was written for unless the run names one
  (`rlax_data.envs.tool_format_for_template`). A format that allows several calls per
  turn has no stop string: the model's end-of-turn token ends a turn;
- the verifier scores a trajectory's last model turn (its final answer).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import msgspec

from rlax_data.datasets import Record

__all__ = ["AgentTurns", "last_model_turn"]

# Marks rendered in place of a turn's text to read the template's framing off; the NUL
# characters make them text no template holds, and a JSON encoder escapes (`\u0000`).
_MODEL_MARK, _TOOL_MARK, _SECOND_TOOL_MARK = "\x00MODEL\x00", "\x00TOOL\x00", "\x00TOOL2\x00"


def last_model_turn(token_ids: Sequence[int], mask: Sequence[int]) -> tuple[int, ...]:
    """The tokens of the last model turn of a trajectory (`mask`: 1 on model tokens; an
    empty mask means a single-turn sample, all model tokens)."""
    if not mask:
        return tuple(token_ids)
    end = len(mask)
    while end > 0 and not mask[end - 1]:
        end -= 1
    start = end
    while start > 0 and mask[start - 1]:
        start -= 1
    return tuple(token_ids[start:end])


class AgentTurns:
    """The run's tool format, environments and turn encoding (`rlax_inference.TurnCodec`).

    tokenizer: the run's tokenizer; chat: wrap environment turns with its chat template;
    tool_format: a format name (`rlax_data.envs.tool_format_names`), or "" for the one the
    chat template was written for ("hermes" when the template names none; "bracket"
    without a chat template); max_calls_per_turn: the calls one model turn may hold (the
    format's `max_calls`); max_result_chars, tool_timeout_s: the environments' tool limits;
    service_address: step the trajectories' environments in the verifier service there
    (`rlax_data.envs.remote`; empty: in this process).
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        chat: bool,
        tool_format: str = "",
        max_calls_per_turn: int = 1,
        max_result_chars: int = 4096,
        tool_timeout_s: float = 10.0,
        service_address: str = "",
    ) -> None:
        from rlax_data.envs import TOOL_MESSAGE_SEPARATOR, make_tool_format, tool_format_names

        name = tool_format or _template_format(tokenizer, chat)
        if name not in tool_format_names():
            raise ValueError(f"agent.tool_format = {name!r}: must be one of {tool_format_names()}")
        try:
            self.format = make_tool_format(name, max_calls=max_calls_per_turn)
        except ValueError as error:
            raise ValueError(f"agent.max_calls_per_turn = {max_calls_per_turn}: {error}") from None
        self.tool_format = name
        self.tokenizer = tokenizer
        self.chat = chat
        self.max_result_chars = max_result_chars
        self.tool_timeout_s = tool_timeout_s
        self._separator = TOOL_MESSAGE_SEPARATOR
        self._wrap: tuple[str, str, str] = ("", "", "")
        self._between: str | None = ""  # between two tool messages; None: the template has no one way
        self._json_content = False  # the template JSON-encodes a tool message's content
        if chat:
            self._wrap, self._between, self._json_content = self._chat_wrapping()
        if self._between is None and self.format.max_calls > 1:
            raise ValueError(
                f"agent.max_calls_per_turn = {max_calls_per_turn}: the chat template does not render "
                "consecutive tool messages the same way every time, so a turn's results cannot be shown "
                "as one message each; allow one call per turn"
            )
        self._framing: dict[bool, tuple[list[int], list[int]]] = {}
        self._between_ids = list(self.tokenizer.encode(self._between)) if self._between else []
        self._markers = self._marker_ids()
        # Made here, once, rather than by the first environment turn in a worker's
        # environment thread: the plain-text tokenizer (a copy of the vocabulary), the
        # longest token, the framing ids.
        self.tokenizer.encode("", special_tokens=False)
        self.max_token_chars  # noqa: B018
        for after_end_of_turn in (False, True):
            self._framing_ids(after_end_of_turn)
        self.remote = None
        if service_address:
            from rlax_data.envs.remote import EnvOptions, RemoteEnvironments

            options = EnvOptions(
                format=name,
                max_calls_per_turn=max_calls_per_turn,
                max_result_chars=max_result_chars,
                tool_timeout_s=tool_timeout_s,
            )
            self.remote = RemoteEnvironments(service_address, options=options, timeout_s=tool_timeout_s)

    # -- environments ------------------------------------------------------------------
    @property
    def stop_strings(self) -> tuple[str, ...]:
        """The format's call stop, if it has one (none where a turn may hold several calls:
        the end-of-turn token ends those turns)."""
        return (self.format.call_stop,) if self.format.call_stop else ()

    def environment(self, name: str) -> Any:
        """A fresh environment `name` with the run's tool format and limits (not reset)."""
        from rlax_data.envs import make_environment

        # Every factory takes these options (`rlax_data.envs.register_environment`).
        return make_environment(
            name,
            format=self.format,
            max_result_chars=self.max_result_chars,
            tool_timeout_s=self.tool_timeout_s,
        )

    def new_environment(self, name: str, record_json: str) -> Any:
        try:
            record = msgspec.json.decode(record_json, type=Record)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as error:
            raise ValueError(f"agent.record: not a record ({error})") from None
        if self.remote is not None:
            # Made in the service only: a worker needs no sandbox for the Python tool.
            from rlax_data.envs import environment_names

            if name not in environment_names() and ":" not in name:
                raise ValueError(f"environment: {name!r} is not one of {environment_names()}")
            env = self.remote.make(name)
        else:
            env = self.environment(name)
        env.reset(record)
        return env

    # -- turns -------------------------------------------------------------------------
    def turn_text(self, token_ids: Sequence[int]) -> str:
        """A model turn's text, without special tokens but the format's own markers
        (Mistral's `[TOOL_CALLS]`, Llama's `<|python_tag|>`), which say a call follows."""
        ids = [int(t) for t in token_ids]
        if not any(t in self._markers for t in ids):
            return str(self.tokenizer.decode(ids, skip_special_tokens=True))
        pieces: list[str] = []
        start = 0
        for at, token in enumerate(ids):
            if token in self._markers:
                pieces += [
                    self.tokenizer.decode(ids[start:at], skip_special_tokens=True),
                    self._markers[token],
                ]
                start = at + 1
        pieces.append(self.tokenizer.decode(ids[start:], skip_special_tokens=True))
        return "".join(map(str, pieces))

    def _marker_ids(self) -> dict[int, str]:
        """The special token of each of the format's markers this tokenizer has."""
        specials: frozenset[int] = getattr(self.tokenizer, "special_ids", frozenset())
        found: dict[int, str] = {}
        for marker in self.format.special_markers:
            try:
                ids = self.tokenizer.encode(marker)
            except Exception:  # a character tokenizer cannot spell it: no such token
                continue
            if len(ids) == 1 and ids[0] in specials:
                found[int(ids[0])] = marker
        return found

    @property
    def max_token_chars(self) -> int:
        """The most characters of an observation one token stands for (the agent loop
        refuses a longer observation than the tokens left allow without tokenizing it)."""
        return int(self.tokenizer.max_token_chars)

    def env_turn_ids(self, observation: str, *, after_end_of_turn: bool) -> list[int]:
        """The environment turn's token ids: the template's framing (special tokens) around
        the observation's messages, each encoded as plain text. An observation the
        tokenizer cannot spell (a character outside the tiny model's alphabet) is shown as
        the format's failed result."""
        opening, closing = self._framing_ids(after_end_of_turn)
        messages = observation.split(self._separator)
        if len(messages) > 1 and self._between is None:
            raise ValueError(
                "the observation holds several tool messages, and the chat template does not frame "
                "consecutive tool messages one way"
            )
        try:
            body: list[int] = []
            for i, message in enumerate(messages):
                if i:
                    body += self._between_ids
                body += self.tokenizer.encode(self._content(message), special_tokens=False)
        except TypeError:  # a tokenizer without `special_tokens=`: a bug to surface, not to hide
            raise
        except Exception:  # the tokenizer's own error type differs between tokenizers
            from rlax_data.envs import ToolResult

            failed = self.format.render_result(ToolResult(text="", ok=False, error="malformed"))
            body = self.tokenizer.encode(self._content(failed), special_tokens=False)
        return [*opening, *body, *closing]

    def _content(self, message: str) -> str:
        """A tool message's text as the template writes it: JSON-encoded where it encodes."""
        return _json_text(message) if self._json_content else message

    def _framing_ids(self, after_end_of_turn: bool) -> tuple[list[int], list[int]]:
        """(ids before the observation, ids after it), the template's own special tokens
        included; computed once."""
        if after_end_of_turn not in self._framing:
            close, before, after = self._wrap
            eos = getattr(self.tokenizer, "eos_token", None) or ""
            if after_end_of_turn and eos and close.startswith(eos):
                close = close[len(eos) :]
            opening = list(self.tokenizer.encode(close + before)) if close + before else []
            closing = list(self.tokenizer.encode(after)) if after else []
            self._framing[after_end_of_turn] = (opening, closing)
        return self._framing[after_end_of_turn]

    def prompt_ids(
        self, text: str, tools: list[dict[str, Any]], *, examples: Sequence[dict[str, Any]] = ()
    ) -> list[int]:
        """A chat model's first prompt: the user's `text`, and the `tools` it may call. A
        template that renders `tools=` itself gets them so; one that ignores them (SmolLM2's)
        gets them in a system message, in the wording of the run's call format. `examples`:
        chat messages shown before the question (a worked example conversation: user,
        assistant calls, tool results, assistant answer)."""
        messages: list[dict[str, Any]] = [*examples, {"role": "user", "content": text}]
        plain = self.tokenizer.render_chat(messages)
        if not tools or self.tokenizer.render_chat(messages, tools=tools) != plain:
            return list(self.tokenizer.apply_chat_template(messages, tools=tools))
        system = self.format.tools_prompt(tools)
        return list(self.tokenizer.apply_chat_template([{"role": "system", "content": system}, *messages]))

    def demonstration(self, segments: Sequence[tuple[str, bool]]) -> tuple[list[int], list[int]]:
        """(token ids, model mask) of a demonstrated trajectory given as (text, is model turn)
        segments; the end-of-sequence token follows the last model turn. Where no stop
        string ends a turn of calls (several calls per turn, Llama's and Mistral's formats)
        the model must end it itself: the end-of-turn token follows each model turn that an
        environment turn follows, as a model token, as in generation."""
        eos = int(self.tokenizer.eos_id)
        model_ends_turns = not self.stop_strings
        ids: list[int] = []
        mask: list[int] = []
        after_end_of_turn = False
        for at, (text, is_model) in enumerate(segments):
            if is_model:
                piece = list(self.tokenizer.encode(text))
                after_end_of_turn = model_ends_turns and at + 1 < len(segments) and not segments[at + 1][1]
                if after_end_of_turn:
                    piece.append(eos)
            else:
                piece = self.env_turn_ids(text, after_end_of_turn=after_end_of_turn)
            ids += piece
            mask += [int(is_model)] * len(piece)
        ids.append(eos)
        mask.append(1)
        return ids, mask

    def _chat_wrapping(self) -> tuple[tuple[str, str, str], str | None, bool]:
        """((what closes a model turn, what opens a tool message, what closes it and opens
        the next model turn), what stands between two consecutive tool messages (None when
        the template frames a second one differently), whether the template JSON-encodes a
        tool message's content), read off the chat template by rendering a conversation
        with and without tool messages."""
        user = {"role": "user", "content": "u"}
        model = {"role": "assistant", "content": _MODEL_MARK}
        tool = {"role": "tool", "content": _TOOL_MARK}
        try:
            without = self.tokenizer.render_chat([user, model], add_generation_prompt=False)
            with_tool = self.tokenizer.render_chat([user, model, tool], add_generation_prompt=True)
        except Exception as error:
            raise ValueError(f"the chat template cannot render a tool message: {error}") from None
        json_content = _TOOL_MARK not in with_tool and _json_text(_TOOL_MARK) in with_tool
        mark = _json_text(_TOOL_MARK) if json_content else _TOOL_MARK
        if not with_tool.startswith(without) or mark not in with_tool:
            raise ValueError("the chat template renders a tool message by changing the turns before it")
        close = without[without.index(_MODEL_MARK) + len(_MODEL_MARK) :]
        before, after = with_tool[len(without) :].split(mark, 1)
        second = _json_text(_SECOND_TOOL_MARK) if json_content else _SECOND_TOOL_MARK
        try:
            with_two = self.tokenizer.render_chat(
                [user, model, tool, {"role": "tool", "content": _SECOND_TOOL_MARK}],
                add_generation_prompt=True,
            )
        except Exception:
            return (close, before, after), None, json_content
        head, tail = without + before + mark, second + after
        framed_alike = with_two.startswith(head) and with_two.endswith(tail)
        if not framed_alike or len(with_two) < len(head) + len(tail):
            return (close, before, after), None, json_content
        return (close, before, after), with_two[len(head) : len(with_two) - len(tail)], json_content


def _json_text(text: str) -> str:
    """`text` as it reads inside a JSON string (a template's `tojson`)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


def _template_format(tokenizer: Any, chat: bool) -> str:
    """The format a run names none of gets: the chat template's own, else "hermes"; "bracket"
    for a model without a chat template."""
    if not chat:
        return "bracket"
    from rlax_data.envs import tool_format_for_template

    template = getattr(tokenizer, "chat_template", None)
    source = getattr(template, "source", None)
    try:
        return tool_format_for_template(source) or "hermes"
    except ValueError as error:
        raise ValueError(f"agent.tool_format: {error}") from None
