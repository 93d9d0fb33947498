"""Multi-turn trajectories as token ids: how the run's model sees an environment's turns.

The worker's agent loop (`rlax_inference.agent_loop`) works on token ids; this is where
text meets tokens, on every node alike (worker, trainer for SFT demonstrations, controller
for scoring):

- a model turn's text is what the environment parses;
- an environment turn is the observation wrapped as the chat template wraps a `tool`
  message, closing the model's turn first (a turn that stopped on a tool call's stop
  string has not written its end-of-turn token yet). For a model without a chat template
  (the character-level tiny model) it is the observation's characters alone. The
  template's framing is encoded with its special tokens; the observation is plain text
  (`special_tokens=False`): a tool that prints `<|im_end|>` or `<eos>` gets the ordinary
  tokens that spell it, so it cannot end its message, forge an assistant turn or end the
  sequence;
- the verifier scores a trajectory's last model turn (its final answer).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import msgspec

from rlax_data.datasets import Record

__all__ = ["AgentTurns", "last_model_turn"]

_MODEL_MARK, _TOOL_MARK = "\x00MODEL\x00", "\x00TOOL\x00"


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
    tool_format: "bracket" or "hermes"; max_result_chars, tool_timeout_s: the environments'
    tool limits; service_address: step the trajectories' environments in the verifier
    service there (`rlax_data.envs.remote`; empty: in this process).
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        chat: bool,
        tool_format: str,
        max_result_chars: int = 4096,
        tool_timeout_s: float = 10.0,
        service_address: str = "",
    ) -> None:
        from rlax_data.envs import BracketToolFormat, HermesToolFormat

        formats = {"bracket": BracketToolFormat, "hermes": HermesToolFormat}
        if tool_format not in formats:
            raise ValueError(f"agent.tool_format = {tool_format!r}: must be one of {sorted(formats)}")
        self.tokenizer = tokenizer
        self.chat = chat
        self.format = formats[tool_format]()
        self.max_result_chars = max_result_chars
        self.tool_timeout_s = tool_timeout_s
        self._wrap = self._chat_wrapping() if chat else ("", "", "")
        self._framing: dict[bool, tuple[list[int], list[int]]] = {}
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
                format=tool_format, max_result_chars=max_result_chars, tool_timeout_s=tool_timeout_s
            )
            self.remote = RemoteEnvironments(service_address, options=options, timeout_s=tool_timeout_s)

    # -- environments ------------------------------------------------------------------
    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.format.call_stop,)

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
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=True))

    @property
    def max_token_chars(self) -> int:
        """The most characters of an observation one token stands for (the agent loop
        refuses a longer observation than the tokens left allow without tokenizing it)."""
        return int(self.tokenizer.max_token_chars)

    def env_turn_ids(self, observation: str, *, after_end_of_turn: bool) -> list[int]:
        """The environment turn's token ids: the template's framing (special tokens) around
        the observation encoded as plain text. An observation the tokenizer cannot spell (a
        character outside the tiny model's alphabet) is shown as the format's failed result."""
        opening, closing = self._framing_ids(after_end_of_turn)
        try:
            text = self.tokenizer.encode(observation, special_tokens=False)
        except TypeError:  # a tokenizer without `special_tokens=`: a bug to surface, not to hide
            raise
        except Exception:  # the tokenizer's own error type differs between tokenizers
            from rlax_data.envs import ToolResult

            failed = self.format.render_result(ToolResult(text="", ok=False, error="malformed"))
            text = self.tokenizer.encode(failed, special_tokens=False)
        return [*opening, *text, *closing]

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

    def prompt_ids(self, text: str, tools: list[dict[str, Any]]) -> list[int]:
        """A chat model's first prompt: the user's `text`, and the `tools` it may call. A
        template that renders `tools=` itself gets them so; one that ignores them (SmolLM2's)
        gets them in a system message, in the Hermes wording the call format expects."""
        messages: list[dict[str, Any]] = [{"role": "user", "content": text}]
        plain = self.tokenizer.render_chat(messages)
        if not tools or self.tokenizer.render_chat(messages, tools=tools) != plain:
            return list(self.tokenizer.apply_chat_template(messages, tools=tools))
        system = (
            "You may call one or more functions to assist with the user query. The functions "
            f"you may call are listed in <tools></tools>:\n<tools>\n{json.dumps(tools)}\n</tools>\n"
            "For a call, reply with a JSON object naming the function and its arguments within "
            '<tool_call></tool_call> tags: <tool_call>{"name": <function-name>, "arguments": '
            "<args-json-object>}</tool_call>. Its result comes back in <tool_response></tool_response> tags."
        )
        return list(self.tokenizer.apply_chat_template([{"role": "system", "content": system}, *messages]))

    def demonstration(self, segments: Sequence[tuple[str, bool]]) -> tuple[list[int], list[int]]:
        """(token ids, model mask) of a demonstrated trajectory given as (text, is model turn)
        segments; the end-of-sequence token follows the last model turn."""
        ids: list[int] = []
        mask: list[int] = []
        for text, is_model in segments:
            piece = (
                list(self.tokenizer.encode(text))
                if is_model
                else self.env_turn_ids(text, after_end_of_turn=False)
            )
            ids += piece
            mask += [int(is_model)] * len(piece)
        ids.append(int(self.tokenizer.eos_id))
        mask.append(1)
        return ids, mask

    def _chat_wrapping(self) -> tuple[str, str, str]:
        """(what closes a model turn, what opens a tool message, what closes it and opens the
        next model turn), read off the chat template by rendering a conversation with and
        without a tool message."""
        user = {"role": "user", "content": "u"}
        model = {"role": "assistant", "content": _MODEL_MARK}
        tool = {"role": "tool", "content": _TOOL_MARK}
        try:
            without = self.tokenizer.render_chat([user, model], add_generation_prompt=False)
            with_tool = self.tokenizer.render_chat([user, model, tool], add_generation_prompt=True)
        except Exception as error:
            raise ValueError(f"the chat template cannot render a tool message: {error}") from None
        if not with_tool.startswith(without) or _TOOL_MARK not in with_tool:
            raise ValueError("the chat template renders a tool message by changing the turns before it")
        close = without[without.index(_MODEL_MARK) + len(_MODEL_MARK) :]
        before, after = with_tool[len(without) :].split(_TOOL_MARK, 1)
        return close, before, after
