"""The component schemas of the OpenAPI description (TGI's and OpenAI's bodies), and the small JSON
Schema builders the paths in openapi.py use too."""

from __future__ import annotations

from llmbus.frontend.thinking_controls import EFFORTS

# words the chat, Responses and Messages request schemas share: the template's variables, the reasoning controls
THINKING_SWITCH_NOTE = ("where the model reasons, its chat template's thinking switch (Qwen3's `enable_thinking`) "
                        "is set; a `chat_template_kwargs` value of the switch that disagrees is an error. A model "
                        "that does not reason refuses it (400) unless it asks for no thinking, and one whose "
                        "template always reasons refuses thinking off.")
EFFORT_NOTE = ('"none" and "minimal" turn thinking off, "low", "medium", "high" and "xhigh" turn it on (a switch has '
               "no degrees): ")
CHAT_TEMPLATE_KWARGS = {"description": "More variables for the chat template (vLLM's), e.g. `{\"enable_thinking\": "
                                       "false}`; not the renderer's own (`messages`, `tools`, "
                                       "`add_generation_prompt`, ... , special tokens).", "type": ["object", "null"]}

# ------------------------------------------------------------------------------------------------
# Schema building blocks
# ------------------------------------------------------------------------------------------------


def ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _t(type_: str, description: str | None = None, *, nullable: bool = False, **extra) -> dict:
    schema: dict = {"type": [type_, "null"] if nullable else type_}
    if description:
        schema["description"] = description
    schema.update(extra)
    return schema


def _maybe(schema: dict, description: str | None = None) -> dict:
    """``schema`` or null: a referenced schema cannot carry a null type itself."""
    out: dict = {"anyOf": [schema, {"type": "null"}]}
    if description:
        out["description"] = description
    return out


def array(items: dict, description: str | None = None, **extra) -> dict:
    return _t("array", description, items=items, **extra)


def _obj(properties: dict, required: tuple[str, ...] = (), description: str | None = None,
         **extra) -> dict:
    schema: dict = {"type": "object", "properties": properties}
    if required:
        schema["required"] = list(required)
    if description:
        schema["description"] = description
    schema.update(extra)
    return schema


def _string_or_list(description: str, *, nullable: bool = False, non_empty: bool = False) -> dict:
    text = {"type": "string", "minLength": 1} if non_empty else {"type": "string"}
    options = [text, array(text, minItems=1) if non_empty else array(text)]
    return {"description": description, "anyOf": (options + [{"type": "null"}]) if nullable else options}


def _completion_prompt() -> dict:
    ids = array({"type": "integer", "minimum": 0}, minItems=1)
    text = _string_or_list("", non_empty=True)["anyOf"]
    return {"description": "One prompt or a non-empty list (at most --max-client-batch-size), as text or token ids "
                           "(fed as they are, no special tokens added); no prompt may be empty.",
            "anyOf": [*text, ids, array(ids, minItems=1)]}


# ------------------------------------------------------------------------------------------------
# Component schemas
# ------------------------------------------------------------------------------------------------

# TGI reads its numbers as Rust types (serde): a value outside the type's range is refused, and so is a
# positive number that rounds to 0 as a 32-bit float, so the bounds are the types' own.
U32_MAX, I32_MAX, U64_MAX = 2**32 - 1, 2**31 - 1, 2**64 - 1
F32_MAX = 3.4028234663852886e38  # the largest finite f32: a larger number does not fit
F32_TINY = 1.401298464324817e-45  # the smallest positive f32: a smaller positive number reads as 0
F32_BELOW_ONE = 0.9999999403953552  # the largest f32 below 1: a number closer to 1 reads as 1

_FINISH_REASON = {"type": "string", "enum": ["length", "eos_token", "stop_sequence"],
                  "description": "Why generation stopped: the token budget ran out, the model emitted an "
                                 "end-of-sequence token, or the text ended with a stop sequence."}


