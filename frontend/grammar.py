"""Grammars in requests: TGI's ``grammar`` parameter and OpenAI's ``response_format``, checked and turned into
the wire's ``Grammar`` (bus/messages.py) that rank 0 constrains sampling with.

TGI's shapes (router/src/lib.rs ``GrammarType``, checked in validation.rs): ``{"type": "json" |
"json_object", "value": <schema, or the schema as a JSON string>}``, ``{"type": "json_schema", "value":
{"name"?, "schema"}}`` and ``{"type": "regex", "value": "..."}``. OpenAI's ``response_format``: ``{"type":
"text"}`` (nothing), ``{"type": "json_object"}`` (any JSON object) and ``{"type": "json_schema",
"json_schema": {"name", "schema"?, "strict"?}}``; TGI's ``value`` shapes are accepted there too. vLLM's
parameters, which its users send in the OpenAI SDK's ``extra_body``: ``guided_json``, ``guided_regex``,
``guided_choice`` and ``guided_grammar``, or their newer form ``structured_outputs: {json | regex | choice |
grammar | json_object}`` (``vllm_grammar``).

Errors carry TGI's texts: "grammar is not supported" (turned off with ``--disable-grammar-support``, or a
JSON value that is neither an object nor a string), "grammar is not valid: <why>" (a schema that is not a
valid Draft 2020-12 schema, a JSON string that does not parse, a regex that does not compile) and "cannot
compile regex from schema: <why>" (a valid schema the grammar compiler refuses). Unlike TGI, a schema
needs no top-level ``properties``: arrays, enums and scalars are fine (TGI refused them because it went
through a regex its Python shards could build). Compile checks are cached per distinct grammar.
"""

from __future__ import annotations

import functools
import json
import re

# Imported with the frontend, not in the first request that needs them, whose streams the import would stall
# (design notes, "Every service starts at once").
import jsonschema
import llguidance  # noqa: F401

from llmbus.bus.grammar import grammar_error
from llmbus.bus.messages import Grammar
from llmbus.frontend.errors import body_type_error, validation_error
from llmbus.frontend.strict_schema import strict_schema

ANY_JSON_OBJECT = {"type": "object"}
GRAMMAR_TYPES = ("json", "json_object", "regex", "json_schema", "lark", "ebnf")


def _not_supported():
    return validation_error("grammar is not supported")


def _invalid(why: str, param: str | None = None):
    return validation_error(f"grammar is not valid: {why}", param=param)


@functools.lru_cache(maxsize=512)
def compile_error(kind: str, source: str) -> str | None:
    """Why a grammar of ``kind`` does not compile, or None; cached, as clients resend the same schemas and
    tool sets turn after turn."""
    return grammar_error(Grammar(kind, source))


@functools.lru_cache(maxsize=512)
def _meta_schema_error(source: str) -> str | None:
    try:
        jsonschema.Draft202012Validator.check_schema(json.loads(source))
    except jsonschema.SchemaError as e:
        return e.message
    except RecursionError:  # jsonschema walks a schema recursively: ~100 levels exhaust Python's stack
        return "the schema nests too deeply"
    return None


def json_schema_grammar(schema, param: str | None = None, *, strict: bool = False) -> Grammar:
    """The grammar of outputs that are JSON documents valid under ``schema`` (a dict, as TGI wants it);
    ``strict``: only what the schema declares (frontend/strict_schema.py)."""
    if not isinstance(schema, dict):
        raise _not_supported()
    source = json.dumps(schema, sort_keys=False, separators=(",", ":"))
    why = _meta_schema_error(source)  # the client's schema as written is what must be valid
    if why is not None:
        raise _invalid(why, param)
    if strict:
        source = json.dumps(strict_schema(schema), sort_keys=False, separators=(",", ":"))
    why = compile_error("json_schema", source)
    if why is not None:
        raise validation_error(f"cannot compile regex from schema: {why}", param=param)
    return Grammar("json_schema", source)


