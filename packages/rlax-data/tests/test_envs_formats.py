"""Tool-call formats (Hermes and the tiny model's brackets; Llama and Mistral are in
test_envs_formats_llama_mistral.py): the texts a model writes and reads, checked against
hand-written strings; every malformed call is a `MalformedCall` in its place, at bounded
cost."""

from __future__ import annotations

import json

import pytest

from rlax_data.envs import (
    BracketToolFormat,
    HermesToolFormat,
    MalformedCall,
    ToolCall,
    ToolFormat,
    ToolResult,
    make_tool_format,
    tool_format_names,
)

CALL = ToolCall("calculator", {"expression": "4821*397"})


def malformed(fmt: ToolFormat, turn: str) -> str:
    """The reason of the one malformed call `fmt` reads in `turn`."""
    parsed = fmt.parse(turn)
    assert len(parsed) == 1 and isinstance(parsed[0], MalformedCall), parsed
    return parsed[0].reason


# -- Hermes ----------------------------------------------------------------------------------


def test_hermes_writes_and_reads_a_call():
    fmt = HermesToolFormat()
    assert isinstance(fmt, ToolFormat) and fmt.call_stop == "</tool_call>"
    text = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "4821*397"}}\n</tool_call>'
    assert fmt.render_call(CALL) == text
    assert fmt.parse(text) == [CALL]
    assert fmt.parse("I should compute it.\n" + text + "\n") == [CALL]
    assert fmt.parse('<tool_call>{"arguments":{"code":"print(1)"},"name":"python"}</tool_call>') == [
        ToolCall("python", {"code": "print(1)"})
    ]
    unicode = ToolCall("python", {"code": "print('é ✓')", "n": [1, {"k": None}]})
    assert fmt.parse(fmt.render_call(unicode)) == [unicode]
    assert "é ✓" in fmt.render_call(unicode)


def test_hermes_renders_results():
    fmt = HermesToolFormat()
    assert fmt.render_result(ToolResult(text="1913937", ok=True)) == "1913937"
    failed = ToolResult(text="Error: calculator: division by zero", ok=False, error="bad_arguments")
    assert fmt.render_result(failed) == "Error: calculator: division by zero"


@pytest.mark.parametrize("turn", ["The answer is 42.", "", "I could use a <tool_response> tag", "tool_call"])
def test_hermes_turn_without_a_call_is_a_final_answer(turn):
    assert HermesToolFormat().parse(turn) == []


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
        ('{"name": "c", "arguments": {}}</tool_call>', "</tool_call> without <tool_call>"),
        ("<tool_call><tool_call>{}</tool_call>", "<tool_call> inside a call"),
    ],
)
def test_hermes_malformed_calls_say_what_is_wrong(turn, message):
    assert message in malformed(HermesToolFormat(), turn)


def test_hermes_reads_several_calls_in_order_and_each_fault_in_its_place():
    fmt = HermesToolFormat(max_calls=4)
    a, b = ToolCall("calculator", {"expression": "1+1"}), ToolCall("python", {"code": "print(2)"})
    assert fmt.parse(fmt.render_calls([a, b, a])) == [a, b, a]
    assert fmt.render_calls([a, b]) == fmt.render_call(a) + "\n" + fmt.render_call(b)
    good = fmt.render_call(a)
    # A garbled call among good ones: the good ones are still read, the fault stands where it was.
    (first, bad, last) = fmt.parse(good + "\n<tool_call>{nope}</tool_call>\n" + fmt.render_call(b))
    assert (first, last) == (a, b)
    assert isinstance(bad, MalformedCall) and "not valid JSON" in bad.reason
    # Stray text between or after calls, an unclosed last call, a close before the first open.
    between = MalformedCall("text between calls: only whitespace may separate </tool_call> and <tool_call>")
    assert fmt.parse(good + " so then " + good) == [a, between, a]
    assert fmt.parse(good + " and more") == [
        a,
        MalformedCall("text after </tool_call>: end the turn after the calls"),
    ]
    assert fmt.parse(good + "<tool_call>") == [a, MalformedCall("<tool_call> is not closed by </tool_call>")]
    assert fmt.parse("</tool_call>" + good) == [MalformedCall("</tool_call> before <tool_call>"), a]


def test_hermes_stops_after_one_call_only_when_a_turn_holds_one():
    assert HermesToolFormat().call_stop == "</tool_call>"
    # A turn stopped after its first call could never hold a second: the end-of-turn token ends it.
    assert HermesToolFormat(max_calls=2).call_stop == ""
    with pytest.raises(ValueError, match="max_calls must be an integer >= 1, got 0"):
        HermesToolFormat(max_calls=0)