def _grammar_schema() -> dict:
    def variant(kind: str, value: dict, description: str) -> dict:
        return _obj({"type": {"type": "string", "const": kind}, "value": value}, ("type", "value"),
                    description)

    json_value = {"description": "A JSON Schema, as an object or as a JSON string.",
                  "anyOf": [{"type": "object"}, {"type": "string"}]}
    return {
        "description": "Constrained decoding: every sampled token keeps the output inside the grammar, and "
                       "the request ends (eos_token) once the grammar is complete. 422 `grammar is not "
                       "supported` with --disable-grammar-support, `grammar is not valid: ...` for an invalid "
                       "schema, regex or grammar, `cannot compile regex from schema: ...` for a schema the "
                       "compiler refuses.",
        "oneOf": [
            variant("json", json_value, "Output must be a JSON document valid under this JSON Schema "
                                        "(Draft 2020-12; `$ref`, `anyOf`, bounds, patterns)."),
            variant("json_object", json_value, "Alias of `json`."),
            variant("regex", {"type": "string"}, "Output must match this regular expression whole (Rust "
                                                 "`regex` syntax: no lookaround or backreferences)."),
            variant("json_schema", _obj({"name": _t("string", nullable=True), "schema": {"type": "object"}},
                                        ("schema",)), "OpenAI-style named JSON Schema."),
            variant("lark", {"type": "string"}, "A context-free grammar in llguidance's Lark dialect "
                                                "(llmbus's extension)."),
            variant("ebnf", {"type": "string"}, "A context-free grammar in llama.cpp's GBNF (llmbus's "
                                                "extension)."),
        ],
    }


def _generate_parameters() -> dict:
    f32 = "number"
    return _obj({
        "best_of": _t("integer", "Run this many sampled generations and return the one with the highest "
                      "mean token logprob (the others go to `details.best_of_sequences`). Needs sampling, "
                      "no `seed`, and no streaming; at most --max-best-of.", nullable=True, minimum=1,
                      maximum=U64_MAX),
        "temperature": _t(f32, "Divide the logits by this before sampling; below 1 sharpens, above 1 "
                          "flattens. Setting it turns sampling on. Unset in a request that samples: the "
                          "server's default (/info `sampling_defaults`: --default-temperature, else the "
                          "model's generation_config.json), as are top_k, top_p, min_p and "
                          "repetition_penalty; a greedy request gets none of them.", nullable=True,
                          minimum=F32_TINY, maximum=F32_MAX),
        "repetition_penalty": _t(f32, "Penalty for tokens already in the prompt or output (1.0 = none; "
                                 "above 1 discourages repeats).", nullable=True, minimum=F32_TINY,
                                 maximum=F32_MAX),
        "frequency_penalty": _t(f32, "TGI's frequency penalty: the logit loses penalty x (occurrences in "
                                "prompt and output / their length); 0 = none.", nullable=True, minimum=-2,
                                maximum=2),
        "presence_penalty": _t(f32, "llmbus extension (OpenAI's): subtracted from the logit of every token "
                               "already generated; 0 = none.", nullable=True, minimum=-2, maximum=2),
        "top_k": _t("integer", "Sample only among the k most likely tokens.", nullable=True, minimum=1,
                    maximum=I32_MAX),
        "top_p": _t(f32, "Nucleus sampling: keep the smallest set of tokens whose probabilities add up to "
                    "top_p. 1.0 itself is rejected, as in TGI.", nullable=True, minimum=F32_TINY,
                    maximum=F32_BELOW_ONE),
        "typical_p": _t(f32, "Locally typical sampling mass (same bounds as top_p).", nullable=True,
                        minimum=F32_TINY, maximum=F32_BELOW_ONE),
        "min_p": _t(f32, "llmbus extension (llama.cpp's and vLLM's min-p): drop tokens less likely than min_p "
                    "times the most likely one (0 = off). Setting it turns sampling on.", nullable=True,
                    minimum=0, maximum=1),
        "do_sample": _t("boolean", "Sample instead of greedy decoding. Defaults to false when `parameters` "
                        "is given, but to true when the body has no `parameters` at all (TGI's quirk).",
                        default=False),
        "max_new_tokens": _t("integer", "Most tokens to generate. Unset: up to --max-total-tokens minus the "
                             "prompt.", nullable=True, minimum=1, maximum=U32_MAX),
        "return_full_text": _t("boolean", "Prepend the prompt to `generated_text`. Unset: false on "
                               "/generate, the model's pipeline default on POST /.", nullable=True),
        "stop": array({"type": "string"}, "Stop when the output ends with any of these; the stop text "
                       "stays in the output. At most --max-stop-sequences (default 4).", default=[]),
        "truncate": _t("integer", "Keep only the last `truncate` prompt tokens (at most "
                       "--max-input-tokens).", nullable=True, minimum=1, maximum=U64_MAX),
        "watermark": _t("boolean", "Bias sampling with a Kirchenbauer et al. watermark.", default=False),
        "details": _t("boolean", "Return `details`: finish reason, token ids, logprobs and seed.",
                      default=False),
        "decoder_input_details": _t("boolean", "Also return the prompt tokens in `details.prefill` (their "
                                    "logprobs only with --enable-prefill-logprobs). Not with streaming.",
                                    default=False),
        "seed": _t("integer", "Random seed for sampling (unsigned 64-bit); random when unset.",
                   nullable=True, minimum=0, maximum=U64_MAX),
        "top_n_tokens": _t("integer", "Also return the n most likely alternatives at each step (at most "
                           "--max-top-n-tokens, default 5).", nullable=True, minimum=0, maximum=U32_MAX),
        "grammar": _maybe(ref("GrammarType")),
        "adapter_id": _t("string", "LoRA adapter to compute with: a name from --lora-adapters (/v1/models "
                         "lists them); one that is not loaded is refused (422). Unset: the base model.",
                         nullable=True),
        "ignore_eos_token": _t("boolean", "llmbus extension: do not stop at end-of-sequence tokens, so "
                               "every request generates exactly max_new_tokens (fixed-length benchmarks).",
                               default=False),
    }, description="Generation settings. Unknown keys are ignored.")


