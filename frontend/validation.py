"""Request bodies and TGI's validation rules, with TGI's exact messages and order.

``parse_request`` plays serde: the body must be JSON, ``inputs`` a string, every parameter of its Rust
type (unknown keys ignored). ``validate_parameters`` then applies router/src/validation.rs ``validate``
in its order, and ``validate_lengths`` the token-count checks that need the tokenized prompt.
"""

from __future__ import annotations

import json
import math
import random
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

from llmbus.bus.messages import Grammar, SamplingParams
from llmbus.frontend.config import Limits
from llmbus.frontend.errors import body_parse_error, body_type_error, validation_error
from llmbus.frontend.grammar import GRAMMAR_TYPES
from llmbus.frontend.grammar import tgi_grammar

_F32 = struct.Struct("<f")

# TGI schedules at most this many new tokens when the client sets none (validation.rs).
DEFAULT_GENERATION_LENGTH = 1024

I32_MAX = 2**31 - 1
_INT_RANGES = {"u32": (0, 2**32 - 1), "u64": (0, 2**64 - 1), "usize": (0, 2**64 - 1),
               "i32": (-(2**31), I32_MAX)}


@dataclass
class GenerateParameters:
    """TGI's GenerateParameters with its serde defaults (``parameters: {}``)."""

    best_of: int | None = None
    temperature: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    typical_p: float | None = None
    do_sample: bool = False
    max_new_tokens: int | None = None
    return_full_text: bool | None = None
    stop: list[str] = field(default_factory=list)
    truncate: int | None = None
    watermark: bool = False
    details: bool = False
    decoder_input_details: bool = False
    seed: int | None = None
    top_n_tokens: int | None = None
    grammar: dict | None = None
    adapter_id: str | None = None  # a LoRA adapter of --lora-adapters; None or "": the base model
    ignore_eos_token: bool = False  # benchmarks: only max_new_tokens ends the request (vLLM's TGI client sends it)
    presence_penalty: float | None = None  # OpenAI's, also accepted here (TGI has none): -2.0 to 2.0
    min_p: float | None = None  # llama.cpp's and vLLM's, also accepted here (TGI has none): 0.0 to 1.0
    # Not read from a body: the OpenAI routes' frequency_penalty follows OpenAI's formula (bus/messages.py)
    frequency_per_count: bool = field(default=False, metadata={"body": False})
    # Not read from a body: a grammar the OpenAI routes built already checked (response_format, tools)
    constraint: Grammar | None = field(default=None, metadata={"body": False})
    # Not read from a body: the OpenAI routes' ``model``, which selects a LoRA adapter where it names one
    model: str | None = field(default=None, metadata={"body": False})
    # Not read from a body: the OpenAI routes' ``logit_bias`` (TGI's parameters have none), token id -> bias
    logit_bias: dict[int, float] = field(default_factory=dict, metadata={"body": False})
    # Not read from a body: vLLM's stop_token_ids, min_tokens and include_stop_str_in_output on the OpenAI routes
    stop_token_ids: list[int] = field(default_factory=list, metadata={"body": False})
    min_new_tokens: int = field(default=0, metadata={"body": False})
    include_stop_str: bool = field(default=False, metadata={"body": False})


# field -> (serde type, nullable)
_PARAMETER_TYPES: dict[str, tuple[str, bool]] = {
    "best_of": ("usize", True), "temperature": ("f32", True), "repetition_penalty": ("f32", True),
    "frequency_penalty": ("f32", True), "top_k": ("i32", True), "top_p": ("f32", True),
    "typical_p": ("f32", True), "do_sample": ("bool", False), "max_new_tokens": ("u32", True),
    "return_full_text": ("bool", True), "stop": ("[string]", False), "truncate": ("usize", True),
    "watermark": ("bool", False), "details": ("bool", False), "decoder_input_details": ("bool", False),
    "seed": ("u64", True), "top_n_tokens": ("u32", True), "grammar": ("grammar", True),
    "adapter_id": ("string", True), "ignore_eos_token": ("bool", False), "presence_penalty": ("f32", True),
    "min_p": ("f32", True),
}


@dataclass
class GenerateRequest:
    inputs: str
    parameters: GenerateParameters
    stream: bool = False  # only read on POST /


def default_parameters() -> GenerateParameters:
    """What TGI uses when the body has no ``parameters`` key: note ``do_sample`` is true (a TGI quirk)."""
    return GenerateParameters(do_sample=True)


# ------------------------------------------------------------------------------------------------
# Body parsing (serde semantics)
# ------------------------------------------------------------------------------------------------


def to_f32(value) -> float | None:
    """``value`` rounded to the nearest f32, as TGI reads these fields (so 1e-45 is 0.0 and rejected
    where 0 is), or None when it does not fit in one."""
    try:
        rounded = _F32.unpack(_F32.pack(float(value)))[0]
    except OverflowError:
        return None
    return rounded if math.isfinite(rounded) else None


