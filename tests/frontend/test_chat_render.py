"""The frontend's chat-template renderer (frontend/chat_render.py) against transformers' ``render_jinja_template``,
called as the frontend called it before it had its own: the same text for every template the test models
carry and for hand-written ones that use what Hub templates use, over conversations with system prompts,
turns, tools and their results, reasoning under each of its names, content parts with images, non-ASCII
text, a continued final message, with and without the generation prompt and with the special tokens and
request variables; the same failures (raise_exception's message word for word). Then values no JSON body
holds, the sandbox, the frontend's template errors, and a frontend process that never imports
transformers."""

from __future__ import annotations

import copy
import dataclasses
import enum
import json
import subprocess
import sys
from pathlib import Path, PurePosixPath

import jinja2
import numpy
import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from llmbus.frontend.chat import ChatTemplate
from llmbus.frontend.chat_render import render_chat
from llmbus.frontend.errors import ApiError
from llmbus.supervisor import demo_model
from llmbus.testing import gemma3_vl, llava, qwen2_vl
from llmbus.testing.chat_formats import TEMPLATES

FIXTURE_CONFIG = Path(__file__).parent.parent / "fixtures" / "tokenizer_config.json"

# namespace() set in loops, loop.index0 / loop.last, `is defined`, whitespace control, trim and string methods,
# content parts, and each name a message's reasoning is read by
LOOPS = """\
{%- set ns = namespace(system='', last_user=-1, turns=0) -%}
{%- if messages[0]['role'] == 'system' -%}
  {%- set ns.system = messages[0]['content'] | trim -%}
{%- endif -%}
{%- for m in messages -%}
  {%- if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% set ns.turns = ns.turns + 1 %}{% endif -%}
{%- endfor -%}
{{- bos_token if bos_token is defined else '' -}}
{%- if ns.system %}[SYS {{ ns.system.upper() }}]
{% endif -%}
{%- for m in messages if m.role != 'system' -%}
<{{ m.role }}{% if loop.index0 == ns.last_user %} last-user{% endif %}>
  {%- if m.content is string -%}
    {%- if m.content.startswith('/') %}command: {{ m.content.split(' ')[0][1:] }}
    {%- else %}{{ m.content.strip() }}{% endif -%}
  {%- elif m.content is none %}(no content)
  {%- else -%}
    {%- for part in m.content %}{% if part.type == 'text' %}{{ part.text }}{% else %}<{{ part.type }}>{% endif %}
    {%- endfor -%}
  {%- endif -%}
  {%- if m.reasoning_content is defined %} (rc: {{ m.reasoning_content }}){% endif -%}
  {%- if m.thinking is defined %} (th: {{ m.thinking }}){% endif -%}
  {%- if m.reasoning is defined %} (r: {{ m.reasoning }}){% endif %}
  {%- if not loop.last %}

{% endif -%}
{%- endfor %}
{% if add_generation_prompt %}<assistant>{% endif %}
turns={{ ns.turns }} thinking={{ enable_thinking | default('unset') }}
"""

# tojson's options and non-ASCII, a dict's items, dictsort, defaults
JSON = """\
{% if tools %}
  {% for t in tools %}
{{ t | tojson(indent=4) }}
{{ t | tojson(sort_keys=true) }}
{{ t.function | tojson(separators=(',', ':')) }}
    {% for k, v in t.function.parameters.properties.items() %}{{ k }}={{ v | tojson }};{% endfor %}

    {% for k, v in t.function.parameters.properties | dictsort %}{{ k }} {% endfor %}

  {% endfor %}
{% endif %}
{% for m in messages %}
{{ m.role }}: {{ m.content | tojson }}
  {% if m.tool_calls %}
    {% for c in m.tool_calls %} call {{ c.function.name }}({{ c.function.arguments | tojson(ensure_ascii=true) }})
    {% endfor %}
  {% endif %}
{% endfor %}
{{ custom_flag | default('no-flag') }}{{ eos_token | default('') }}
"""

# raise_exception with the template's message: no system prompt, and roles that alternate
RAISES = """\
{%- if messages[0].role == 'system' %}{{ raise_exception('System messages are not supported by this template.') }}
{%- endif -%}
{%- for m in messages -%}
  {%- if (m.role == 'user') != (loop.index0 % 2 == 0) -%}
    {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
  {%- endif -%}
[{{ m.role }}] {{ m.content }}
{% endfor -%}
{%- if add_generation_prompt %}[assistant] {% endif -%}
"""