_INPUTS = ("The prompt. A vision-language model (LLaVA) reads each `![](<url>)` in it as an image (an http(s) "
           "URL, fetched, or a base64 data URL), as TGI does; a text model reads it as text.")


def _token(*, special: bool = True) -> dict:
    props = {"id": _t("integer", "Token id.", minimum=0), "text": _t("string", "Decoded text."),
             "logprob": _t("number", "Log probability; null where unknown.", nullable=True)}
    if special:
        props["special"] = _t("boolean", "A special token (its text is not part of generated_text).")
    return _obj(props, tuple(props))


def _sequence_props() -> dict:
    tokens = array(ref("Token"), "The generated tokens.")
    return {
        "finish_reason": ref("FinishReason"),
        "generated_tokens": _t("integer", "Number of generated tokens.", minimum=0),
        "seed": _t("integer", "Seed used for sampling; null for greedy decoding.", nullable=True, minimum=0),
        "prefill": array(ref("PrefillToken"), "Prompt tokens (empty unless decoder_input_details)."),
        "tokens": tokens,
        "top_tokens": array(array(ref("Token")), "Per step, the top_n_tokens alternatives; left out "
                             "when top_n_tokens was not asked for."),
    }


_SEQUENCE_REQUIRED = ("finish_reason", "generated_tokens", "seed", "prefill", "tokens")


