"""The Llama 3.x JSON and Mistral call formats: the texts each family's models write,
checked against hand-written strings (the shapes vLLM's `llama3_json` and `mistral`
parsers read); every malformed call is a `MalformedCall` in its place; hostile turns of
every format cost linear time."""

from __future__ import annotations

import json

import pytest

from rlax_data.envs import (
    BracketToolFormat,
    HermesToolFormat,
    Llama3JsonToolFormat,
    MalformedCall,
    MistralToolFormat,
    ToolCall,
    ToolFormat,
    ToolResult,
    make_tool_format,
)

CALL = ToolCall("calculator", {"expression": "4821*397"})
CODE = ToolCall("python", {"code": "a = [1, 2]; print(a, '{;,]')"})  # separators inside strings


def only_malformed(fmt: ToolFormat, turn: str) -> str:
    parsed = fmt.parse(turn)
    assert len(parsed) == 1 and isinstance(parsed[0], MalformedCall), parsed
    return parsed[0].reason


# -- Llama 3.x JSON --------------------------------------------------------------------------


def test_llama_writes_and_reads_calls():
    fmt = Llama3JsonToolFormat(max_calls=4)
    assert isinstance(fmt, ToolFormat) and fmt.call_stop == "" and fmt.special_markers == ("<|python_tag|>",)
    text = '{"name": "calculator", "parameters": {"expression": "4821*397"}}'
    assert fmt.render_call(CALL) == text
    assert fmt.parse(text) == [CALL]
    assert fmt.parse("  \n" + text + "\n") == [CALL]
    # The tag the model may write first (a special token the codec keeps), and text before it.
    assert fmt.parse("<|python_tag|>" + text) == [CALL]
    assert fmt.parse("Let me compute. <|python_tag|> " + text) == [CALL]
    # "arguments", as other families write it, is read too.
    assert fmt.parse('{"name": "calculator", "arguments": {"expression": "4821*397"}}') == [CALL]
    # Several calls, separated by ';' (not the ones inside strings); a trailing ';' is fine.
    both = fmt.render_calls([CALL, CODE])
    assert both == text + "; " + json.dumps({"name": "python", "parameters": CODE.arguments})
    assert fmt.parse(both) == [CALL, CODE]
    assert fmt.parse(both + ";") == [CALL, CODE]
    unicode = ToolCall("python", {"code": "print('é ✓')", "n": [1, {"k": None}]})
    assert fmt.parse(fmt.render_call(unicode)) == [unicode]


def test_llama_results_are_the_text_the_ipython_message_holds():
    fmt = Llama3JsonToolFormat()
    assert fmt.render_result(ToolResult(text="1913937", ok=True)) == "1913937"
    failed = ToolResult(text="Error: calculator: division by zero", ok=False, error="bad_arguments")
    assert fmt.render_result(failed) == "Error: calculator: division by zero"


@pytest.mark.parametrize(
    "turn", ["The answer is 42.", "", "  ", 'I would call {"name": "calculator"}', "[1, 2]"]
)
def test_llama_turn_without_a_call_is_a_final_answer(turn):
    assert Llama3JsonToolFormat().parse(turn) == []


@pytest.mark.parametrize(
    ("turn", "message"),
    [
        ('{"name": "c", "parameters": {}', "not valid JSON"),
        ('{"name": "c", "parameters": {}} and then I wait', "not valid JSON"),
        ("<|python_tag|>print(1)", "not valid JSON"),
        ("<|python_tag|>  ", "<|python_tag|> without a call after it"),
        ('{"parameters": {}}', "name must be a non-empty string, got null or missing"),
        ('{"name": 3, "parameters": {}}', "name must be a non-empty string, got int"),
        ('{"name": "c"}', "parameters must be a JSON object, got null or missing"),
        ('{"name": "c", "parameters": "x=1"}', "parameters must be a JSON object, got a string"),
        ('{"name": "c", "arguments": [1]}', "arguments must be a JSON object, got an array"),
        ('{"name": "c", "parameters": {}, "arguments": {}}', "both parameters and arguments"),
        (
            '{"name": "c", "parameters": {}, "id": 1}',
            "unexpected keys ['id']; it takes only name and parameters",
        ),
        ('{"name": "c", "parameters": {"x": NaN}}', "NaN is not JSON"),
        ('{"name": "c", "parameters": {"x": Infinity}}', "Infinity is not JSON"),
    ],
)
def test_llama_malformed_calls_say_what_is_wrong(turn, message):
    assert message in only_malformed(Llama3JsonToolFormat(), turn)


