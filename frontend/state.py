"""What every route handler shares: the frontend's state, kept on the aiohttp app under ``STATE``."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from importlib import metadata

from aiohttp import web
from prometheus_client import CollectorRegistry

from llmbus.bus.model_files import gguf_source, is_gguf_folder
from llmbus.bus.prequantized import checkpoint_quantization
from llmbus.frontend.chat import ChatTemplate
from llmbus.frontend.config import FrontendConfig, Limits
from llmbus.frontend.engine_client import EngineClient
from llmbus.frontend.generation import Generator
from llmbus.frontend.metrics import make_registry
from llmbus.frontend.request_metrics import RequestMetrics
from llmbus.frontend.responses import dumps
from llmbus.frontend.sampling_defaults import SamplingDefaults, resolve_sampling_defaults
from llmbus.frontend.tokenizer import ModelTokenizer
from llmbus.frontend.vision_models import VisionSpec, vision_spec

try:
    VERSION = metadata.version("llmbus")
except metadata.PackageNotFoundError:  # running from a source tree
    VERSION = "0.0.0"


@dataclass
class FrontendState:
    config: FrontendConfig
    tokenizer: ModelTokenizer
    engine: EngineClient | None = None
    generator: Generator | None = None
    limits: Limits | None = None
    metrics: CollectorRegistry = field(init=False)
    request_metrics: RequestMetrics = field(init=False)
    chat_template: ChatTemplate = field(init=False)
    sampling_defaults: SamplingDefaults = field(init=False)
    vision: VisionSpec | None = field(init=False)  # how the model reads images; None: a text model

    def __post_init__(self) -> None:
        self.request_metrics = RequestMetrics(
            peers=lambda: self.engine.peer_stats.values() if self.engine is not None else ())
        self.metrics = make_registry(lambda: self.engine.stats if self.engine is not None else None,
                                     self.request_metrics)
        self.chat_template = ChatTemplate(self.config.model_dir, self.config.tokenizer_config_path)
        # a vision model whose image tokens cannot be counted fails the start here, with the reason
        self.vision = vision_spec(self.config.model_dir, self.tokenizer.tokenizer)
        c = self.config
        self.sampling_defaults = resolve_sampling_defaults(c.model_dir, c.generation_config, {
            "temperature": c.default_temperature, "top_k": c.default_top_k, "top_p": c.default_top_p,
            "min_p": c.default_min_p, "repetition_penalty": c.default_repetition_penalty})

    def answering_model(self, gen) -> str:
        """The ``model`` an answer names: the LoRA adapter a generation computed with, else the served model."""
        return gen.prepared.params.adapter or self.config.model_id

    @property
    def system_fingerprint(self) -> str:
        return f"{VERSION}-native"  # TGI's form: version, then the docker label or "native"

    @cached_property
    def quantization(self) -> str | None:
        """/info's ``quantize``: ``--quantize``'s method, else a checkpoint's own (gptq, awq: TGI's launcher
        reads it from the config), and for a GGUF file "gguf:" and its main quantized tensor type (what a
        GGUF's file name usually says: Q4_1, Q8_0, Q4_K, ...)."""
        if not is_gguf_folder(self.config.model_dir):
            try:
                published = checkpoint_quantization(self.config.model_dir)
            except ValueError:  # the workers refuse such a checkpoint with the reason
                published = None
            return self.config.quantize or (published and published.method)
        types = gguf_source(self.config.model_dir)["tensor_types"]
        quantized = {t: n for t, n in types.items() if t not in ("F32", "F16", "BF16")} or types
        main = "gguf:" + max(quantized, key=quantized.get)
        return f"{main}+{self.config.quantize}" if self.config.quantize else main

    @property
    def compat_return_full_text(self) -> bool:
        # TGI: POST / returns the prompt too unless the hub pipeline tag says otherwise
        tag = self.config.model_pipeline_tag
        return tag is None or tag == "text-generation"


STATE = web.AppKey("llmbus_frontend_state", FrontendState)


def json_response(body, status: int = 200, headers: dict | None = None) -> web.Response:
    return web.Response(body=dumps(body), status=status, headers=headers, content_type="application/json")