def tgi_schemas() -> dict:
    seq = _sequence_props()
    text = _t("string", "The generated text (with the prompt in front when return_full_text).")
    return {
        "ErrorResponse": _obj({"error": _t("string", "Human-readable message."),
                               "error_type": _t("string", "validation, overloaded, generation, "
                                                "incomplete_generation, healthcheck, ...")},
                              ("error", "error_type"), "TGI's error body."),
        "FinishReason": _FINISH_REASON,
        "GrammarType": _grammar_schema(),
        "GenerateParameters": _generate_parameters(),
        "GenerateRequest": _obj({"inputs": _t("string", _INPUTS, minLength=1),
                                 "parameters": ref("GenerateParameters")}, ("inputs",),
                                example={"inputs": "My name is Olivier and I",
                                         "parameters": {"max_new_tokens": 20, "details": True}}),
        "CompatGenerateRequest": _obj({"inputs": _t("string", _INPUTS, minLength=1),
                                       "parameters": ref("GenerateParameters"),
                                       "stream": _t("boolean", "Answer with an SSE stream.", default=False)},
                                      ("inputs",)),
        "VertexRequest": _obj({"instances": array({"anyOf": [ref("GenerateRequest"), ref("ChatRequest")]},
                                                  "Each a generate request (`inputs`) or a chat request "
                                                  "(`messages`).", minItems=1)}, ("instances",),
                              example={"instances": [{"inputs": "What is Deep Learning?",
                                                      "parameters": {"max_new_tokens": 20}}]}),
        "VertexResponse": _obj({"predictions": array(_t("string"), "One generated text per instance, in order.")},
                               ("predictions",)),
        "Token": _token(),
        "PrefillToken": _token(special=False),
        "BestOfSequence": _obj({"generated_text": text, **seq}, ("generated_text", *_SEQUENCE_REQUIRED)),
        "Details": _obj({**seq, "best_of_sequences": array(ref("BestOfSequence"), "The sequences best_of "
                                                             "did not pick; left out without best_of.")},
                        _SEQUENCE_REQUIRED),
        "GenerateResponse": _obj({"generated_text": text, "details": ref("Details")}, ("generated_text",),
                                 "`details` only when details or decoder_input_details was asked for."),
        "StreamDetails": _obj({"finish_reason": ref("FinishReason"),
                               "generated_tokens": _t("integer", minimum=0),
                               "seed": _t("integer", nullable=True, minimum=0),
                               "input_length": _t("integer", "Prompt tokens.", minimum=0)},
                              ("finish_reason", "generated_tokens", "seed", "input_length")),
        "StreamResponse": _obj({
            "index": _t("integer", "1-based position of this token.", minimum=1),
            "token": ref("Token"),
            "top_tokens": array(ref("Token"), "Alternatives; left out unless top_n_tokens."),
            "generated_text": _t("string", "The whole text, on the last event only.", nullable=True),
            "details": _maybe(ref("StreamDetails"), "On the last event, when details was asked for."),
        }, ("index", "token", "generated_text", "details"), "One SSE event per generated token."),
        "SimpleToken": _obj({"id": _t("integer", minimum=0), "text": _t("string", "The prompt slice."),
                             "start": _t("integer", "Character offset where the token starts.", minimum=0),
                             "stop": _t("integer", "Character offset where it ends.", minimum=0)},
                            ("id", "text", "start", "stop")),
        "TokenizeResponse": array(ref("SimpleToken")),
        "OtherTokenizeRequest": {"anyOf": [
            _obj({"prompt": _t("string"), "add_special_tokens": _t("boolean", default=True, nullable=True),
                  "return_token_strs": _t("boolean", default=False, nullable=True)}, ("prompt",),
                 "vLLM's /tokenize body (its `messages` shape is served too: a chat body, rendered as "
                 "/v1/chat/completions renders it)."),
            _obj({"content": _t("string"), "add_special": _t("boolean", default=False, nullable=True),
                  "with_pieces": _t("boolean", default=False, nullable=True)}, ("content",),
                 "llama.cpp's /tokenize body.")]},
        "OtherTokenizeResponse": {"anyOf": [
            _obj({"count": _t("integer", minimum=0), "max_model_len": _t("integer", minimum=1),
                  "tokens": array(_t("integer", minimum=0)),
                  "token_strs": _t("array", nullable=True, items={"type": "string"})},
                 ("count", "max_model_len", "tokens"), "vLLM's answer."),
            _obj({"tokens": array({"anyOf": [_t("integer", minimum=0), _obj(
                {"id": _t("integer", minimum=0), "piece": _t("string")}, ("id", "piece"))]})},
                 ("tokens",), "llama.cpp's answer (`with_pieces`: each token an id and its text).")]},
        "DetokenizeRequest": _obj({"tokens": array(_t("integer", minimum=0))}, ("tokens",)),
        "DetokenizeResponse": _obj({"prompt": _t("string", "The text (vLLM's key)."),
                                    "content": _t("string", "The same text (llama.cpp's key).")},
                                   ("prompt", "content")),
        "ChatTokenizeResponse": _obj({"tokenize_response": ref("TokenizeResponse"),
                                      "templated_text": _t("string", "The prompt the chat template made.")},
                                     ("tokenize_response", "templated_text")),
        "Info": _obj({
            "model_id": _t("string"), "model_sha": _t("string", nullable=True),
            "model_pipeline_tag": _t("string", nullable=True),
            **{k: _t("integer", minimum=0) for k in (
                "max_concurrent_requests", "max_best_of", "max_stop_sequences", "max_input_tokens",
                "max_total_tokens", "validation_workers", "max_client_batch_size")},
            "quantize": _t("string", "Weight quantization: --quantize's int8 or int4, or gguf:<main tensor "
                                     "type> for a GGUF file (gguf:Q4_1+int8 with both); null: none.",
                           nullable=True, example="gguf:Q4_1"),
            "router": _t("string"), "version": _t("string"), "sha": _t("string", nullable=True),
            "docker_label": _t("string", nullable=True),
            "dtype": _t("string", "The dtype the model computes in (llmbus's; --dtype resolved).", nullable=True,
                        example="bfloat16"),
            "attention_backend": _t("string", "The attention backend every rank runs (llmbus's; "
                                              "--attention-backend resolved).", nullable=True, example="triton"),
            "devices": array(_t("string"), "Each tensor-parallel rank's device, in rank order (llmbus's)."),
            "sampling_defaults": _obj({
                "temperature": _t("number", minimum=0), "top_k": _t("integer"), "top_p": _t("number"),
                "min_p": _t("number", minimum=0, maximum=1), "repetition_penalty": _t("number")},
                description="llmbus's: what a sampled request's unset parameters take (--default-* flags over "
                            "the model's generation_config.json); a parameter not listed takes the API's own "
                            "default.", example={"temperature": 0.2, "top_p": 0.9}),
        }, ("model_id", "max_concurrent_requests", "max_input_tokens", "max_total_tokens", "router",
            "version"), "The served model and the server's limits."),
    }


