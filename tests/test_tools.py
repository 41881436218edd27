"""jaxkv.serving.tools: a chat template's tool call format, and the calls parsed out of an answer in Qwen3's
(hermes) and Llama-3's (llama3_json) formats, as they stream (the text held back while it may start a call)."""

import json

import pytest

from jaxkv.serving import tools

HERMES_CALL = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'


def test_a_template_s_format_is_read_from_its_source():
  assert tools.template_format("{% for m in messages %}{{ m['content'] }}{% endfor %}") is None
  assert tools.template_format("{% if tools %}<tool_call>{% endif %}") == "hermes"
  assert tools.template_format('{% if tools %}{"name": function name, "parameters": ...}{% endif %}') == "llama3_json"


@pytest.mark.parametrize(
    "fmt, text, content, calls",
    [
        ("hermes", "Let me check. " + HERMES_CALL, "Let me check.", [("f", {"a": 1})]),
        ("hermes", HERMES_CALL + "\n" + HERMES_CALL.replace('"f"', '"g"'), "", [("f", {"a": 1}), ("g", {"a": 1})]),
        ("hermes", '<tool_call>{"name": "f", "arguments": {}}', "", [("f", {})]),  # Cut at its end.
        ("hermes", "<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
        ("hermes", "No call.", "No call.", []),
        ("llama3_json", '{"name": "f", "parameters": {"a": 1}}', "", [("f", {"a": 1})]),
        (
            "llama3_json",
            '<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"b": "x"}}',
            "",
            [("f", {}), ("g", {"b": "x"})],
        ),
        ("llama3_json", '{"a": 1}', '{"a": 1}', []),
        ("llama3_json", "It is 4.", "It is 4.", []),
    ],
)
def test_calls_are_parsed_and_anything_else_is_content(fmt, text, content, calls):
  got_content, got = tools.parse(fmt, text)
  assert got_content == content and [(c.name, json.loads(c.arguments)) for c in got] == calls
  shaped = [c.openai(i) for i, c in enumerate(got)]
  assert [s["index"] for s in shaped] == list(range(len(calls))) and all(s["type"] == "function" for s in shaped)


@pytest.mark.parametrize(
    "fmt, text, final, sendable",
    [
        ("hermes", "Sure <tool_", False, "Sure "),  # A possible start of a call is held.
        ("hermes", "Sure <tool_", True, "Sure <tool_"),
        ("hermes", "Sure " + HERMES_CALL, False, "Sure "),
        ("hermes", "a < b", False, "a < b"),
        ("llama3_json", ' {"na', False, ""),
        ("llama3_json", "<|pyth", False, ""),
        ("llama3_json", "  ", False, ""),
        ("llama3_json", "It", False, "It"),
    ],
)
def test_a_stream_holds_back_what_may_start_a_call(fmt, text, final, sendable):
  assert text[: tools.content_length(fmt, text, final)] == sendable
