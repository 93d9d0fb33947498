"""Tool-call formats: the texts a model writes and reads, checked against hand-written
strings; every malformed call is a `ToolCallError` at bounded cost."""

from __future__ import annotations

import json

import pytest

from rlax_data.envs import (
    BracketToolFormat,
    HermesToolFormat,
    ToolCall,
    ToolCallError,
    ToolFormat,
    ToolResult,
    make_tool_format,
    tool_format_names,
)

CALL = ToolCall("calculator", {"expression": "4821*397"})


# -- Hermes ----------------------------------------------------------------------------------


def test_hermes_writes_and_reads_a_call():
    fmt = HermesToolFormat()
    assert isinstance(fmt, ToolFormat) and fmt.call_stop == "</tool_call>"
    text = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "4821*397"}}\n</tool_call>'
    assert fmt.render_call(CALL) == text
    assert fmt.parse(text) == CALL
    assert fmt.parse("I should compute it.\n" + text + "\n") == CALL
    assert fmt.parse('<tool_call>{"arguments":{"code":"print(1)"},"name":"python"}</tool_call>') == ToolCall(
        "python", {"code": "print(1)"}
    )
    unicode = ToolCall("python", {"code": "print('é ✓')", "n": [1, {"k": None}]})
    assert fmt.parse(fmt.render_call(unicode)) == unicode
    assert "é ✓" in fmt.render_call(unicode)


def test_hermes_renders_results():
    fmt = HermesToolFormat()
    assert (
        fmt.render_result(ToolResult(text="1913937", ok=True)) == "<tool_response>\n1913937\n</tool_response>"
    )
    failed = ToolResult(text="Error: calculator: division by zero", ok=False, error="bad_arguments")
    assert (
        fmt.render_result(failed) == "<tool_response>\nError: calculator: division by zero\n</tool_response>"
    )


@pytest.mark.parametrize("turn", ["The answer is 42.", "", "I could use a <tool_response> tag", "tool_call"])
def test_hermes_turn_without_a_call_is_a_final_answer(turn):
    assert HermesToolFormat().parse(turn) is None


@pytest.mark.parametrize(
    ("turn", "message"),
    [
        ("<tool_call>{name: calculator}</tool_call>", "not valid JSON"),
        ('<tool_call>{"name": "calculator", "arguments": {}</tool_call>', "not valid JSON"),
        ("<tool_call></tool_call>", "not valid JSON"),
        ('<tool_call>{"arguments": {}}</tool_call>', "name must be a non-empty string, got null or missing"),
        ('<tool_call>{"name": "", "arguments": {}}</tool_call>', "name must be a non-empty string"),
        ('<tool_call>{"name": 7, "arguments": {}}</tool_call>', "name must be a non-empty string, got int"),
        (
            '<tool_call>{"name": "calculator"}</tool_call>',
            "arguments must be a JSON object, got null or missing",
        ),
        (
            '<tool_call>{"name": "c", "arguments": "{\\"a\\": 1}"}</tool_call>',
            "arguments must be a JSON object, got a string",
        ),
        (
            '<tool_call>{"name": "c", "arguments": [1]}</tool_call>',
            "arguments must be a JSON object, got an array",
        ),
        ('<tool_call>{"name": "c", "arguments": {}, "id": 1}</tool_call>', "unexpected keys ['id']"),
        ('<tool_call>["calculator", {}]</tool_call>', "must be a JSON object"),
        ('<tool_call>{"name": "c", "arguments": {"x": NaN}}</tool_call>', "NaN is not JSON"),
        ('<tool_call>{"name": "c", "arguments": {"x": ' + "9" * 5000 + "}}</tool_call>", "not valid JSON"),
        ('<tool_call>{"name": "c", "arguments": {}}', "is not closed by </tool_call>"),
        ('<tool_call>{"name": "c", "arguments": {}}</tool_call> and more', "text after </tool_call>"),
        ('<tool_call>{"name": "c", "arguments": {}}</tool_call><tool_call>', "text after </tool_call>"),
        ('{"name": "c", "arguments": {}}</tool_call>', "</tool_call> without <tool_call>"),
        (
            '</tool_call><tool_call>{"name": "c", "arguments": {}}</tool_call>',
            "</tool_call> before <tool_call>",
        ),
        ("<tool_call><tool_call>{}</tool_call>", "<tool_call> inside a call"),
    ],
)
def test_hermes_malformed_calls_say_what_is_wrong(turn, message):
    with pytest.raises(ToolCallError) as caught:
        HermesToolFormat().parse(turn)
    assert message in str(caught.value)