def test_llama_reads_each_call_on_its_own():
    fmt = Llama3JsonToolFormat(max_calls=8)
    good, code = fmt.render_call(CALL), fmt.render_call(CODE)
    first, bad, last = fmt.parse(f"{good}; {{not json}}; {code}")
    assert (first, last) == (CALL, CODE)
    assert isinstance(bad, MalformedCall) and "not valid JSON" in bad.reason
    assert fmt.parse(f"{good};; {good}") == [CALL, MalformedCall("an empty call between ';'"), CALL]
    # An unterminated string swallows what follows it: one malformed call, the ones before still read.
    first, bad = fmt.parse(f'{good}; {{"name": "c", "parameters": {{"s": "open; still open')
    assert first == CALL and isinstance(bad, MalformedCall) and "not valid JSON" in bad.reason


# -- Mistral ---------------------------------------------------------------------------------


def test_mistral_writes_and_reads_calls():
    fmt = MistralToolFormat(max_calls=4)
    assert isinstance(fmt, ToolFormat) and fmt.call_stop == "" and fmt.special_markers == ("[TOOL_CALLS]",)
    text = '[TOOL_CALLS][{"name": "calculator", "arguments": {"expression": "4821*397"}}]'
    assert fmt.render_call(CALL) == text
    assert fmt.parse(text) == [CALL]
    # The v3 tokenizers' space after the token, text before it, and a call id (ignored).
    spaced = (
        '[TOOL_CALLS] [{"name": "calculator", "arguments": {"expression": "4821*397"}, "id": "a1b2c3d4e"}]'
    )
    assert fmt.parse("Let me compute.\n" + spaced + "\n") == [CALL]
    both = fmt.render_calls([CALL, CODE])
    assert both == "[TOOL_CALLS]" + json.dumps([
        {"name": "calculator", "arguments": CALL.arguments}, {"name": "python", "arguments": CODE.arguments},
    ])  # fmt: skip
    assert fmt.parse(both) == [CALL, CODE]
    unicode = ToolCall("python", {"code": "print('é ✓')", "n": [1, {"k": None}]})
    assert fmt.parse(fmt.render_call(unicode)) == [unicode]


def test_mistral_results_are_the_text_between_the_result_tokens():
    # [TOOL_RESULTS] and [/TOOL_RESULTS] are special tokens: the chat template's framing,
    # never text a tool's output could forge.
    fmt = MistralToolFormat()
    assert fmt.render_result(ToolResult(text="1913937", ok=True)) == "1913937"
    failed = ToolResult(text="Error: calculator: division by zero", ok=False, error="bad_arguments")
    assert fmt.render_result(failed) == "Error: calculator: division by zero"


@pytest.mark.parametrize(
    "turn", ["The answer is 42.", "", '[{"name": "calculator", "arguments": {}}]', "[1, 2]"]
)
def test_mistral_turn_without_the_calls_token_is_a_final_answer(turn):
    assert MistralToolFormat().parse(turn) == []


@pytest.mark.parametrize(
    ("turn", "message"),
    [
        ("[TOOL_CALLS]", "[TOOL_CALLS] must be followed by a JSON list"),
        ('[TOOL_CALLS]{"name": "c", "arguments": {}}', "[TOOL_CALLS] must be followed by a JSON list"),
        ('[TOOL_CALLS][{"name": "c", "arguments": {}}', "not closed by ']', or text follows it"),
        ('[TOOL_CALLS][{"name": "c", "arguments": {}}] done', "not closed by ']', or text follows it"),
        ("[TOOL_CALLS][ ]", "the list of calls is empty"),
        ('[TOOL_CALLS][{"name": "c", "arguments": {}}][TOOL_CALLS][]', "[TOOL_CALLS] more than once"),
        ('[TOOL_CALLS][{"name": "c", "arguments": {}]', "not valid JSON"),
        ('[TOOL_CALLS]["calculator"]', "must be a JSON object"),
        ('[TOOL_CALLS][{"arguments": {}}]', "name must be a non-empty string, got null or missing"),
        ('[TOOL_CALLS][{"name": "c"}]', "arguments must be a JSON object, got null or missing"),
        ('[TOOL_CALLS][{"name": "c", "parameters": {}}]', "unexpected keys ['parameters']"),
        ('[TOOL_CALLS][{"name": "c", "arguments": {"x": NaN}}]', "NaN is not JSON"),
    ],
)
def test_mistral_malformed_calls_say_what_is_wrong(turn, message):
    assert message in only_malformed(MistralToolFormat(), turn)