# {% generation %}, {% break %} / {% continue %}, strftime_now, the dict global
GENERATION = """\
Today: {{ strftime_now('%d %b %Y') }}
{% set meta = dict(b='x', a=1) %}{{ meta | dictsort }} {{ dict.fromkeys(['k'], 0) }}
documents: {{ documents is defined }} {{ documents is none }}; tools: {{ tools is none }}
{% for m in messages %}
  {% if m.role == 'system' %}{% continue %}{% endif %}
  {% if m.role == 'tool' %}{% break %}{% endif %}
  {% if m.role == 'assistant' %}
{% generation %}<a>{{ m.content }}</a>{% endgeneration %}
  {% else %}
<u>{{ m.content }}</u>
  {% endif %}
{% endfor %}
{% if add_generation_prompt %}<a>{% endif %}
"""

# trims every message: a continued message's trailing space goes, and the prompt ends where its text does
TRIMS = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content | trim }}<|end|>{% endfor %}"
         "{% if add_generation_prompt %}<|assistant|>{% endif %}")

# drops a final assistant message: continuing it fails
DROPS_FINAL = ("{% for m in messages %}{% if not (loop.last and m.role == 'assistant') %}{{ m.role }}: "
               "{{ m.content }}\n{% endif %}{% endfor %}")

# never reads `content`: continuing fails
ROLES_ONLY = "{% for m in messages %}{{ m['role'] }};{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"