def _openai_common(model_id: str) -> dict:
    """Fields /v1/chat/completions and /v1/completions share."""
    return {
        "model": _t("string", f"Model name. This server serves `{model_id}`; a LoRA adapter's name (from "
                    "/v1/models) computes with that adapter and is echoed back, any other name gets the base "
                    "model.", nullable=True, example=model_id),
        "max_tokens": _t("integer", "Most tokens to generate.", nullable=True, minimum=1),
        "temperature": _t("number", "Sampling temperature; 0 means greedy decoding. Unset: the server's "
                          "default (/info `sampling_defaults`: --default-temperature, else the model's "
                          "generation_config.json), else 1; likewise top_p, top_k, min_p and "
                          "repetition_penalty of a sampled request.", nullable=True, minimum=0, maximum=2),
        "top_p": _t("number", "Nucleus sampling mass; unlike TGI's native routes, 1 is accepted and means "
                    "no cut.", nullable=True, minimum=F32_TINY, maximum=1),
        "top_k": _t("integer", "Sample among the k most likely tokens (vLLM's extension; 0 or less means "
                    "off).", nullable=True, maximum=I32_MAX),
        "min_p": _t("number", "Drop tokens less likely than min_p times the most likely one (vLLM's and "
                    "llama.cpp's extension; 0 means off).", nullable=True, minimum=0, maximum=1),
        "repetition_penalty": _t("number", "TGI's repetition penalty (1.0 = none).", nullable=True,
                                 minimum=F32_TINY, maximum=F32_MAX),
        "stop": _string_or_list("Stop sequences (a string or a list); a matched one is cut from the text.",
                                nullable=True),
        "seed": _t("integer", "Random seed for sampling: OpenAI's signed 64-bit seed or TGI's unsigned one (taken "
                   "modulo 2^64).", nullable=True, minimum=-2**63, maximum=2**64 - 1),
        "n": _t("integer", "Choices to generate per prompt (at most --max-client-batch-size).",
                nullable=True, minimum=1, default=1),
        "frequency_penalty": _t("number", "Penalise tokens by how often they already occurred.",
                                nullable=True, minimum=-2, maximum=2),
        "presence_penalty": _t("number", "Subtracted from the logit of every token already generated.",
                               nullable=True, minimum=-2, maximum=2),
        "logit_bias": _t("object", "Token ids (as strings) to a bias from -100 to 100 added to that token's logit "
                         "before anything else; -100 all but bans a token, 100 all but forces it. Logprobs are "
                         "those of the biased distribution.", nullable=True,
                         propertyNames={"pattern": "^[0-9]+$"},
                         additionalProperties={"type": "number", "minimum": -100, "maximum": 100},
                         example={"0": -100}),
        "guided_json": {"description": "vLLM's structured output: a JSON Schema (or a string holding one) the "
                                       "answer must validate against. One of guided_json, guided_regex, "
                                       "guided_choice, guided_grammar and structured_outputs, and not with "
                                       "response_format or tools.",
                        "anyOf": [{"type": "object"}, {"type": "string"}, {"type": "null"}]},
        "guided_regex": _t("string", "vLLM's: a regular expression the whole answer matches.", nullable=True),
        "guided_choice": _t("array", "vLLM's: the answer is exactly one of these strings.", nullable=True,
                            items={"type": "string", "minLength": 1}, minItems=1),
        "guided_grammar": _t("string", "vLLM's: a context-free grammar, GBNF (rules written `::=`) or "
                           "llguidance's Lark.", nullable=True),
        "structured_outputs": _t("object", "vLLM's newer form of the guided_* parameters: one of `json`, `regex`, "
                                 "`choice`, `grammar` or `json_object: true`.", nullable=True),
        "stream": _t("boolean", "Answer with an SSE stream ending with `data: [DONE]`.", nullable=True,
                      default=False),
        "stream_options": _maybe(ref("StreamOptions")),
        "ignore_eos": _t("boolean", "llmbus extension: keep generating past end-of-sequence tokens until "
                         "max_tokens.", nullable=True, default=False),
        "min_tokens": _t("integer", "vLLM's: no end-of-sequence token, stop id or stop sequence ends the answer "
                         "before this many tokens.", nullable=True, minimum=0),
        "stop_token_ids": _t("array", "vLLM's: more token ids that end the answer (ignore_eos or not).",
                             nullable=True, items={"type": "integer", "minimum": 0}),
        "include_stop_str_in_output": _t("boolean", "vLLM's: keep the matched stop sequence in the text.",
                                         nullable=True, default=False),
        "truncate_prompt_tokens": _t("integer", "vLLM's: keep only the prompt's last k tokens (-1: as many as "
                                     "--max-input-tokens).", nullable=True, minimum=-1),
    }


