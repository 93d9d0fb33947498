"""The run's task as the controller and trainer see it: records from `rlax_data`, token
ids from the model's tokenizer, a verifier, evaluation prompts and SFT examples.

Both the controller and the trainer build it from the same config, so the training
prompts, evaluation prompts and SFT targets are identical in every process.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rlax_core.config import RunConfig

if TYPE_CHECKING:
    from rlax_data.agent_turns import AgentTurns

__all__ = ["PromptItem", "RunTask", "build_task", "build_tokenizer"]


@dataclasses.dataclass(frozen=True)
class PromptItem:
    """One prompt of the stream, tokenized: `record` is what the verifier needs (reference
    answer...). The controller's scheduler groups and dispatches these."""

    prompt_id: str
    prompt_token_ids: tuple[int, ...]
    record: Any = None


EVAL_SEED_OFFSET = 1_000_003  # evaluation records come from a seed no training record uses


def model_path(config: RunConfig) -> pathlib.Path:
    if config.model.source == "gguf" and not config.model.path:
        from rlax_core.gguf_file import find_smollm2_gguf

        return find_smollm2_gguf()
    return pathlib.Path(config.model.path)


def build_tokenizer(config: RunConfig, alphabet: str) -> Any:
    """The run's tokenizer: a character tokenizer over the task's alphabet for `tiny`."""
    from rlax_core.tokenizer import CharTokenizer, Tokenizer

    if config.model.source == "tiny":
        return CharTokenizer(alphabet)
    if config.model.source == "gguf":
        return Tokenizer.from_gguf(model_path(config))
    return Tokenizer.from_pretrained(model_path(config))


def _make_task(config: RunConfig) -> Any:
    from rlax_data.tasks import TASK_NAMES, make_task

    data = config.data
    if data.task not in TASK_NAMES:
        raise ValueError(f"data.task = {data.task!r}: must be one of {sorted(TASK_NAMES)}")
    return make_task(data.task, data.difficulty, data.task_args, source="data.task_args")


class _StreamAdapter:
    """`rlax_data.PromptStream` as the scheduler's `PromptSource` (records -> token ids)."""

    def __init__(self, stream: Any, encode: Any) -> None:
        self.stream = stream
        self.encode = encode

    def next_prompt(self) -> PromptItem:
        record = next(self.stream)
        return PromptItem(record.id, tuple(self.encode(record)), record=record)

    def state_dict(self) -> dict[str, Any]:
        return dict(self.stream.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stream.load_state_dict(state)


@dataclasses.dataclass
class RunTask:
    config: RunConfig
    task: Any
    tokenizer: Any
    verifier: Any
    _agent_turns: Any = dataclasses.field(default=None, repr=False)

    @property
    def chat(self) -> bool:
        return self.config.model.source != "tiny"

    def encode_prompt(self, record: Any) -> list[int]:
        if self.config.agent.enabled:
            # The environment's first observation, and for a chat model the tools it offers.
            turns: AgentTurns = self.agent_turns()
            env = turns.environment(self.config.agent.environment)
            text = env.reset(record)
            if self.chat:
                schema = env.tools_schema() if hasattr(env, "tools_schema") else []
                # A task may show a worked example conversation first, in the run's format.
                examples = getattr(self.task, "example_messages", None)
                return turns.prompt_ids(text, schema, examples=examples(turns.format) if examples else ())
            return list(self.tokenizer.encode(text, add_bos=True))
        return self.encode_text(record.prompt_text())

    def encode_text(self, text: str) -> list[int]:
        """Prompt token ids: BOS + characters for the tiny model, the chat template otherwise."""
        if self.chat:
            return list(self.tokenizer.apply_chat_template([{"role": "user", "content": text}]))
        return list(self.tokenizer.encode(text, add_bos=True))

    def target_ids(self, record: Any) -> list[int]:
        """The SFT target: the reference answer then end-of-sequence."""
        answer = self.task.format.answer_template.format(answer=record.answer)
        return list(self.tokenizer.encode(answer)) + [self.tokenizer.eos_id]

    def sft_example(self, record: Any) -> tuple[list[int], list[int]]:
        """(completion ids, model mask) the SFT warm start trains on: the reference answer, or
        for a multi-turn task its demonstrated trajectory (environment turns masked out)."""
        if self.config.agent.enabled and hasattr(self.task, "demonstration"):
            turns: AgentTurns = self.agent_turns()
            segments = self.task.demonstration(
                record, use_tool=self.task.uses_tool_in_demonstration(record), tool_format=turns.format
            )
            return turns.demonstration(segments)
        target = self.target_ids(record)
        return target, [1] * len(target)

    def agent_turns(self) -> Any:
        """The run's `rlax_data.agent_turns.AgentTurns` (None for single-turn runs)."""
        agent = self.config.agent
        if not agent.enabled:
            return None
        if self._agent_turns is None:
            from rlax_data.agent_turns import AgentTurns

            self._agent_turns = AgentTurns(
                self.tokenizer,
                chat=self.chat,
                tool_format=agent.tool_format,  # "": the chat template's own format (AgentTurns)
                max_calls_per_turn=agent.max_calls_per_turn,
                tool_timeout_s=agent.tool_timeout_s,
                service_address=self.config.verifier.address if agent.where == "service" else "",
            )
        return self._agent_turns

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return (int(self.tokenizer.eos_id),)

    def train_records(self) -> list[Any]:
        if self.config.data.dataset:
            from rlax_data import load_dataset

            return list(load_dataset(self.config.data.dataset))
        return list(self.task.generate(self.config.data.num_train, seed=self.config.data.seed))

    def prompt_source(self) -> _StreamAdapter:
        from rlax_data import PromptStream, StreamSource

        stream = PromptStream([StreamSource("train", self.train_records())], seed=self.config.data.seed)
        return _StreamAdapter(stream, self.encode_prompt)

    def eval_records(self) -> list[Any]:
        n = self.config.eval.num_prompts
        return list(self.task.generate(n, seed=self.config.data.seed + EVAL_SEED_OFFSET)) if n else []

    def eval_items(self) -> list[PromptItem]:
        return [PromptItem(r.id, tuple(self.encode_prompt(r)), record=r) for r in self.eval_records()]

    def decode(self, token_ids: Sequence[int]) -> str:
        ids = list(token_ids)
        eos = self.tokenizer.eos_id
        if eos in ids:
            ids = ids[: ids.index(eos)]
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def score(self, item: PromptItem, completions: Sequence[tuple[int, ...]]) -> list[tuple[float, bool]]:
        """`RolloutScorer`: verify every completion of one prompt in one batched call (of a
        multi-turn trajectory: its last model turn, `rlax_data.agent_turns.last_model_turn`)."""
        results = self.verifier.verify([(self.decode(c), item.record) for c in completions])
        return [(float(r.reward), bool(r.correct)) for r in results]


def build_task(config: RunConfig) -> RunTask:
    task = _make_task(config)
    tokenizer = build_tokenizer(config, task.format.alphabet)
    return RunTask(config=config, task=task, tokenizer=tokenizer, verifier=task.verifier())
