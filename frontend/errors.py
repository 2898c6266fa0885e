"""Every error the frontend answers with: one table from kind to HTTP status, error_type and TGI's text.

The body is always ``{"error": "<text>", "error_type": "<type>"}`` (TGI's ``ErrorResponse``). On the
streaming routes the same body travels in-band as an SSE event with HTTP 200.
"""

from __future__ import annotations

import enum


class ErrorKind(enum.Enum):
    VALIDATION = "validation"  # a rule of validation.py
    BODY = "body"  # the body is not JSON, or not a GenerateRequest
    OVERLOADED = "overloaded"  # max_concurrent_requests in flight
    GENERATION = "generation"  # the engine failed the request, or died
    INCOMPLETE = "incomplete_generation"  # the engine ended a request without a finish reason
    INCOMPLETE_STREAM = "incomplete_generation_stream"
    UNHEALTHY = "healthcheck"  # /health when the engine is gone
    UNAUTHORIZED = "unauthorized"  # --api-key set and the Bearer token is missing or wrong
    TEMPLATE = "template_error"  # no chat template, or the template failed on these messages
    TOOL = "tool_error"  # tools asked for, which need constrained decoding
    BATCH_SIZE = "batch size exceeded"  # more prompts (x choices) than --max-client-batch-size
    SUFFIX = "suffix not supported"  # /v1/completions with a suffix
    PAYLOAD_TOO_LARGE = "payload_too_large"  # a body over --payload-limit
    SHUTTING_DOWN = "shutting_down"  # SIGTERM: no new requests; or one still running when the drain ended
    NOT_FOUND = "not_found"  # /v1/responses/{id}: no such response in this frontend's store
    UNSUPPORTED = "unsupported"  # a feature OpenAI has that llmbus refuses outright (built-in tools)
    INTERNAL = "internal"  # a bug: a handler raised what it should not (logged with its traceback)


# kind -> (HTTP status, error_type, text; "{}" takes the detail)
ERROR_TABLE: dict[ErrorKind, tuple[int, str, str]] = {
    ErrorKind.VALIDATION: (422, "validation", "Input validation error: {}"),
    ErrorKind.BODY: (422, "validation", "{}"),
    ErrorKind.OVERLOADED: (429, "overloaded", "Model is overloaded"),
    ErrorKind.GENERATION: (424, "generation", "Request failed during generation: {}"),
    ErrorKind.INCOMPLETE: (500, "incomplete_generation", "Incomplete generation"),
    ErrorKind.INCOMPLETE_STREAM: (500, "incomplete_generation_stream", "Incomplete generation stream"),
    ErrorKind.UNHEALTHY: (503, "healthcheck", "unhealthy"),
    ErrorKind.UNAUTHORIZED: (401, "unauthorized", "Unauthorized"),
    ErrorKind.TEMPLATE: (422, "template_error", "Template error: {}"),
    ErrorKind.TOOL: (422, "tool_error", "Tool error: {}"),
    ErrorKind.BATCH_SIZE: (422, "batch size exceeded",
                           "Number of prompts exceeds the maximum allowed batch size of {}"),
    ErrorKind.SUFFIX: (422, "suffix not supported",
                       "Suffix is not supported and can be achieved by preprocessing the prompt."),
    ErrorKind.PAYLOAD_TOO_LARGE: (413, "payload_too_large", "Failed to buffer the request body: {}"),
    ErrorKind.SHUTTING_DOWN: (503, "shutting_down", "The server is shutting down"),
    ErrorKind.NOT_FOUND: (404, "not_found", "{}"),
    ErrorKind.UNSUPPORTED: (400, "unsupported", "{}"),
    ErrorKind.INTERNAL: (500, "internal", "Internal server error"),
}

# OpenAI's error.type for the kinds (the routes under /v1 answer in OpenAI's envelope)
OPENAI_TYPES: dict[ErrorKind, str] = {
    ErrorKind.VALIDATION: "invalid_request_error", ErrorKind.BODY: "invalid_request_error",
    ErrorKind.TEMPLATE: "invalid_request_error", ErrorKind.TOOL: "invalid_request_error",
    ErrorKind.BATCH_SIZE: "invalid_request_error", ErrorKind.SUFFIX: "invalid_request_error",
    ErrorKind.PAYLOAD_TOO_LARGE: "invalid_request_error", ErrorKind.UNAUTHORIZED: "authentication_error",
    ErrorKind.OVERLOADED: "rate_limit_error", ErrorKind.SHUTTING_DOWN: "service_unavailable",
    ErrorKind.NOT_FOUND: "invalid_request_error", ErrorKind.UNSUPPORTED: "invalid_request_error",
}

