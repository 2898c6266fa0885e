"""What a request that leaves a sampling parameter unset samples with.

Five parameters have server-side defaults: ``temperature``, ``top_k``, ``top_p``, ``min_p`` and
``repetition_penalty``. For each, the first of these that says something wins:

1. the request's own value (always: an explicit ``temperature: 1.0`` or ``top_p: 1.0`` is kept as sent);
2. the server's flag (``--default-temperature``, ``--default-top-k``, ``--default-top-p``,
   ``--default-min-p``, ``--default-repetition-penalty``);
3. the model's ``generation_config.json`` (``--generation-config auto``, the default; ``none`` ignores the
   file; a folder reads that folder's file instead), the values its authors ship, as vLLM reads them;
4. the API's own default: OpenAI's temperature 1 over the whole vocabulary, TGI's parameters unset.

Only requests that sample get them; a greedy request is left exactly greedy. On TGI's routes a request
samples when it says so (``do_sample``, or any of ``temperature``, ``top_k``, ``top_p``, ``typical_p``,
``min_p``; a body without ``parameters`` samples, TGI's quirk). On the OpenAI routes ``temperature: 0`` is
greedy and a positive temperature samples; a request that sets no temperature samples, unless the default
decoding is greedy and it sets no other sampling parameter (top_p < 1, top_k > 0, min_p > 0). The default
decoding is greedy when the default temperature is 0, or when the model's file says ``do_sample: false``
(transformers' ``generate`` is greedy then too, and takes the temperature and top_p only when asked to
sample) and no --default-temperature says otherwise. TGI's routes cannot take a default temperature of 0 (a
request that samples there needs a positive one): they ignore it, and sample at TGI's 1.0.

A value the model's file gets wrong (a negative temperature, a ``top_p`` above 1) is left out with a
warning at startup rather than refusing to serve the model; a flag's bounds are checked like every setting's.
The effective defaults, and where each came from, are in the startup log (``sampling defaults``); /info's
``sampling_defaults`` shows them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import structlog

from llmbus.frontend.validation import GenerateParameters

log = structlog.get_logger("llmbus.frontend")

NAMES = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")
GENERATION_CONFIG = "generation_config.json"


def _problem(name: str, value) -> str | None:
    """What is wrong with ``value`` as the default of ``name``, or None."""
    if name == "top_k":
        if isinstance(value, bool) or not isinstance(value, int):
            return "must be an integer"
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return "must be a number"
    if name == "temperature" and value < 0:
        return "must be >= 0"
    if name == "top_p" and not 0 < value <= 1:
        return "must be > 0 and <= 1"
    if name == "min_p" and not 0 <= value <= 1:
        return "must be >= 0 and <= 1"
    if name == "repetition_penalty" and not value > 0:
        return "must be > 0"
    return None


@dataclass(frozen=True)
class SamplingDefaults:
    """The effective defaults (None: the API's own) and where each came from."""

    temperature: float | None = None  # 0: greedy unless the request sets one (OpenAI routes)
    top_k: int | None = None  # 0 or less: off
    top_p: float | None = None  # 1: off
    min_p: float | None = None  # 0: off
    repetition_penalty: float | None = None  # 1: off
    do_sample: bool | None = None  # False: OpenAI requests that ask for no sampling are greedy
    sources: dict[str, str] = field(default_factory=dict)

    @property
    def greedy(self) -> bool:
        """Whether a request that sets no temperature and no other sampling parameter decodes greedily
        (OpenAI routes; TGI's decide by their own rule)."""
        return self.do_sample is False or self.temperature == 0

    def values(self) -> dict[str, float | int | bool]:
        """The defaults that are set, by name (what /info shows)."""
        return {name: getattr(self, name) for name in ("do_sample", *NAMES) if getattr(self, name) is not None}

    def fill_tgi(self, p: GenerateParameters) -> GenerateParameters:
        """``p`` (TGI's parameters, as parsed) with the defaults in the fields it left unset, if it samples;
        a greedy request is returned as it is. Only values that change the distribution are added, each
        within TGI's bounds: a default top_p of 1 or top_k of 0 adds nothing, which TGI's rules would refuse."""
        if not (p.do_sample or p.temperature is not None or p.top_k is not None or p.top_p is not None
                or p.typical_p is not None or p.min_p is not None):
            return p
        fills = {}
        if p.temperature is None and self.temperature:
            fills["temperature"] = float(self.temperature)
        if p.top_k is None and self.top_k is not None and self.top_k > 0:
            fills["top_k"] = self.top_k
        if p.top_p is None and self.top_p is not None and self.top_p < 1.0:
            fills["top_p"] = float(self.top_p)
        if p.min_p is None and self.min_p:
            fills["min_p"] = float(self.min_p)
        if p.repetition_penalty is None and self.repetition_penalty not in (None, 1.0):
            fills["repetition_penalty"] = float(self.repetition_penalty)
        return replace(p, **fills) if fills else p

    def log_line(self) -> None:
        log.info("sampling defaults", **{name: value for name, value in self.values().items()},
                 source=dict(self.sources) or "none: each API's own")


def read_generation_config(folder: str | Path) -> dict:
    """``generation_config.json`` of ``folder`` ({} when there is none or it is not a JSON object)."""
    path = Path(folder) / GENERATION_CONFIG
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        log.warning("generation config unreadable: no sampling defaults from it", path=str(path), error=str(e))
        return {}
    return data if isinstance(data, dict) else {}


def resolve_sampling_defaults(model_dir: str | Path, generation_config: str,
                              flags: dict[str, float | int | None]) -> SamplingDefaults:
    """The defaults from the flags (``flags[name]``, None where not given) over the generation config that
    ``generation_config`` names: ``auto`` (``model_dir``'s), ``none``, or a folder."""
    values: dict[str, float | int] = {}
    sources: dict[str, str] = {}
    if generation_config != "none":
        folder = Path(model_dir) if generation_config == "auto" else Path(generation_config)
        source = str(folder / GENERATION_CONFIG)
        config = read_generation_config(folder)
        for name in NAMES:
            value = config.get(name)
            if value is None:
                continue
            if name == "top_k" and isinstance(value, float) and value.is_integer():
                value = int(value)
            problem = _problem(name, value)
            if problem is not None:
                log.warning("generation config value ignored", path=source, name=name, value=value,
                            reason=f"{name} {problem}")
                continue
            values[name], sources[name] = value, source
        if isinstance(config.get("do_sample"), bool):
            values["do_sample"], sources["do_sample"] = config["do_sample"], source
    for name in NAMES:
        if flags.get(name) is not None:
            values[name], sources[name] = flags[name], "--default-" + name.replace("_", "-")
    if flags.get("temperature") is not None:  # a default temperature says whether to sample by default
        values["do_sample"], sources["do_sample"] = flags["temperature"] > 0, "--default-temperature"
    return SamplingDefaults(**values, sources=sources)
