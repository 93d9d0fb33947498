"""How trajectories become token ids: environment turns for the tiny model and for a chat
model (SmolLM2's template), SFT demonstrations with their masks, the final answer."""

from __future__ import annotations

import msgspec
import pytest

from rlax_core.tokenizer import CharTokenizer
from rlax_data.agent_turns import AgentTurns, last_model_turn
from rlax_data.tasks import ToolArithmeticTask

TASK = ToolArithmeticTask()


def tiny_turns() -> AgentTurns:
    return AgentTurns(CharTokenizer(TASK.format.alphabet), chat=False, tool_format="bracket")


def test_last_model_turn_is_the_final_answer():
    #          model turn 1   env        model turn 2
    tokens = (5, 6, 7, 8, 20, 21, 22, 9, 10, 11)
    assert last_model_turn(tokens, (1, 1, 1, 1, 0, 0, 0, 1, 1, 1)) == (9, 10, 11)
    assert last_model_turn(tokens, ()) == tokens  # single-turn: the whole completion
    # A trajectory cut off after an environment turn: the last turn the model wrote.
    assert last_model_turn((5, 6, 20, 21), (1, 1, 0, 0)) == (5, 6)
    assert last_model_turn((20, 21), (0, 0)) == ()


def test_tiny_model_environment_turns_and_an_unspellable_observation():
    turns = tiny_turns()
    tok = turns.tokenizer
    assert turns.stop_strings == ("]",)
    assert turns.env_turn_ids("(5535)", after_end_of_turn=False) == tok.encode("(5535)")
    # "e" is not in the alphabet: the model sees the format's failed result instead.
    assert turns.env_turn_ids("(error)", after_end_of_turn=False) == tok.encode("(?)")
    assert turns.turn_text(tok.encode("[123*45]")) == "[123*45]"


def test_demonstration_masks_exactly_the_environment_turn():
    turns = tiny_turns()
    tok = turns.tokenizer
    record = next(r for r in TASK.generate(64, seed=0) if TASK.uses_tool_in_demonstration(r))
    expression, answer = record.metadata["expression"], record.answer
    ids, mask = turns.demonstration(TASK.demonstration(record, use_tool=True, tool_format=turns.format))
    call, result = f"[{expression}]", f"({answer})"
    assert ids == tok.encode(call + result + answer) + [tok.eos_id]
    assert mask == [1] * len(call) + [0] * len(result) + [1] * (len(answer) + 1)
    direct_ids, direct_mask = turns.demonstration(TASK.demonstration(record, use_tool=False))
    assert direct_ids == tok.encode(answer) + [tok.eos_id] and direct_mask == [1] * (len(answer) + 1)


def test_environment_for_a_record_and_refusals():
    turns = tiny_turns()
    record = TASK.generate(1, seed=0)[0]
    env = turns.new_environment("calculator", msgspec.json.encode(record).decode())
    step = env.step(f"[{record.metadata['expression']}]")
    assert (step.observation, step.done, step.tool_calls, step.tool_errors) == (
        f"({record.answer})",
        False,
        1,
        0,
    )
    assert env.step(record.answer).done
    with pytest.raises(ValueError, match="not one of"):
        turns.new_environment("no-such-env", msgspec.json.encode(record).decode())
    with pytest.raises(ValueError, match="agent.record"):
        turns.new_environment("calculator", '{"id": 1')
    with pytest.raises(ValueError, match="agent.tool_format"):
        AgentTurns(turns.tokenizer, chat=False, tool_format="xml")


def test_chat_model_environment_turn_follows_the_template(smollm2_tokenizer):
    turns = AgentTurns(smollm2_tokenizer, chat=True, tool_format="hermes")
    tok = smollm2_tokenizer
    # SmolLM2's template, written out by hand: the model's turn is closed, a tool message
    # holds the observation, and a new assistant turn opens.
    expected = "<|im_end|>\n<|im_start|>tool\nOBS<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(turns.env_turn_ids("OBS", after_end_of_turn=False)) == expected
    # A turn that already ended with <|im_end|> is not closed twice.
    assert tok.decode(turns.env_turn_ids("OBS", after_end_of_turn=True)) == expected[len("<|im_end|>") :]
    assert turns.stop_strings == ("</tool_call>",)


def test_chat_prompt_lists_the_tools_when_the_template_ignores_them(smollm2_tokenizer):
    turns = AgentTurns(smollm2_tokenizer, chat=True, tool_format="hermes")
    schema = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
    text = smollm2_tokenizer.decode(turns.prompt_ids("What is 3*4?", schema))
    assert text.startswith("<|im_start|>system\nYou may call one or more functions")
    assert '"name": "calculator"' in text and "<tool_call>" in text
    assert text.endswith("<|im_start|>user\nWhat is 3*4?<|im_end|>\n<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from rlax_core.gguf_file import find_smollm2_gguf
    from rlax_core.tokenizer import Tokenizer

    return Tokenizer.from_gguf(find_smollm2_gguf())