# Anthropic's (HTTP status, error.type) for the kinds, on /v1/messages: Anthropic's API answers every bad
# request with 400 invalid_request_error (not TGI's 422), and its SDK raises a typed error per status
ANTHROPIC_ERRORS: dict[ErrorKind, tuple[int, str]] = {
    ErrorKind.VALIDATION: (400, "invalid_request_error"), ErrorKind.BODY: (400, "invalid_request_error"),
    ErrorKind.TEMPLATE: (400, "invalid_request_error"), ErrorKind.TOOL: (400, "invalid_request_error"),
    ErrorKind.BATCH_SIZE: (400, "invalid_request_error"), ErrorKind.SUFFIX: (400, "invalid_request_error"),
    ErrorKind.UNSUPPORTED: (400, "invalid_request_error"),
    ErrorKind.PAYLOAD_TOO_LARGE: (413, "request_too_large"), ErrorKind.UNAUTHORIZED: (401, "authentication_error"),
    ErrorKind.NOT_FOUND: (404, "not_found_error"), ErrorKind.OVERLOADED: (429, "rate_limit_error"),
    # Anthropic's "try again later" (the SDKs retry it), as TGI's 503 is for its clients
    ErrorKind.SHUTTING_DOWN: (529, "overloaded_error"), ErrorKind.UNHEALTHY: (529, "overloaded_error"),
}
ANTHROPIC_SERVER_ERROR = (500, "api_error")  # the engine's failures

# error_type strings the scheduler may put in RequestFailed, mapped back to a kind
_BY_ERROR_TYPE = {error_type: kind for kind, (_, error_type, _) in ERROR_TABLE.items()
                  if kind is not ErrorKind.BODY}


class ApiError(Exception):
    """An error answer. ``detail`` fills the "{}" of the kind's text."""

    def __init__(self, kind: ErrorKind, detail: str = "", *, param: str | None = None):
        status, error_type, template = ERROR_TABLE[kind]
        self.kind = kind
        self.param = param  # the request field at fault, when known (OpenAI's error.param)
        self.status = status
        self.error_type = error_type
        self.message = template.format(detail) if "{}" in template else template
        super().__init__(self.message)

    def at(self, where: str) -> "ApiError":
        """This error, its text naming ``where`` (the part of a request of several it is about)."""
        self.message += f" ({where})"
        return self

    def body(self) -> dict:
        return {"error": self.message, "error_type": self.error_type}

    def openai_body(self) -> dict:
        """OpenAI's envelope; TGI's ``error_type`` rides along at the top so that TGI clients
        (huggingface_hub raises its typed errors from it) still tell the errors apart."""
        return {"error": {"message": self.message, "type": OPENAI_TYPES.get(self.kind, "server_error"),
                          "param": self.param, "code": self.error_type},
                "error_type": self.error_type}

    @property
    def anthropic_status(self) -> int:
        return ANTHROPIC_ERRORS.get(self.kind, ANTHROPIC_SERVER_ERROR)[0]

    def anthropic_body(self) -> dict:
        """Anthropic's envelope: ``{"type": "error", "error": {"type", "message"}}``."""
        return {"type": "error", "error": {"type": ANTHROPIC_ERRORS.get(self.kind, ANTHROPIC_SERVER_ERROR)[1],
                                           "message": self.message}}


def validation_error(detail: str, param: str | None = None) -> ApiError:
    return ApiError(ErrorKind.VALIDATION, detail, param=param)


def body_parse_error(detail: str) -> ApiError:
    return ApiError(ErrorKind.BODY, f"Failed to parse the request body as JSON: {detail}")


def body_type_error(detail: str) -> ApiError:
    return ApiError(ErrorKind.BODY, f"Failed to deserialize the JSON body into the target type: {detail}")


def generation_error(reason: str) -> ApiError:
    return ApiError(ErrorKind.GENERATION, reason)


def engine_error(error_type: str, message: str) -> ApiError:
    """The ApiError for a scheduler's ``RequestFailed(error_type, message)``.

    The message is used as the detail; when the scheduler already wrote TGI's full text (with its
    prefix) it is not prefixed twice. Unknown error types count as generation errors.
    """
    kind = _BY_ERROR_TYPE.get(error_type, ErrorKind.GENERATION)
    template = ERROR_TABLE[kind][2]
    prefix = template.split("{}")[0] if "{}" in template else None
    if prefix and message.startswith(prefix):
        message = message[len(prefix):]
    return ApiError(kind, message)