def regex_grammar(regex, param: str | None = None) -> Grammar:
    """The grammar of outputs that ``regex`` matches whole."""
    if not isinstance(regex, str):
        raise _not_supported()
    why = compile_error("regex", regex)
    if why is not None:
        raise _invalid(why, param)
    return Grammar("regex", regex)


def lark_grammar(source, param: str | None = None, *, gbnf: bool = False) -> Grammar:
    """The grammar of outputs a context-free grammar derives: llguidance's Lark, or GBNF (``gbnf``)."""
    if not isinstance(source, str):
        raise _not_supported()
    if gbnf:
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            source = gbnf_to_lark(source)
        except Exception as e:  # noqa: BLE001 - the translator raises assorted types for bad input
            raise _invalid(str(e) or type(e).__name__, param) from None
    why = compile_error("lark", source)
    if why is not None:
        raise _invalid(why, param)
    return Grammar("lark", source)


def choice_grammar(choices, param: str | None = None) -> Grammar:
    """The grammar of outputs that are exactly one of ``choices`` (vLLM's ``guided_choice``): a Lark rule of
    string literals, each written as a JSON string (the literal syntax llguidance's Lark reads)."""
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise validation_error(f"`{param}` must be a non-empty array of non-empty strings", param=param)
    # json.dumps leaves DEL and the C1 controls as they are, which Lark's lexer refuses: escaped like the rest
    literals = (_C1.sub(lambda m: f"\\u{ord(m.group()):04x}", json.dumps(c, ensure_ascii=False)) for c in choices)
    return lark_grammar("start: " + " | ".join(literals), param)


_C1 = re.compile("[\x7f-\x9f]")


# vLLM's structured-output parameters: the older top-level names, and the keys of ``structured_outputs``
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_STRUCTURED_OUTPUTS = ("json", "regex", "choice", "grammar", "json_object")
# vLLM's options of its guided decoding that choose how it compiles, which llguidance replaces here: no-ops
_GUIDED_OPTIONS = ("guided_decoding_backend", "disable_fallback", "backend")
# and those that change the output, refused by name when set (an answer must not silently differ from what the
# option promises)
_GUIDED_OUTPUT_OPTIONS = ("guided_whitespace_pattern", "whitespace_pattern", "disable_any_whitespace",
                          "disable_additional_properties")


def vllm_grammar(body: dict, *, enabled: bool, strict: bool = False) -> tuple[Grammar, str] | None:
    """vLLM's structured output in an OpenAI request body, as a wire Grammar and the parameter it came from;
    None when the body asks for none. ``guided_grammar`` is GBNF (vLLM's EBNF, what xgrammar reads) where its
    rules are written with ``::=``, else llguidance's Lark. Only one kind may be given, as in vLLM."""
    given = {name: body[name] for name in _GUIDED if body.get(name) is not None}
    option = next((k for k in _GUIDED_OUTPUT_OPTIONS if body.get(k) not in (None, False)), None)
    if option is not None:
        raise validation_error(f"`{option}` is not supported: llguidance's JSON whitespace and schemas are used "
                               f"as they are", param=option)
    outputs = body.get("structured_outputs")
    if outputs is not None:
        if not isinstance(outputs, dict):
            raise validation_error("`structured_outputs` must be an object", param="structured_outputs")
        unknown = sorted(k for k, v in outputs.items() if v not in (None, False)
                         and k not in _STRUCTURED_OUTPUTS and k not in _GUIDED_OPTIONS)
        if unknown:
            raise validation_error(f"`structured_outputs.{unknown[0]}` is not supported (served: "
                                   f"{', '.join(_STRUCTURED_OUTPUTS)})", param="structured_outputs")
        given |= {f"structured_outputs.{k}": v for k, v in outputs.items()
                  if k in _STRUCTURED_OUTPUTS and v not in (None, False)}
    if not given:
        return None
    if len(given) > 1:
        raise validation_error(f"only one kind of structured output may be given: {', '.join(sorted(given))}",
                               param=sorted(given)[0])
    ((name, value),) = given.items()
    if not enabled:
        raise validation_error("grammar is not supported", param=name)
    kind = _GUIDED.get(name, name.rpartition(".")[2])
    if kind == "json_object":
        return json_schema_grammar(ANY_JSON_OBJECT, name), name
    if kind == "json":
        schema = _schema_value(value, name)
        if not isinstance(schema, dict):
            raise validation_error(f"`{name}` must be a JSON Schema: an object, or a string holding one", param=name)
        return json_schema_grammar(schema, name, strict=strict), name
    if kind == "choice":
        return choice_grammar(value, name), name
    if not isinstance(value, str):  # a regex or a grammar
        raise validation_error(f"`{name}` must be a string", param=name)
    if kind == "regex":
        return regex_grammar(value, name), name
    # GBNF (vLLM's EBNF) or Lark: Lark first, and GBNF where Lark does not compile it and it has GBNF's rules
    gbnf = "::=" in value and compile_error("lark", value) is not None
    return lark_grammar(value, name, gbnf=gbnf), name