def test_mistral_reads_each_call_of_the_list_on_its_own():
    fmt = MistralToolFormat(max_calls=8)
    good = json.dumps({"name": "calculator", "arguments": CALL.arguments})
    code = json.dumps({"name": "python", "arguments": CODE.arguments})
    first, bad, last = fmt.parse(f"[TOOL_CALLS][{good}, {{broken: 1}}, {code}]")
    assert (first, last) == (CALL, CODE)
    assert isinstance(bad, MalformedCall) and "not valid JSON" in bad.reason
    assert fmt.parse(f"[TOOL_CALLS][{good},, {good}]") == [
        CALL,
        MalformedCall("an empty element in the list of calls"),
        CALL,
    ]
    assert fmt.parse(f"[TOOL_CALLS][{good},]") == [
        CALL,
        MalformedCall("an empty element in the list of calls"),
    ]


# -- every format: size, depth, hostile text -------------------------------------------------

FORMATS = {
    "hermes": lambda payload: f"<tool_call>{payload}</tool_call>",
    "llama3_json": lambda payload: payload,
    "mistral": lambda payload: f"[TOOL_CALLS][{payload}]",
}


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_deep_nesting_is_refused_before_decoding(name):
    wrap = FORMATS[name]
    fmt = make_tool_format(name, max_call_chars=10**7)
    deeper = '{"name": "c", "arguments": {"x": ' + "[" * 200_000 + "]" * 200_000 + "}}"
    assert "nested deeper than 32 levels" in only_malformed(fmt, wrap(deeper))
    ok = '{"name": "c", "arguments": {"x": ' + "[" * 30 + "]" * 30 + ', "s": "[[[[\\\\"}}'
    assert fmt.parse(wrap(ok)) == [ToolCall("c", {"x": json.loads("[" * 30 + "]" * 30), "s": "[[[[\\"})]
    assert "nested deeper than 32 levels" in only_malformed(fmt, wrap(ok.replace("[", "[[", 1)))


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_an_oversized_call_is_refused_before_decoding(name, monkeypatch):
    wrap = FORMATS[name]
    huge = json.dumps({"name": "python", "arguments": {"code": "x" * 1_000_000}})

    def no_decoding(*args, **kwargs):
        raise AssertionError("json.loads must not see an oversized call")

    monkeypatch.setattr("rlax_data.envs.tool_formats.json_text.json.loads", no_decoding)
    assert "longer than 65536 characters" in only_malformed(make_tool_format(name), wrap(huge))
    # The limit is per call: a turn of several calls, each below it, decodes them all.
    monkeypatch.undo()
    fmt = make_tool_format(name, max_calls=2, max_call_chars=100)
    small = ToolCall("c", {"s": "x" * 50})
    assert fmt.parse(fmt.render_calls([small, small])) == [small, small]


HOSTILE = {
    "hermes": [
        "<tool_call>" * 200_000,
        "</tool_call>" * 200_000 + "<tool_call>",
        "<tool_call>{}</tool_call>" * 50_000,
        "<tool_call>" + '"' + "\\" * 1_000_000 + "</tool_call>",
    ],
    "llama3_json": [
        "{" + ";" * 200_000,
        "{" * 1_000_000,
        '{"' + "\\" * 1_000_000,
        "<|python_tag|>" + "; {" * 100_000,
    ],
    "mistral": [
        "[TOOL_CALLS][" + "," * 200_000 + "]",
        "[TOOL_CALLS][" + "[" * 1_000_000 + "]",
        "[TOOL_CALLS]" * 200_000,
    ],
    "bracket": ["[" * 1_000_000, "]" * 1_000_000, "[" + "1" * 1_000_000 + "]"],
}


@pytest.mark.timeout(120)  # quadratic work on these turns would take hours
@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_turns_cost_linear_time(name):
    fmt = make_tool_format(name)
    for turn in HOSTILE[name]:
        parsed = fmt.parse(turn)
        assert parsed and all(isinstance(p, MalformedCall) for p in parsed), (name, turn[:40], parsed[:3])


def test_every_format_follows_the_protocol():
    for fmt in (
        HermesToolFormat(),
        BracketToolFormat(),
        Llama3JsonToolFormat(),
        MistralToolFormat(),
    ):
        assert isinstance(fmt, ToolFormat) and fmt.max_calls == 1
        prompt = fmt.tools_prompt([{"type": "function", "function": {"name": "calculator"}}])
        assert prompt  # every format can tell a template-less chat model how to call