def _openai_envelope(object_: str, choice: dict, *, usage_nullable: bool) -> dict:
    usage = _maybe(ref("Usage")) if usage_nullable else ref("Usage")
    return _obj({"id": _t("string"), "object": _t("string", const=object_),
                 "created": _t("integer", "Unix time in seconds."), "model": _t("string"),
                 "system_fingerprint": _t("string"), "choices": array(choice), "usage": usage},
                ("id", "object", "created", "model", "choices"))


def openai_schemas(model_id: str) -> dict:
    role = _t("string", "system, user, assistant or tool.")
    content_part = {"anyOf": [
        _obj({"type": _t("string", const="text"), "text": _t("string")}, ("type", "text")),
        _obj({"type": _t("string", const="image_url"), "image_url": _obj({
            "url": _t("string", "An http(s) URL or a base64 data URL (`data:image/png;base64,...`)."),
            "detail": _t("string", "Accepted and ignored: an image takes the tokens the model gives it.")},
            ("url",))}, ("type", "image_url"),
            "An image: read by a vision-language model (LLaVA), which sees it where it stands in the text; a "
            "text model refuses it (422).")]}
    finish = _t("string", "`stop` (end-of-sequence token or stop sequence), `length`, or `tool_calls` (the "
                "answer called tools); null until the choice ends.", nullable=True)
    function_call = _obj({"name": _t("string"), "arguments": _t("string", "The arguments as a JSON text.")},
                         ("name", "arguments"))
    tool_call = _obj({"id": _t("string"), "type": _t("string", const="function"), "function": function_call},
                     ("id", "type", "function"))
    tool_call_delta = _obj({"index": _t("integer", minimum=0), "id": _t("string", "On a call's first delta."),
                            "type": _t("string", const="function"),
                            "function": _obj({"name": _t("string", "On a call's first delta."),
                                              "arguments": _t("string", "A fragment; a call's fragments "
                                                                        "join into its arguments.")})},
                           ("index",), "One call's part of a chunk: its first delta names it (index, id, "
                                       "type, name, arguments \"\"), later ones add argument fragments.")
    tool = _obj({"type": _t("string", const="function"), "function": _obj({
        "name": _t("string"), "description": _t("string"),
        "parameters": _t("object", "A JSON Schema of the arguments (default: an object with no properties).")},
        ("name",))}, ("type", "function"))
    choice_logprobs = _maybe(ref("ChatLogprobs"))
    top = _obj({"token": _t("string"), "logprob": _t("number")}, ("token", "logprob"))
    text_choice = {"index": _t("integer", minimum=0), "text": _t("string"),
                   "logprobs": _maybe(ref("CompletionLogprobs")), "finish_reason": finish}
    return {
        "OpenAIError": _obj({"error": _obj({
            "message": _t("string"), "type": _t("string", "The error kind, e.g. invalid_request_error."),
            "param": _t("string", "The request field at fault, if any.", nullable=True),
            "code": _t("string", "TGI's error_type.", nullable=True)}, ("message", "type", "param", "code")),
            "error_type": _t("string", "TGI's error_type again, for TGI clients.")},
            ("error",), "OpenAI's error body."),
        "StreamOptions": _obj({"include_usage": _t("boolean", "Send one last chunk with `usage` and no "
                                                   "choices before [DONE].", nullable=True, default=False)}),
        "Message": _obj({"role": role,
                         "content": {"anyOf": [{"type": "string"}, array(content_part), {"type": "null"}]},
                         "name": _t("string", nullable=True),
                         "tool_calls": _maybe(array(tool_call), "An assistant's earlier calls (a follow-up "
                                                                "turn)."),
                         "tool_call_id": _t("string", "The call a `tool` message answers.", nullable=True)},
                        ("role",)),
        "ChatRequest": _obj({
            **_openai_common(model_id),
            "messages": array(ref("Message"), "The conversation; rendered with the model's chat "
                               "template.", minItems=1),
            "max_completion_tokens": _t("integer", "Alias of max_tokens.", nullable=True, minimum=1),
            "logprobs": _t("boolean", "Return the logprob of each output token.", nullable=True),
            "top_logprobs": _t("integer", "Also the n most likely alternatives per token (at most "
                               "--max-top-n-tokens); needs logprobs true.", nullable=True, minimum=0),
            "tools": _maybe(array(tool), "Functions the model may call; its calls always parse and their "
                                         "arguments validate against `parameters`."),
            "tool_choice": {"description": "`auto` (default: answer in text or call tools), `none`, "
                                           "`required`, or {\"type\": \"function\", \"function\": "
                                           "{\"name\": ...}} (or the bare name) for that function.",
                            "anyOf": [{"type": "string"}, {"type": "object"}, {"type": "null"}]},
            "parallel_tool_calls": _t("boolean", "Allow several calls in one answer.", nullable=True,
                                      default=True),
            "tool_prompt": _t("string", "The instruction appended with the tools (TGI's; default: llmbus's).",
                              nullable=True),
            "response_format": {"description": "`{\"type\": \"json_object\"}`, OpenAI's `{\"type\": "
                                               "\"json_schema\", \"json_schema\": {\"name\", \"schema\"}}`, "
                                               "or TGI's GrammarType shapes (with `value`).",
                                "type": ["object", "null"]},
            "chat_template_kwargs": CHAT_TEMPLATE_KWARGS,
            "reasoning_effort": _t("string", EFFORT_NOTE + THINKING_SWITCH_NOTE, nullable=True,
                                   enum=[*EFFORTS, None]),
        }, ("messages",), example={"model": model_id, "max_tokens": 20,
                                   "messages": [{"role": "user", "content": "What is deep learning?"}]}),
        "CompletionRequest": _obj({
            **_openai_common(model_id),
            "prompt": _completion_prompt(),
            "max_tokens": _t("integer", "Most tokens to generate.", nullable=True, minimum=1, default=16),
            "logprobs": _t("integer", "Return each token's logprob and this many most likely alternatives "
                           "(at most --max-top-n-tokens).", nullable=True, minimum=0),
            "echo": _t("boolean", "Put the prompt in front of the completion text.", nullable=True,
                       default=False),
            "best_of": _t("integer", "Accepted only equal to n: choosing among extra samples is not "
                          "supported.", nullable=True, minimum=1),
        }, ("prompt",), example={"model": model_id, "prompt": "What is deep learning?", "max_tokens": 20}),
        "Usage": _obj({**{k: _t("integer", minimum=0) for k in ("prompt_tokens", "completion_tokens",
                                                                 "total_tokens")},
                       "prompt_tokens_details": _obj({"cached_tokens": _t(
                           "integer", "Prompt tokens the prefix cache held (a prompt of n choices: what it held "
                                      "for each).", minimum=0)}, ("cached_tokens",))},
                      ("prompt_tokens", "completion_tokens", "total_tokens")),
        "ChatLogprobs": _obj({"content": array(_obj({
            "token": _t("string"), "logprob": _t("number"), "top_logprobs": array(top)},
            ("token", "logprob")))}, ("content",)),
        "CompletionLogprobs": _obj({
            "tokens": array({"type": "string"}),
            "token_logprobs": array({"type": ["number", "null"]}),
            "top_logprobs": array({"anyOf": [{"type": "object",
                                               "additionalProperties": {"type": "number"}},
                                              {"type": "null"}]}),
            "text_offset": array({"type": "integer"})}, description="OpenAI's legacy logprobs layout."),
        "ChatCompletion": _openai_envelope("chat.completion", _obj({
            "index": _t("integer", minimum=0),
            "message": _obj({"role": _t("string", const="assistant"),
                             "content": _t("string", nullable=True), "tool_calls": array(tool_call),
                             "reasoning_content": _t("string", "A reasoning model's thinking section (its "
                                                     "template's markers), apart from the answer.",
                                                     nullable=True)},
                            ("role", "content")),
            "logprobs": choice_logprobs, "finish_reason": finish},
            ("index", "message", "finish_reason")), usage_nullable=False),
        "ChatCompletionChunk": _openai_envelope("chat.completion.chunk", _obj({
            "index": _t("integer", minimum=0),
            "delta": _obj({"role": _t("string"), "content": _t("string", nullable=True),
                           "tool_calls": array(tool_call_delta), "reasoning_content": _t("string")}),
            "logprobs": choice_logprobs, "finish_reason": finish},
            ("index", "delta", "finish_reason")), usage_nullable=True),
        "Completion": _openai_envelope("text_completion",
                                       _obj(text_choice, ("index", "text", "finish_reason")),
                                       usage_nullable=False),
        "CompletionChunk": _openai_envelope("text_completion", _obj(text_choice, ("index", "text")),
                                            usage_nullable=True),
        "Model": _obj({"id": _t("string"), "object": _t("string", const="model"),
                       "created": _t("integer"), "owned_by": _t("string"),
                       "max_model_len": _t("integer", "The most tokens a request may hold, prompt and answer "
                                           "(--max-total-tokens; vLLM's field).", minimum=1),
                       "parent": _t("string", "A LoRA adapter's base model.")},
                      ("id", "object", "created", "owned_by")),
        "ModelList": _obj({"object": _t("string", const="list"), "data": array(ref("Model"))},
                          ("object", "data")),
    }


# ------------------------------------------------------------------------------------------------
# Responses, headers, operations
# ------------------------------------------------------------------------------------------------
