"""OpenAI request bodies (``/v1/chat/completions``, ``/v1/completions``) read into TGI's parameters.

Where TGI falls short of OpenAI's API we follow OpenAI: ``temperature`` 0 means greedy (whatever else the
request sets), ``top_p`` 1.0 is accepted (and means no nucleus cut), ``n`` > 1 returns n choices, ``stop``
may be a string. A sampled request's unset temperature, top_k, top_p, min_p and repetition_penalty take the
server's defaults (``sampling_defaults.py``: flags, then the model's generation_config.json), then OpenAI's. The mapped
``GenerateParameters`` then pass TGI's own rules (``validate_parameters``) with TGI's messages. Unknown
keys are ignored, as both OpenAI's and TGI's servers do.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from llmbus.bus.messages import Grammar
from llmbus.frontend.chat import ChatFormat
from llmbus.frontend.config import Limits
from llmbus.frontend.errors import ApiError, ErrorKind, body_type_error, validation_error
from llmbus.frontend.grammar import response_format_grammar, vllm_grammar
from llmbus.frontend.images import markdown_image
from llmbus.frontend.harmony import HarmonyPlan
from llmbus.frontend.reasoning import ReasoningPlan
from llmbus.frontend.refused_fields import OPENAI_CHAT, VLLM_EXTRAS, refuse_unserved
from llmbus.frontend.sampling_defaults import SamplingDefaults
from llmbus.frontend.thinking_controls import ThinkingAsk, apply_thinking, openai_effort
from llmbus.frontend.tools import ToolPlan, parse_tools
from llmbus.frontend.validation import I32_MAX, GenerateParameters, load_json, to_f32

_TYPE_CHECKS = {
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "string": lambda v: isinstance(v, str),
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
}
_ARTICLE = {"integer": "an", "object": "an", "array": "an"}
# the variables the renderer sets itself: chat_template_kwargs may not replace them
_TEMPLATE_OWN = ("messages", "tools", "documents", "chat_template", "add_generation_prompt",
                 "continue_final_message", "return_assistant_tokens_mask", "conversations")


def read_json_object(raw: bytes, what: str) -> dict:
    body = load_json(raw)
    if not isinstance(body, dict):
        raise body_type_error(f"expected a JSON object ({what})")
    return body


def body_field(body: dict, name: str, kind: str, default=None):
    """``body[name]`` if present and not null, checked to be of JSON type ``kind``."""
    value = body.get(name)
    if value is None:
        return default
    if not _TYPE_CHECKS[kind](value):
        raise validation_error(f"`{name}` must be {_ARTICLE.get(kind, 'a')} {kind}. Given: {json.dumps(value)}",
                               param=name)
    if kind == "number":
        # the engine computes in f32: 1e-300 is a temperature of 0 there, so it is one here too
        rounded = to_f32(value)
        if rounded is None:
            raise validation_error(f"`{name}` is out of range. Given: {json.dumps(value)}", param=name)
        return rounded
    return value


def _in_range(name: str, value, low, high, *, low_open: bool = False) -> None:
    if value is None:
        return
    if value < low or value > high or (low_open and value == low):
        lower = f"> {low}" if low_open else f">= {low}"
        raise validation_error(f"`{name}` must be {lower} and <= {high}. Given: {value}", param=name)


@dataclass
class OpenAIOptions:
    """What the OpenAI routes read beyond TGI's parameters."""

    n: int
    stream: bool
    include_usage: bool
    top_logprobs: int | None  # None: no logprobs; 0: the chosen tokens' logprobs only


@dataclass
class ChatRequest:
    messages: list[dict]
    tools: list[dict] | None  # as sent; shown to a template that declares tools even with tool_choice "none"
    params: GenerateParameters
    options: OpenAIOptions
    plan: ToolPlan | None = None  # the tools the model may call, and the grammar that holds it to them
    tool_prompt: str | None = None  # TGI's: the instruction appended with the tools (None: ours)
    template_kwargs: dict | None = None  # chat_template_kwargs, and the thinking switch a reasoning control set
    chat_format: ChatFormat | None = None  # the model's syntaxes (None: Hermes, no reasoning)
    # set once the prompt is rendered (openai_routes.chat_prompt)
    reasoning: ReasoningPlan | HarmonyPlan | None = None