def _reject_constant(name: str):
    raise ValueError(f"invalid number `{name}`")


def _unexpected(value) -> str:
    """serde's description of a JSON value in 'invalid type' messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean `{'true' if value else 'false'}`"
    if isinstance(value, int):
        return f"integer `{value}`"
    if isinstance(value, float):
        return f"floating point `{value!r}`"
    if isinstance(value, str):
        return f"string {json.dumps(value, ensure_ascii=False)}"
    if isinstance(value, list):
        return "sequence"
    return "map"


def _convert(path: str, value, serde_type: str):
    """``value`` as ``serde_type``, or a body_type_error worded like serde_json's."""
    if serde_type == "bool":
        if isinstance(value, bool):
            return value
        raise body_type_error(f"{path}: invalid type: {_unexpected(value)}, expected a boolean")
    if serde_type == "string":
        if isinstance(value, str):
            return value
        raise body_type_error(f"{path}: invalid type: {_unexpected(value)}, expected a string")
    if serde_type == "f32":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            rounded = to_f32(value)
            if rounded is None:
                raise body_type_error(f"{path}: invalid value: {_unexpected(value)}, expected f32")
            return rounded
        raise body_type_error(f"{path}: invalid type: {_unexpected(value)}, expected f32")
    if serde_type in _INT_RANGES:
        if isinstance(value, int) and not isinstance(value, bool):
            lo, hi = _INT_RANGES[serde_type]
            if lo <= value <= hi:
                return value
            raise body_type_error(f"{path}: invalid value: integer `{value}`, expected {serde_type}")
        raise body_type_error(f"{path}: invalid type: {_unexpected(value)}, expected {serde_type}")
    if serde_type == "[string]":
        if not isinstance(value, list):
            raise body_type_error(f"{path}: invalid type: {_unexpected(value)}, expected a sequence")
        return [_convert(f"{path}[{i}]", v, "string") for i, v in enumerate(value)]
    if serde_type == "grammar":
        if not isinstance(value, dict):
            raise body_type_error(f"{path}: invalid type: {_unexpected(value)}, expected internally "
                                  f"tagged enum GrammarType")
        return _grammar_shape(path, value)
    raise AssertionError(serde_type)


def _grammar_shape(path: str, value: dict) -> dict:
    """serde's share of reading a GrammarType: a known ``type`` and a ``value`` (json_schema's with a
    ``schema``). Refused with the body, before any rule runs, so with an HTTP 422 on /generate_stream and
    /tokenize too (TGI's axum rejects the body); what the value holds is a rule, checked in TGI's order."""
    kind = value.get("type")
    if kind is None:
        raise body_type_error(f"{path}: missing field `type`")
    if kind not in GRAMMAR_TYPES:
        raise body_type_error(f"{path}: unknown variant `{kind}`, expected one of "
                              + ", ".join(f"`{t}`" for t in GRAMMAR_TYPES))
    if "value" not in value:
        raise body_type_error(f"{path}: missing field `value`")
    if kind == "json_schema" and not (isinstance(value["value"], dict) and "schema" in value["value"]):
        raise body_type_error(f"{path}.value: missing field `schema`")
    return value


def _parse_parameters(value) -> GenerateParameters:
    if not isinstance(value, dict):
        raise body_type_error(f"parameters: invalid type: {_unexpected(value)}, "
                              f"expected struct GenerateParameters")
    params = GenerateParameters()
    for name, (serde_type, nullable) in _PARAMETER_TYPES.items():
        if name not in value:
            continue
        raw = value[name]
        if raw is None and nullable:
            continue
        setattr(params, name, _convert(f"parameters.{name}", raw, serde_type))
    return params