def _schema_value(value, param: str | None):
    """TGI's json value: a schema object, or a string holding one (parsed again, as TGI does)."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError as e:
            raise _invalid(str(e), param) from None
    return value


def tgi_grammar(value: dict, *, enabled: bool, param: str | None = None, strict: bool = False) -> Grammar:
    """TGI's ``parameters.grammar`` (already known to be a JSON object) as a wire Grammar."""
    kind = value.get("type")
    if kind not in GRAMMAR_TYPES:
        raise body_type_error(f"parameters.grammar: unknown variant `{kind}`, expected one of "
                              + ", ".join(f"`{t}`" for t in GRAMMAR_TYPES))
    if "value" not in value:
        raise body_type_error("parameters.grammar: missing field `value`")
    if not enabled:
        raise _not_supported()
    raw = value["value"]
    if kind == "regex":
        return regex_grammar(raw, param)
    if kind in ("lark", "ebnf"):
        return lark_grammar(raw, param, gbnf=kind == "ebnf")
    if kind == "json_schema":
        if not isinstance(raw, dict) or "schema" not in raw:
            raise body_type_error("parameters.grammar.value: missing field `schema`")
        return json_schema_grammar(_schema_value(raw["schema"], param), param, strict=strict)
    return json_schema_grammar(_schema_value(raw, param), param, strict=strict)


def response_format_grammar(value: dict, *, enabled: bool, strict: bool = False) -> Grammar | None:
    """OpenAI's ``response_format`` (or TGI's shapes of it) as a wire Grammar; None for plain text."""
    param = "response_format"
    kind = value.get("type")
    if kind in (None, "text"):
        return None
    if "value" in value:  # TGI's shape: {"type": ..., "value": ...}
        return tgi_grammar(value, enabled=enabled, param=param, strict=strict)
    if not enabled:
        raise validation_error("grammar is not supported", param=param)
    if kind in ("json_object", "json"):
        return json_schema_grammar(ANY_JSON_OBJECT, param)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise validation_error("`response_format.json_schema` must be an object with a `schema`", param=param)
        schema = spec.get("schema", ANY_JSON_OBJECT)
        if not isinstance(schema, dict):
            raise validation_error("`response_format.json_schema.schema` must be a JSON Schema object", param=param)
        return json_schema_grammar(schema, param, strict=strict)
    if kind in ("regex", "lark", "ebnf"):
        raise validation_error(f"`response_format` of type `{kind}` takes its grammar in `value`", param=param)
    raise validation_error(f"`response_format.type` must be `text`, `json_object` or `json_schema`. Given: "
                           f"{json.dumps(kind)}", param=param)
