"""What a wire ``Grammar`` means: its source turned into an llguidance grammar, and whether that compiles.

Shared by the frontend (which refuses a grammar that does not compile, with the reason) and rank 0 (which
builds a matcher from it); neither torch nor a tokenizer is needed here.
"""

from __future__ import annotations

import json

from llmbus.bus.messages import Grammar

# llguidance's JSON options unless a schema's own "x-guidance" says otherwise: the separators of Python's
# json.dumps and no free whitespace, so a small model cannot spin in indentation, and outputs look like
# the JSON models were trained on.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def llguidance_grammar(grammar: Grammar) -> str:
    """The llguidance grammar (its JSON serialisation) for a wire ``Grammar``; raises ValueError for an
    unknown kind or a schema that is not a JSON object. Compilation errors show only when a matcher is
    built (``grammar_error``)."""
    import llguidance

    if grammar.kind == "json_schema":
        schema = json.loads(grammar.source)
        if not isinstance(schema, dict):
            raise ValueError("a JSON schema must be a JSON object")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if grammar.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(grammar.source)
    if grammar.kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(grammar.source)
    raise ValueError(f"unknown grammar kind {grammar.kind!r}")


def grammar_error(grammar: Grammar, tokenizer=None) -> str | None:
    """Why ``grammar`` cannot be used (llguidance's message), or None when it compiles. With the
    tokenizer, special tokens named in a Lark grammar are checked too."""
    import llguidance

    try:
        serialised = llguidance_grammar(grammar)
    except ValueError as e:
        return str(e)
    message = llguidance.LLMatcher.validate_grammar(serialised, tokenizer)
    return message or None