def test_hermes_deep_nesting_is_refused():
    deep = '{"name": "c", "arguments": {"x": ' + "[" * 1000 + "]" * 1000 + "}}"
    assert "nested deeper than 32 levels" in malformed(HermesToolFormat(), f"<tool_call>{deep}</tool_call>")
    # Far deeper than the JSON decoder's own recursion limit: refused before decoding.
    deeper = '{"name": "c", "arguments": {"x": ' + "[" * 200_000 + "]" * 200_000 + "}}"
    fmt = HermesToolFormat(max_call_chars=10**7)
    assert "nested deeper than 32 levels" in malformed(fmt, f"<tool_call>{deeper}</tool_call>")
    # 32 levels in all, and brackets inside strings (escaped quotes too) do not count.
    ok = '{"name": "c", "arguments": {"x": ' + "[" * 30 + "]" * 30 + ', "s": "\\"[[[[\\\\"}}'
    assert HermesToolFormat().parse(f"<tool_call>{ok}</tool_call>") == [
        ToolCall("c", {"x": json.loads("[" * 30 + "]" * 30), "s": '"[[[[\\'})
    ]
    too_deep = f"<tool_call>{ok.replace('[', '[[', 1)}</tool_call>"
    assert "nested deeper than 32 levels" in malformed(HermesToolFormat(), too_deep)


def test_hermes_huge_call_is_refused_before_decoding(monkeypatch):
    huge = json.dumps({"name": "python", "arguments": {"code": "x" * 1_000_000}})

    def no_decoding(*args, **kwargs):
        raise AssertionError("json.loads must not see an oversized call")

    monkeypatch.setattr("rlax_data.envs.tool_formats.json_text.json.loads", no_decoding)
    assert "longer than 65536 characters" in malformed(HermesToolFormat(), f"<tool_call>{huge}</tool_call>")


# -- brackets --------------------------------------------------------------------------------


def test_bracket_writes_and_reads_a_call():
    fmt = BracketToolFormat()
    assert isinstance(fmt, ToolFormat) and fmt.call_stop == "]"
    assert fmt.render_call(CALL) == fmt.render_calls([CALL]) == "[4821*397]"
    assert fmt.parse("[4821*397]") == [CALL]
    assert fmt.parse("12[3+4]") == [ToolCall("calculator", {"expression": "3+4"})]
    custom = BracketToolFormat("python", "code")
    assert custom.parse("[print(1)]") == [ToolCall("python", {"code": "print(1)"})]
    # One call per turn: the turn stops at "]".
    with pytest.raises(ValueError, match="max_calls must be 1, got 2"):
        BracketToolFormat(max_calls=2)
    with pytest.raises(ValueError, match="a turn holds one call, got 2"):
        fmt.render_calls([CALL, CALL])


def test_bracket_renders_results_in_the_small_alphabet():
    fmt = BracketToolFormat()
    assert fmt.render_result(ToolResult(text="1913937", ok=True)) == "(1913937)"
    for kind in ("malformed", "unknown_tool", "bad_arguments", "crash", "timeout", "too_large"):
        assert fmt.render_result(ToolResult(text="Error: long message", ok=False, error=kind)) == "(?)"


@pytest.mark.parametrize("turn", ["1913937", "", "12+3"])
def test_bracket_turn_without_brackets_is_a_final_answer(turn):
    assert BracketToolFormat().parse(turn) == []


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
    assert message in malformed(BracketToolFormat(), turn)


def test_bracket_refuses_to_write_calls_it_cannot_express():
    fmt = BracketToolFormat()
    with pytest.raises(ValueError, match="can only write calls of 'calculator'"):
        fmt.render_call(ToolCall("python", {"code": "1"}))
    with pytest.raises(ValueError, match="can only write calls"):
        fmt.render_call(ToolCall("calculator", {"expression": "1", "x": "2"}))
    with pytest.raises(ValueError, match="without brackets"):
        fmt.render_call(ToolCall("calculator", {"expression": "a]b"}))


def test_formats_by_name():
    assert tool_format_names() == ["bracket", "hermes", "llama3_json", "mistral"]
    assert isinstance(make_tool_format("hermes"), HermesToolFormat)
    assert make_tool_format("hermes", max_calls=3).max_calls == 3
    assert make_tool_format("bracket", default_tool="python", argument="code").parse("[1]") == [
        ToolCall("python", {"code": "1"})
    ]
    with pytest.raises(
        ValueError, match=r"'xml' is not one of \['bracket', 'hermes', 'llama3_json', 'mistral'\]"
    ):
        make_tool_format("xml")