SOURCES = {
    **{f"family-{name}": source for name, source in TEMPLATES.items()},
    "demo": demo_model.CHAT_TEMPLATE,
    "llava": llava.CHAT_TEMPLATE,
    "qwen2_vl": qwen2_vl.CHAT_TEMPLATE,
    "gemma3_vl": gemma3_vl.CHAT_TEMPLATE,
    "fixture": json.loads(FIXTURE_CONFIG.read_text())["chat_template"],
    "loops": LOOPS, "json": JSON, "raises": RAISES, "generation": GENERATION, "trims": TRIMS,
    "drops-final": DROPS_FINAL, "roles-only": ROLES_ONLY,
}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Le temps qu'il fait à un endroit — 天気",
    "parameters": {"type": "object", "properties": {"location": {"type": "string"},
                                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["location"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "Time in a zone.",
                                          "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}}
TOOLS = [WEATHER, CLOCK]

SYSTEM = {"role": "system", "content": "  You are terse.  \n"}
USER = {"role": "user", "content": "Hello there"}
CALLS = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"location": "Köln"}}},
    {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": {"tz": "CET"}}}]}
PARTS = [{"type": "text", "text": "What is in "}, {"type": "image"}, {"type": "text", "text": " this picture?"}]

CONVERSATIONS = {
    "user": [USER],
    "system-user": [SYSTEM, USER],
    "turns": [SYSTEM, USER, {"role": "assistant", "content": "Hi! "}, {"role": "user", "content": "/weather in Paris"}],
    "tools": [USER, CALLS, {"role": "tool", "tool_call_id": "call_1", "content": "18°C, sunny"},
              {"role": "tool", "tool_call_id": "call_2", "content": "14:05"}],
    "tools-answered": [USER, CALLS, {"role": "tool", "tool_call_id": "call_1", "content": "18°C"},
                       {"role": "assistant", "content": "It is 18°C."}, {"role": "user", "content": "Thanks"}],
    # each name a reasoning comes under, one that is None, and two names that disagree
    "reasoning": [USER, {"role": "assistant", "content": "a1", "reasoning_content": "r1"}, USER,
                  {"role": "assistant", "content": "a2", "reasoning": "r2"}, USER,
                  {"role": "assistant", "content": "a3", "thinking": "r3"}, USER,
                  {"role": "assistant", "content": "a4", "reasoning_content": None, "reasoning": "r4"}, USER,
                  {"role": "assistant", "content": "a5", "reasoning_content": "r5", "thinking": "t5"}, USER],
    "parts": [{"role": "user", "content": PARTS}, {"role": "assistant", "content": "A cat."},
              {"role": "user", "content": [{"type": "text", "text": "And this? "}, {"type": "image"}]}],
    "non-ascii": [{"role": "user", "content": 'Grüße aus Köln — 東京 ✓ "quoted" <b>&amp;</b>\n\tend'}],
    # continued: the final assistant message as text, with a trailing space, empty, as parts, with reasoning
    "continue": [USER, {"role": "assistant", "content": "Sure, here is"}],
    "continue-space": [SYSTEM, USER, {"role": "assistant", "content": "The answer is "}],
    "continue-empty": [USER, {"role": "assistant", "content": ""}],
    "continue-parts": [{"role": "user", "content": PARTS}, {"role": "assistant", "content": [
        {"type": "text", "text": "Two: "}, {"type": "image"}, {"type": "text", "text": "I see "}, {"type": "image"}]}],
    "continue-reasoning": [USER, {"role": "assistant", "content": "So", "reasoning_content": "think"}],
    # nothing to continue: no content, no text part
    "continue-calls": [USER, CALLS],
    "continue-no-text": [USER, {"role": "assistant", "content": [{"type": "image"}]}],
}

VARIABLES = [
    {},
    {"bos_token": "<s>", "eos_token": "</s>"},
    {"bos_token": "<s>", "eos_token": "</s>", "enable_thinking": False},
    {"custom_flag": "on ✓", "enable_thinking": True, "open_thinking": True},
]


# why a final message cannot be continued: transformers' words, then ours
CONTINUE_FAILURES = {"the conversation is empty": "the conversation is empty",
                     'has no "content" to continue': "has no content to continue",
                     "not an accepted field": "never reads `content`",
                     "could not find any text": "it has no text part",
                     "does not appear in the chat": "does not write it as it is"}


def outcome(render):
    try:
        return render()
    except Exception as e:  # noqa: BLE001 - a failure is compared with the other renderer's
        return e


def check_same(source: str, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool,
               continue_final: bool, variables: dict) -> str | Exception:
    """Ours against transformers' (a copy of the inputs each: ours must leave the caller's as they were)."""
    given = copy.deepcopy((messages, tools, variables))
    theirs = outcome(lambda: render_jinja_template(
        [copy.deepcopy(messages)], tools=copy.deepcopy(tools), chat_template=source,
        add_generation_prompt=add_generation_prompt, continue_final_message=continue_final,
        **copy.deepcopy(variables))[0][0])
    ours = outcome(lambda: render_chat(source, messages, tools, add_generation_prompt=add_generation_prompt,
                                       continue_final_message=continue_final, variables=variables))
    assert (messages, tools, variables) == given
    if isinstance(theirs, str):
        assert ours == theirs
    else:
        assert isinstance(ours, Exception), f"transformers raised {theirs!r}, ours rendered {ours!r}"
        assert type(ours) is type(theirs), (ours, theirs)
        if isinstance(theirs, ValueError):  # the same reason, in our words
            assert [ours_ for theirs_, ours_ in CONTINUE_FAILURES.items() if theirs_ in str(theirs)] == \
                [ours_ for ours_ in CONTINUE_FAILURES.values() if ours_ in str(ours)], (ours, theirs)
        elif not isinstance(theirs, jinja2.exceptions.SecurityError):  # (a namespace's refusal: our words)
            assert str(ours) == str(theirs)
    return theirs


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("name", SOURCES)
def test_renders_as_transformers(name, conversation):
    source, messages = SOURCES[name], CONVERSATIONS[conversation]
    tools = TOOLS if conversation.startswith("tools") else None
    settings = [(True, False), (False, False)]
    if messages[-1]["role"] == "assistant":
        settings += [(False, True), (True, True)]  # the frontend continues a final assistant message
    for add_generation_prompt, continue_final in settings:
        for variables in VARIABLES:
            check_same(source, messages, tools, add_generation_prompt, continue_final, variables)


def test_the_matrix_holds_renderings_and_failures():
    """The comparison above is not all failures: most cases render, and each kind of failure is there."""
    results = []
    for source in SOURCES.values():
        for messages in CONVERSATIONS.values():
            results.append(check_same(source, messages, None, False, messages[-1]["role"] == "assistant",
                                      VARIABLES[1]))
    failures = [r for r in results if isinstance(r, Exception)]
    assert len(failures) < len(results) / 3
    assert any("roles must alternate" in str(f) for f in failures)  # raise_exception
    reasons = {reason for reason in CONTINUE_FAILURES if any(reason in str(f) for f in failures)}
    assert reasons == set(CONTINUE_FAILURES) - {"the conversation is empty"}  # (the frontend never continues one)


class Unit(str, enum.Enum):
    CELSIUS = "celsius"


@dataclasses.dataclass
class Place:
    name: str
    unit: Unit


def test_values_reach_the_template_as_plain_data():
    """What no JSON body holds, as transformers hands it over: a str enum as its value, a numpy scalar as a
    number, a dataclass as its fields, a tuple as a tuple, anything else as its type's name."""
    source = "{% for k, v in values | dictsort %}{{ k }}={{ v }} {{ v is string }} {{ v | tojson }};{% endfor %}"
    values = {"enum": Unit.CELSIUS, "numpy": numpy.int64(3), "numpy_bool": numpy.bool_(False),
              "place": Place("Köln", Unit.CELSIUS), "tuple": (1, [2]), "other": PurePosixPath("/x")}
    assert check_same(source, [USER], None, True, False, {"values": values}) == (
        'enum=celsius True "celsius";numpy=3 False 3;numpy_bool=False False false;'
        'other=<PurePosixPath> True "<PurePosixPath>";'
        """place={'name': 'Köln', 'unit': 'celsius'} False {"name": "Köln", "unit": "celsius"};"""
        "tuple=(1, [2]) False [1, [2]];")


@pytest.mark.parametrize("source", [
    "{{ ''.__class__.__mro__ }}",
    "{{ (messages | first).__class__.__base__.__subclasses__() }}",
    "{{ messages.__class__ }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ raise_exception.__globals__ }}",
    "{{ dict.__call__.__globals__ }}",
    "{{ namespace.__init__.__globals__ }}",
    "{% set ns = namespace() %}{% set ns.__class__ = 1 %}{{ ns }}",
    "{% set ns = namespace(_hidden=1) %}{{ ns._hidden }}",
    "{% set ns = namespace(a=1) %}{{ ns.__dict__ }}{{ ns.__class__.__init__ }}",
    "{{ messages.append(1) }}",
    "{% set d = dict(a=1) %}{{ d.update(b=2) }}",
])
def test_the_sandbox_refuses_what_transformers_refuses(source):
    """Python's internals and changes to values: an error, or nothing shown (an unsafe attribute is undefined)."""
    result = check_same(source, [USER], None, True, False, {})
    assert result == "" or isinstance(result, jinja2.exceptions.SecurityError)


def test_a_templates_failures_are_template_errors(tmp_path):
    """What a request sees: raise_exception's message, and a final message the template drops."""
    (tmp_path / "chat_template.jinja").write_text(RAISES)
    template = ChatTemplate(tmp_path)
    with pytest.raises(ApiError, match=r"^Template error: System messages are not supported by this template\.$"):
        template.render([SYSTEM, USER])
    (tmp_path / "chat_template.jinja").write_text(DROPS_FINAL)
    with pytest.raises(ApiError, match="^Template error: the final message cannot be continued"):
        ChatTemplate(tmp_path).render([USER, {"role": "assistant", "content": "Sure"}])
    # a template that does not compile: the start goes on, each request is told
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }")
    broken = ChatTemplate(tmp_path)
    broken.load()
    with pytest.raises(ApiError, match="^Template error: unexpected '}'$"):
        broken.render([USER])


def test_the_frontend_never_imports_transformers(tmp_path):
    (tmp_path / "chat_template.jinja").write_text(TEMPLATES["qwen3"])
    script = (
        "import sys\n"
        "import llmbus.frontend.__main__  # the frontend process's entry\n"
        "from llmbus.frontend.chat import ChatTemplate\n"
        "template = ChatTemplate(sys.argv[1])\n"
        "template.load()\n"
        "print(template.render([{'role': 'user', 'content': 'hi'}], None, {'enable_thinking': False}), end='')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'torch')), end='')\n")
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True,
                         check=True).stdout
    assert out == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n[]"