@dataclass
class CompletionRequest:
    prompts: list[str | list[int]]  # text, or token ids (fed as they are: no special tokens added)
    echo: bool
    params: GenerateParameters
    options: OpenAIOptions


def _stop_sequences(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return list(stop)
    raise validation_error("`stop` must be a string or an array of strings", param="stop")


def _common(body: dict, max_choices: int, max_tokens_keys: tuple[str, ...],
            defaults: SamplingDefaults) -> tuple[GenerateParameters, OpenAIOptions]:
    """The parameters both routes share, mapped onto TGI's GenerateParameters; the sampling parameters a
    sampled request leaves unset come from ``defaults`` (frontend/sampling_defaults.py)."""
    p = GenerateParameters(do_sample=True, details=True)
    max_tokens = None
    for key in max_tokens_keys:  # max_completion_tokens wins over the deprecated max_tokens
        value = body_field(body, key, "integer")
        if value is not None:
            if value < 1:
                raise validation_error(f"`{key}` must be >= 1. Given: {value}", param=key)
            max_tokens = value
    p.max_new_tokens = max_tokens

    temperature = body_field(body, "temperature", "number")
    _in_range("temperature", temperature, 0.0, 2.0)
    top_p = body_field(body, "top_p", "number")
    _in_range("top_p", top_p, 0.0, 1.0, low_open=True)
    top_k = body_field(body, "top_k", "integer")  # vLLM's extension; -1 and 0 mean off there
    if top_k is not None and top_k > I32_MAX:  # the engine's top_k is TGI's i32
        raise validation_error(f"`top_k` must be <= {I32_MAX}. Given: {top_k}", param="top_k")
    min_p = body_field(body, "min_p", "number")  # vLLM's and llama.cpp's extension; 0 means off
    _in_range("min_p", min_p, 0.0, 1.0)
    repetition = body_field(body, "repetition_penalty", "number")  # TGI's and vLLM's extension
    # Unset: the server's default, else OpenAI's temperature 1 over the whole vocabulary. A value the
    # request sets wins, its "off" values (top_p 1, top_k 0, min_p 0) included.
    if temperature is None:
        asks_to_sample = bool((top_p is not None and top_p < 1.0) or (top_k is not None and top_k > 0) or min_p)
        if defaults.greedy and not asks_to_sample:
            temperature = 0.0  # the default decoding is greedy (sampling_defaults.py)
        elif defaults.temperature:
            temperature = defaults.temperature
    if temperature == 0:
        p.do_sample = False  # greedy: the warpers and the defaults do not apply
    else:
        if temperature is not None:
            p.temperature = float(temperature)
        top_p = defaults.top_p if top_p is None else top_p
        if top_p is not None and top_p < 1.0:
            p.top_p = float(top_p)
        top_k = defaults.top_k if top_k is None else top_k
        if top_k is not None and top_k > 0:
            p.top_k = top_k
        min_p = defaults.min_p if min_p is None else min_p
        if min_p:
            p.min_p = float(min_p)
        if repetition is None:
            repetition = defaults.repetition_penalty
    if repetition is not None:
        p.repetition_penalty = float(repetition)
    frequency = body_field(body, "frequency_penalty", "number")
    _in_range("frequency_penalty", frequency, -2.0, 2.0)
    if frequency:  # OpenAI's formula, count x penalty over the generated tokens (not TGI's count / length)
        p.frequency_penalty, p.frequency_per_count = float(frequency), True
    presence = body_field(body, "presence_penalty", "number")
    _in_range("presence_penalty", presence, -2.0, 2.0)
    if presence:
        p.presence_penalty = float(presence)
    p.stop = _stop_sequences(body)
    seed = body_field(body, "seed", "integer")
    if seed is not None:
        # OpenAI's seed is a signed 64-bit integer, TGI's unsigned: either is taken, and wraps into ours
        _in_range("seed", seed, -2**63, 2**64 - 1)
        p.seed = seed % 2**64
    p.ignore_eos_token = body_field(body, "ignore_eos", "boolean", False)
    p.logit_bias = _logit_bias(body_field(body, "logit_bias", "object") or {})
    # vLLM's extensions, which scripts written for it send in extra_body
    stop_token_ids = body_field(body, "stop_token_ids", "array") or []
    if not all(is_token_id(t) for t in stop_token_ids) or len(stop_token_ids) > MAX_TOKEN_LIST:
        raise validation_error(f"`stop_token_ids` must be an array of at most {MAX_TOKEN_LIST} token ids (integers "
                               f">= 0)", param="stop_token_ids")
    p.stop_token_ids = list(dict.fromkeys(stop_token_ids))
    min_tokens = body_field(body, "min_tokens", "integer", 0)
    if min_tokens < 0:
        raise validation_error(f"`min_tokens` must be >= 0. Given: {min_tokens}", param="min_tokens")
    p.min_new_tokens = min_tokens
    p.include_stop_str = body_field(body, "include_stop_str_in_output", "boolean", False)

    n = body_field(body, "n", "integer", 1)
    if not 1 <= n <= max_choices:
        raise validation_error(f"`n` must be >= 1 and <= {max_choices}. Given: {n}", param="n")
    stream = body_field(body, "stream", "boolean", False)
    stream_options = body_field(body, "stream_options", "object") or {}
    include_usage = body_field(stream_options, "include_usage", "boolean", False)
    # A loaded LoRA adapter's name selects it; any other name gets the base model (as TGI answers any)
    p.model = body_field(body, "model", "string")
    options = OpenAIOptions(n=n, stream=stream, include_usage=stream and include_usage, top_logprobs=None)
    return p, options


MAX_TOKEN_LIST = 1024  # logit_bias entries, stop_token_ids: each costs every step of the batch a little


def _logit_bias(given: dict) -> dict[int, float]:
    """OpenAI's ``logit_bias``: token ids (as decimal strings, JSON keys) to a bias from -100 to 100. Whether the
    ids are in the vocabulary is checked with the tokenizer (``Generator.prepare``)."""
    if len(given) > MAX_TOKEN_LIST:
        raise validation_error(f"`logit_bias` may bias at most {MAX_TOKEN_LIST} tokens. Given: {len(given)}",
                               param="logit_bias")
    bias: dict[int, float] = {}
    for key, value in given.items():
        if not (key.isascii() and key.isdigit()) or len(key) > 12:  # no vocabulary holds a 13-digit id
            raise validation_error(f"Invalid key in `logit_bias`: {json.dumps(key)}. Keys must be token ids: "
                                   f"non-negative integers written as strings", param="logit_bias")
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not -100 <= value <= 100:
            raise validation_error(f"Invalid value in `logit_bias` for token {key}: {json.dumps(value)}. Values "
                                   f"must be numbers >= -100 and <= 100", param="logit_bias")
        bias[int(key)] = float(value)  # "7" and "07" are one token: the later value wins, as in a dict
    return bias


def _truncate_prompt_tokens(body: dict, p: GenerateParameters, limits: Limits) -> None:
    """vLLM's ``truncate_prompt_tokens``: keep the prompt's last k tokens (-1: as many as the server takes), which is
    TGI's ``truncate``."""
    keep = body_field(body, "truncate_prompt_tokens", "integer")
    if keep is None:
        return
    if keep == -1:
        keep = limits.max_input_tokens
    if not 1 <= keep <= limits.max_input_tokens:
        raise validation_error(f"`truncate_prompt_tokens` must be -1 or >= 1 and <= {limits.max_input_tokens}. "
                               f"Given: {keep}", param="truncate_prompt_tokens")
    p.truncate = keep


def _set_top_logprobs(p: GenerateParameters, options: OpenAIOptions, count: int | None, name: str,
                      limits: Limits) -> None:
    if count is None:
        return
    if not 0 <= count <= limits.max_top_n_tokens:
        raise validation_error(f"`{name}` must be >= 0 and <= {limits.max_top_n_tokens}. Given: {count}",
                               param=name)
    options.top_logprobs = count
    if count:
        p.top_n_tokens = count


def _image_url(part: dict, where: str) -> str:
    image_url = part.get("image_url")
    url = image_url.get("url") if isinstance(image_url, dict) else None
    if not isinstance(url, str) or not url:
        raise validation_error(f"`{where}.image_url` must be an object with a string `url`", param="messages")
    return url  # its `detail` asks OpenAI's tiling: a LLaVA image takes the same tokens whatever it says


def _message_content(message: dict, index: int, images: bool) -> str | None:
    """A message's content as one text: text parts joined, and for a model that reads ``images`` each
    ``image_url`` part as TGI's ``![](<url>)``."""
    content = message.get("content")
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise validation_error(f"`messages[{index}].content` must be a string or an array of content parts",
                               param="messages")
    texts = []
    readable = "text and image_url parts are" if images else "only text parts are"
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(kind, str):
            raise validation_error(f"`messages[{index}].content[{j}]` must be a content part: an object with a "
                                   f"string `type`", param="messages")
        if kind == "image_url" and images:
            texts.append(markdown_image(_image_url(part, f"messages[{index}].content[{j}]")))
            continue
        if kind != "text":
            raise validation_error(f"`messages[{index}].content`: {kind} content is not supported by this model; "
                                   f"{readable}", param="messages")
        if not isinstance(part.get("text"), str):
            raise validation_error(f"`messages[{index}].content[{j}].text` must be a string", param="messages")
        texts.append(part["text"])
    return "".join(texts)


def _messages(body: dict, images: bool) -> list[dict]:
    messages = body_field(body, "messages", "array")
    if not messages:
        raise validation_error("`messages` must be a non-empty array", param="messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise validation_error(f"`messages[{i}]` must be an object with a string `role`", param="messages")
        for key in ("name", "tool_call_id"):  # strings the template reads (TGI's Option<String>)
            if message.get(key) is not None and not isinstance(message[key], str):
                raise validation_error(f"`messages[{i}].{key}` must be a string. Given: "
                                       f"{json.dumps(message[key])}", param="messages")
        # a plain copy for the template: parts joined into one string, which every template reads (TGI's too)
        clean = dict(message)
        clean["content"] = _message_content(message, i, images)
        if clean["content"] is None and not (message["role"] == "assistant" and message.get("tool_calls")):
            # only an assistant's tool calls stand without content (OpenAI's rule; TGI's MessageBody too)
            raise validation_error(f"`messages[{i}]` must have a `content`", param="messages")
        out.append(clean)
    return out


def _template_kwargs(body: dict) -> dict | None:
    kwargs = body_field(body, "chat_template_kwargs", "object")
    for key in kwargs or ():
        if key in _TEMPLATE_OWN or key.endswith("_token"):
            raise validation_error(f"`chat_template_kwargs` may not set `{key}`", param="chat_template_kwargs")
    return kwargs or None


def parse_chat(body: dict, limits: Limits, max_choices: int, defaults: SamplingDefaults,
               chat_format: ChatFormat | None = None, thinking: ThinkingAsk | None = None) -> ChatRequest:
    """A chat request; ``chat_format``: the model's tool syntax (and its markers' tokens) for the plan, and
    its thinking switch, which ``reasoning_effort`` sets (or ``thinking``: the control of the API a
    translated body came from, thinking_controls.py)."""
    refuse_unserved(body, OPENAI_CHAT)
    refuse_unserved(body, VLLM_EXTRAS)
    if thinking is None:
        thinking = openai_effort(body.get("reasoning_effort"))
    template_kwargs = apply_thinking(thinking, chat_format, _template_kwargs(body))
    p, options = _common(body, max_choices, ("max_tokens", "max_completion_tokens"), defaults)
    _truncate_prompt_tokens(body, p, limits)
    messages = _messages(body, chat_format is not None and chat_format.reads_images)
    if body_field(body, "logprobs", "boolean", False):
        _set_top_logprobs(p, options, body_field(body, "top_logprobs", "integer", 0), "top_logprobs", limits)
    elif body.get("top_logprobs") is not None:
        raise validation_error("`top_logprobs` needs `logprobs` set to true", param="top_logprobs")
    tools = body_field(body, "tools", "array")
    if chat_format is not None:
        plan = parse_tools(body, strict=limits.strict_schemas, fmt=chat_format.tools, token_of=chat_format.token_of)
    else:
        plan = parse_tools(body, strict=limits.strict_schemas)
    response_format = body_field(body, "response_format", "object")
    guided = vllm_grammar(body, enabled=limits.grammar_support, strict=limits.strict_schemas)
    if plan is not None:
        if (response_format and response_format.get("type") not in (None, "text")) or guided is not None:
            raise ApiError(ErrorKind.TOOL, "Grammar and tools are mutually exclusive")
        if not limits.grammar_support:
            raise validation_error("grammar is not supported", param="tools")
        p.constraint = plan.grammar
    else:
        p.constraint = _one_constraint(response_format, guided, limits)
    return ChatRequest(messages=messages, tools=tools or None, params=p, options=options, plan=plan,
                       tool_prompt=body_field(body, "tool_prompt", "string"), template_kwargs=template_kwargs,
                       chat_format=chat_format)


def _one_constraint(response_format: dict | None, guided: tuple[Grammar, str] | None,
                    limits: Limits) -> Grammar | None:
    """The grammar of ``response_format`` or of vLLM's parameters (``guided``: the grammar and its parameter's
    name), which may not both ask for one."""
    constraint = (response_format_grammar(response_format, enabled=limits.grammar_support,
                                          strict=limits.strict_schemas) if response_format else None)
    if guided is None:
        return constraint
    if constraint is not None:
        raise validation_error(f"`{guided[1]}` and `response_format` cannot both constrain the output",
                               param=guided[1])
    return guided[0]


def is_token_id(value) -> bool:
    """A JSON value that is a token id: an integer >= 0 (not a boolean)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _prompts(prompt) -> list[str | list[int]]:
    """OpenAI's four shapes of ``prompt``: a string, strings, one prompt's token ids, several prompts' token ids
    (as vLLM takes them; lm-eval's completions client sends token ids)."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and not prompt:
        raise validation_error("Empty array detected. Do not use an empty array for the prompt.", param="prompt")
    if isinstance(prompt, list):
        if all(isinstance(s, str) for s in prompt):
            return list(prompt)
        if all(is_token_id(t) for t in prompt):
            return [list(prompt)]
        if all(isinstance(p, list) and p and all(is_token_id(t) for t in p) for p in prompt):
            return [list(p) for p in prompt]
    raise validation_error("`prompt` must be a string, an array of strings, an array of token ids (integers >= 0) "
                           "or an array of non-empty arrays of token ids", param="prompt")


def parse_completion(body: dict, limits: Limits, max_client_batch_size: int,
                     defaults: SamplingDefaults) -> CompletionRequest:
    suffix = body.get("suffix")
    if suffix:
        raise ApiError(ErrorKind.SUFFIX)
    refuse_unserved(body, VLLM_EXTRAS)
    prompts = _prompts(body.get("prompt"))
    if len(prompts) > max_client_batch_size:
        raise ApiError(ErrorKind.BATCH_SIZE, str(max_client_batch_size))
    p, options = _common(body, max_client_batch_size, ("max_tokens",), defaults)
    _truncate_prompt_tokens(body, p, limits)
    if body.get("max_tokens") is None:
        p.max_new_tokens = 16  # OpenAI's default for completions
    best_of = body_field(body, "best_of", "integer")
    if best_of is not None and best_of != options.n:
        raise validation_error(f"`best_of` must equal `n` ({options.n}): choosing among extra samples is "
                               f"not supported. Given: {best_of}", param="best_of")
    _set_top_logprobs(p, options, body_field(body, "logprobs", "integer"), "logprobs", limits)
    response_format = body_field(body, "response_format", "object")  # vLLM takes it here too
    p.constraint = _one_constraint(response_format, vllm_grammar(body, enabled=limits.grammar_support,
                                                                 strict=limits.strict_schemas), limits)
    return CompletionRequest(prompts=prompts, echo=body_field(body, "echo", "boolean", False), params=p,
                             options=options)