def _lone_surrogate(value) -> str | None:
    """The first lone UTF-16 surrogate in ``value``'s strings (keys included), escaped; None if none.
    JSON's ``\\ud800`` escapes parse to such characters in Python, which no tokenizer or UTF-8 encoder
    takes; serde refuses them while parsing."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as e:
                return f"\\u{ord(item[e.start]):04x}"
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return None


def load_json(raw: bytes):
    """The JSON value of a body (NaN and Infinity refused, as serde does; so are lone surrogates), or a
    body_parse_error."""
    try:
        value = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except UnicodeDecodeError as e:
        raise body_parse_error(f"invalid UTF-8 at byte {e.start}") from None
    except json.JSONDecodeError as e:
        raise body_parse_error(f"{e.msg} at line {e.lineno} column {e.colno}") from None
    except (ValueError, RecursionError) as e:
        raise body_parse_error(str(e)) from None
    surrogate = _lone_surrogate(value)
    if surrogate is not None:
        raise body_parse_error(f"lone surrogate {surrogate} in a string: not a Unicode character")
    return value


def parse_request(raw: bytes, *, compat: bool = False) -> GenerateRequest:
    """A GenerateRequest (CompatGenerateRequest when ``compat``) from a request body."""
    return generate_request(load_json(raw), compat=compat)


def generate_request(body, *, compat: bool = False, struct: str | None = None) -> GenerateRequest:
    """A GenerateRequest (CompatGenerateRequest when ``compat``) from a parsed JSON value; ``struct``: the
    name its type errors give it (a Vertex instance's)."""
    struct = struct or ("CompatGenerateRequest" if compat else "GenerateRequest")
    if not isinstance(body, dict):
        raise body_type_error(f"invalid type: {_unexpected(body)}, expected struct {struct}")
    if "inputs" not in body:
        raise body_type_error("missing field `inputs`")
    inputs = _convert("inputs", body["inputs"], "string")
    parameters = _parse_parameters(body["parameters"]) if "parameters" in body else default_parameters()
    stream = _convert("stream", body["stream"], "bool") if compat and "stream" in body else False
    return GenerateRequest(inputs=inputs, parameters=parameters, stream=stream)


# ------------------------------------------------------------------------------------------------
# TGI's rules
# ------------------------------------------------------------------------------------------------


@dataclass
class ValidParameters:
    """Parameters that passed every check that does not need the tokenized prompt."""

    sampling: SamplingParams
    seed: int | None  # reported in details: None for greedy
    best_of: int
    truncate: int | None
    max_new_tokens: int | None
    stop: list[str]
    ignore_eos: bool = False
    grammar: Grammar | None = None  # constrained decoding
    adapter: str = ""  # the LoRA adapter that answers (served_adapter); "": the base model
    stop_token_ids: list[int] = field(default_factory=list)  # vLLM's: more ids that end it, ignore_eos or not
    include_stop_str: bool = False  # vLLM's include_stop_str_in_output: a matched stop sequence stays in the text


def validate_best_of(best_of: int, limits: Limits) -> int:
    """Infer::generate_best_of's check, run before the others when best_of != 1 (TGI lets 0 through to one
    generation; it is refused here with the same message)."""
    if limits.max_best_of == 1 and best_of != 1:
        raise validation_error("`best_of` != 1 is not allowed for this endpoint")
    if best_of > limits.max_best_of or best_of < 1:
        raise validation_error(f"`best_of` must be > 0 and <= {limits.max_best_of}. Given: {best_of}")
    return best_of


def served_adapter(p: GenerateParameters, adapters: Sequence[str]) -> str:
    """The LoRA adapter that answers, "" for the base model: TGI's ``adapter_id``, else an OpenAI body's
    ``model`` where it names a loaded adapter (any other name gets the base model, as TGI answers whatever
    is named). An ``adapter_id`` that is not loaded is refused (422), where TGI falls back to the base
    model: a client that asked for an adapter must not get another model's answer."""
    if p.adapter_id:
        if p.adapter_id not in adapters:
            served = ", ".join(f"`{a}`" for a in adapters) if adapters else "none (start with --lora-adapters)"
            raise validation_error(f"adapter `{p.adapter_id}` is not loaded; loaded adapters: {served}",
                                   param="adapter_id")
        return p.adapter_id
    return p.model if p.model and p.model in adapters else ""


def validate_parameters(inputs: str | list[int], p: GenerateParameters, limits: Limits,
                        rng: random.Random | None = None, adapters: Sequence[str] = ()) -> ValidParameters:
    """validation.rs ``validate`` up to tokenization, in TGI's order; ``adapters``: the LoRA adapters the
    ranks hold."""
    adapter = served_adapter(p, adapters)  # before all: the base model's answer would be the wrong model's
    best_of = 1 if p.best_of is None else p.best_of
    sampling_requested = (p.do_sample or p.temperature is not None or p.top_k is not None
                          or p.top_p is not None or p.typical_p is not None or p.min_p is not None)
    if best_of > 1 and not sampling_requested:
        raise validation_error("you must use sampling when `best_of` is > 1")

    temperature = 1.0 if p.temperature is None else p.temperature
    if not temperature > 0.0:
        raise validation_error("`temperature` must be strictly positive")
    repetition_penalty = 1.0 if p.repetition_penalty is None else p.repetition_penalty
    if not repetition_penalty > 0.0:
        raise validation_error("`repetition_penalty` must be strictly positive")
    frequency_penalty = 0.0 if p.frequency_penalty is None else p.frequency_penalty
    if not -2.0 <= frequency_penalty <= 2.0:
        raise validation_error("`frequency_penalty` must be >= -2.0 and <= 2.0")
    presence_penalty = 0.0 if p.presence_penalty is None else p.presence_penalty
    if not -2.0 <= presence_penalty <= 2.0:
        raise validation_error("`presence_penalty` must be >= -2.0 and <= 2.0")
    top_p = 1.0
    if p.top_p is not None:
        if not 0.0 < p.top_p < 1.0:
            raise validation_error("`top_p` must be > 0.0 and < 1.0")
        top_p = p.top_p
    typical_p = 1.0
    if p.typical_p is not None:
        if not 0.0 < p.typical_p < 1.0:
            raise validation_error("`typical_p` must be > 0.0 and < 1.0")
        typical_p = p.typical_p
    min_p = 0.0 if p.min_p is None else p.min_p
    if not 0.0 <= min_p <= 1.0:
        raise validation_error("`min_p` must be >= 0.0 and <= 1.0")
    top_k = 0
    if p.top_k is not None:
        if p.top_k <= 0:
            raise validation_error("`top_k` must be strictly positive")
        top_k = p.top_k
    if p.max_new_tokens == 0:
        raise validation_error("`max_new_tokens` must be strictly positive")
    if len(p.stop) > limits.max_stop_sequences:
        raise validation_error(f"`stop` supports up to {limits.max_stop_sequences} stop sequences. "
                               f"Given: {len(p.stop)}")
    if p.seed is None:
        seed = (rng or random).getrandbits(64)
    else:
        if best_of > 1:
            raise validation_error("`seed` must not be set when `best_of` > 1")
        seed = p.seed
    top_n_tokens = 0
    if p.top_n_tokens is not None:
        if p.top_n_tokens > limits.max_top_n_tokens:
            raise validation_error(f"`top_n_tokens` must be >= 0 and <= {limits.max_top_n_tokens}. "
                                   f"Given: {p.top_n_tokens}")
        top_n_tokens = p.top_n_tokens
    if not inputs:
        raise validation_error("`inputs` cannot be empty")
    if p.truncate is not None and (p.truncate == 0 or p.truncate > limits.max_input_tokens):
        raise validation_error(f"`truncate` must be strictly positive and less than "
                               f"{limits.max_input_tokens}. Given: {p.truncate}")
    grammar = p.constraint
    if p.grammar is not None:
        grammar = tgi_grammar(p.grammar, enabled=limits.grammar_support, strict=limits.strict_schemas)

    # The server samples when asked to or when any warper changes the distribution
    # (text_generation_server/utils/tokens.py); greedy requests report no seed.
    do_sample = (p.do_sample or temperature != 1.0 or top_k != 0 or top_p < 1.0 or typical_p < 1.0 or min_p > 0.0)
    sampling = SamplingParams(
        temperature=temperature, top_k=top_k, top_p=top_p, typical_p=typical_p, do_sample=do_sample,
        seed=seed, repetition_penalty=repetition_penalty, frequency_penalty=frequency_penalty,
        top_n_tokens=top_n_tokens, watermark=p.watermark, presence_penalty=presence_penalty, min_p=min_p,
        frequency_per_count=p.frequency_per_count and frequency_penalty != 0.0,
        logit_bias_ids=list(p.logit_bias), logit_bias_values=list(p.logit_bias.values()),
        min_new_tokens=p.min_new_tokens)
    return ValidParameters(sampling=sampling, seed=seed if do_sample else None, best_of=best_of,
                           truncate=p.truncate, max_new_tokens=p.max_new_tokens, stop=list(p.stop),
                           ignore_eos=p.ignore_eos_token, grammar=grammar, adapter=adapter,
                           stop_token_ids=list(p.stop_token_ids), include_stop_str=p.include_stop_str)


def validate_lengths(num_tokens: int, truncate: int | None, max_new_tokens: int | None,
                     limits: Limits) -> tuple[int, int]:
    """(input_length, max_new_tokens to schedule) for a prompt of ``num_tokens`` tokens.

    TGI checks the total before the input length. Without ``max_new_tokens`` the request may run to
    ``max_total_tokens``; TGI checks only its first 1024-token chunk (it re-queues long generations), and
    so do we, while the scheduler gets the whole budget in one request.
    """
    input_length = min(num_tokens, truncate) if truncate is not None else num_tokens
    if max_new_tokens is not None:
        checked = scheduled = max_new_tokens
    else:
        scheduled = max(limits.max_total_tokens - input_length, 0)
        checked = min(scheduled, DEFAULT_GENERATION_LENGTH)
    if input_length + checked > limits.max_total_tokens:
        raise validation_error(f"`inputs` tokens + `max_new_tokens` must be <= {limits.max_total_tokens}. "
                               f"Given: {input_length} `inputs` tokens and {checked} `max_new_tokens`")
    if input_length > limits.max_input_tokens:
        raise validation_error(f"`inputs` must have less than {limits.max_input_tokens} tokens. "
                               f"Given: {input_length}")
    return input_length, scheduled