def test_hermes_deep_nesting_is_refused():
    deep = '{"name": "c", "arguments": {"x": ' + "[" * 1000 + "]" * 1000 + "}}"
    with pytest.raises(ToolCallError, match="nested deeper than 32 levels"):
        HermesToolFormat().parse(f"<tool_call>{deep}</tool_call>")
    # Far deeper than the JSON decoder's own recursion limit: refused before decoding.
    deeper = '{"name": "c", "arguments": {"x": ' + "[" * 200_000 + "]" * 200_000 + "}}"
    with pytest.raises(ToolCallError, match="nested deeper than 32 levels"):
        HermesToolFormat(max_call_chars=10**7).parse(f"<tool_call>{deeper}</tool_call>")
    # 32 levels in all, and brackets inside strings (escaped quotes too) do not count.
    ok = '{"name": "c", "arguments": {"x": ' + "[" * 30 + "]" * 30 + ', "s": "\\"[[[[\\\\"}}'
    assert HermesToolFormat().parse(f"<tool_call>{ok}</tool_call>") == ToolCall(
        "c", {"x": json.loads("[" * 30 + "]" * 30), "s": '"[[[[\\'}
    )
    with pytest.raises(ToolCallError, match="nested deeper than 32 levels"):
        HermesToolFormat().parse(f"<tool_call>{ok.replace('[', '[[', 1)}</tool_call>")


def test_hermes_huge_call_is_refused_before_decoding(monkeypatch):
    huge = json.dumps({"name": "python", "arguments": {"code": "x" * 1_000_000}})

    def no_decoding(*args, **kwargs):
        raise AssertionError("json.loads must not see an oversized call")

    monkeypatch.setattr("rlax_data.envs.formats.json.loads", no_decoding)
    with pytest.raises(ToolCallError, match="longer than 65536 characters"):
        HermesToolFormat().parse(f"<tool_call>{huge}</tool_call>")


# -- brackets --------------------------------------------------------------------------------


def test_bracket_writes_and_reads_a_call():
    fmt = BracketToolFormat()
    assert isinstance(fmt, ToolFormat) and fmt.call_stop == "]"
    assert fmt.render_call(CALL) == "[4821*397]"
    assert fmt.parse("[4821*397]") == CALL
    assert fmt.parse("12[3+4]") == ToolCall("calculator", {"expression": "3+4"})
    custom = BracketToolFormat("python", "code")
    assert custom.parse("[print(1)]") == ToolCall("python", {"code": "print(1)"})


def test_bracket_renders_results_in_the_small_alphabet():
    fmt = BracketToolFormat()
    assert fmt.render_result(ToolResult(text="1913937", ok=True)) == "(1913937)"
    for kind in ("malformed", "unknown_tool", "bad_arguments", "crash", "timeout", "too_large"):
        assert fmt.render_result(ToolResult(text="Error: long message", ok=False, error=kind)) == "(?)"


@pytest.mark.parametrize("turn", ["1913937", "", "12+3"])
def test_bracket_turn_without_brackets_is_a_final_answer(turn):
    assert BracketToolFormat().parse(turn) is None


@pytest.mark.parametrize(
    ("turn", "message"),
    [
        ("[12*3", "'[' is not closed by ']'"),
        ("12]", "']' without '['"),
        ("][1]", "']' before '['"),
        ("[1[2]]", "nested '['"),
        ("[[1]", "nested '['"),
        ("[1]2", "text after ']'"),
        ("[1] ", "text after ']'"),
        ("[]", "empty call '[]'"),
        ("[" + "1" * 257 + "]", "longer than 256 characters"),
    ],
)
def test_bracket_malformed_calls_say_what_is_wrong(turn, message):
    with pytest.raises(ToolCallError) as caught:
        BracketToolFormat().parse(turn)
    assert message in str(caught.value)


def test_bracket_refuses_to_write_calls_it_cannot_express():
    fmt = BracketToolFormat()
    with pytest.raises(ValueError, match="can only write calls of 'calculator'"):
        fmt.render_call(ToolCall("python", {"code": "1"}))
    with pytest.raises(ValueError, match="can only write calls"):
        fmt.render_call(ToolCall("calculator", {"expression": "1", "x": "2"}))
    with pytest.raises(ValueError, match="without brackets"):
        fmt.render_call(ToolCall("calculator", {"expression": "a]b"}))


def test_formats_by_name():
    assert tool_format_names() == ["bracket", "hermes"]
    assert isinstance(make_tool_format("hermes"), HermesToolFormat)
    assert make_tool_format("bracket", default_tool="python", argument="code").parse("[1]") == ToolCall(
        "python", {"code": "1"}
    )
    with pytest.raises(ValueError, match=r"'xml' is not one of \['bracket', 'hermes'\]"):
        make_tool_format("xml")
