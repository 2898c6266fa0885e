"""What more than one service reads from a model folder: its JSON configs, the positions it can embed, the
ids it ends a sequence with, and whether it was made from a GGUF file (and from which).

Pure file reading (json, and ``tokenizers`` to name a token's id): the frontend and the workers both call
it, and neither may import the other (pyproject's import-linter contracts).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from tokenizers import Tokenizer

# In a model folder made from a GGUF (supervisor/gguf_model.py): which file it is, its tensor types.
GGUF_MANIFEST = "gguf.json"


class GGUFError(ValueError):
    """A GGUF file llmbus cannot serve; the message is one line naming the file and the reason."""


_LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length",
                "n_ctx")


def read_config(path: Path) -> dict:
    """A JSON object from a model folder; {} where the file is absent, ValueError where it is unreadable."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None
    return data if isinstance(data, dict) else {}


def config_max_positions(model_config: dict) -> int | None:
    """The positions a model's ``config.json`` says it can embed, whatever its family calls them (a multimodal
    checkpoint's, such as Gemma 3's, in its ``text_config``)."""
    found = next((model_config[k] for k in _LENGTH_KEYS if isinstance(model_config.get(k), int)
                  and not isinstance(model_config[k], bool) and model_config[k] > 0), None)
    text_config = model_config.get("text_config")
    return config_max_positions(text_config) if found is None and isinstance(text_config, dict) else found


def token_content(value) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _as_id_list(value) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def eos_token_ids(model_dir: str | Path, tokenizer: Tokenizer) -> list[int]:
    """Every id that ends a sequence: ``generation_config.json``'s ``eos_token_id`` (an int or a list) and
    ``tokenizer_config.json``'s ``eos_token``, else ``config.json``'s ``eos_token_id``. The scheduler stops
    on any of them, and a finished grammar allows each."""
    model_dir = Path(model_dir)
    eos: list[int] = []
    for token_id in _as_id_list(read_config(model_dir / "generation_config.json").get("eos_token_id")):
        if token_id not in eos:
            eos.append(token_id)
    eos_text = token_content(read_config(model_dir / "tokenizer_config.json").get("eos_token"))
    if eos_text is not None:
        token_id = tokenizer.token_to_id(eos_text)
        if token_id is not None and token_id not in eos:
            eos.append(token_id)
    return eos or _as_id_list(read_config(model_dir / "config.json").get("eos_token_id"))


def lone_safetensors(model_dir: str | Path) -> list[str]:
    """The weight files of a folder that has neither ``model.safetensors`` nor its index: older uploads (GPTQ's
    among them) name their one file freely, ``gptq_model-4bit-128g.safetensors``, and TGI reads any. Not a
    LoRA adapter's file, Mistral's ``consolidated`` format (other tensor names), nor shards ``*-of-*`` without
    their index (a set cut short)."""
    return sorted(p.name for p in Path(model_dir).glob("*.safetensors")
                  if p.name != "adapter_model.safetensors" and not p.name.startswith("consolidated")
                  and not re.search(r"-\d+-of-\d+\.safetensors$", p.name))


def is_gguf_folder(model_dir: str | Path) -> bool:
    return (Path(model_dir) / GGUF_MANIFEST).is_file()


def gguf_source(model_dir: str | Path) -> dict:
    """The manifest of a folder made from a GGUF: ``path`` of the file, its ``file_type``, tensor types."""
    return json.loads((Path(model_dir) / GGUF_MANIFEST).read_text())


def lora_entries(text: str | None) -> list[tuple[str, str]]:
    """``--lora-adapters`` (TGI's form, comma-separated: ``id[@revision]`` or ``name=path``) as ``(name,
    source)`` pairs: a ``name=path`` entry is served as ``name``, an ``id[@revision]`` as its id, and its
    source keeps the revision. The workers get the resolved form, ``name=folder``, which reads the same
    way. ValueError names a malformed entry (TGI's message) or a name given twice."""
    entries: list[tuple[str, str]] = []
    for raw in (text or "").split(","):
        entry = raw.strip()
        if not entry:
            continue
        name, eq, source = entry.partition("=")
        name, source = (name.strip(), source.strip()) if eq else (entry.split("@", 1)[0], entry)
        if not name or not source or entry.count("@") > 1:
            raise ValueError(f"Invalid LoRA adapter format: {entry}")
        if any(name == seen for seen, _ in entries):
            raise ValueError(f"LoRA adapter name `{name}` is given twice in --lora-adapters")
        entries.append((name, source))
    return entries


# TGI's --rope-scaling kinds (its ROPE_SCALING variable); --rope-factor (ROPE_FACTOR) goes with them.
ROPE_SCALINGS = ("linear", "dynamic")


def rope_override(scaling: str | None, factor: float | None) -> tuple[str, float] | None:
    """``--rope-scaling`` and ``--rope-factor`` as one (kind, factor), paired as TGI's launcher pairs them: a
    kind alone scales by 1.0, a factor alone is linear; None where neither is given."""
    if scaling is None and factor is None:
        return None
    return (scaling or "linear", 1.0 if factor is None else float(factor))


def with_rope_override(config: dict, override: tuple[str, float] | None) -> dict:
    """``config.json`` as the model runs under ``--rope-scaling``/``--rope-factor``: its RoPE scaling replaced
    by the override (the base frequency and partial rotation kept), as TGI's shards replace it. Configs of
    transformers 5 (``rope_parameters``, per layer kind for Gemma 3: its full-attention layers take it) and of
    transformers 4 (``rope_theta`` + ``rope_scaling``) alike, a multimodal one's in its ``text_config``.

    Linear scaling also stretches ``max_position_embeddings`` by its factor: it does not read it (so the
    rotation is unchanged), and the model then embeds the positions the factor was asked for. Dynamic NTK
    reads it as the trained length it grows the base past, so it stays, and the model's own reading
    (``workers/models/rotary.py``) stretches its reach; either way ``rope_positions`` is what is served."""
    if override is None:
        return config
    kind, factor = override
    out = dict(config)
    if isinstance(out.get("text_config"), dict):
        out["text_config"] = with_rope_override(out["text_config"], override)
        return out
    scaling = {"rope_type": kind, "factor": factor}
    params = out.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):  # per layer kind
        kept = {k: v for k, v in params["full_attention"].items() if k in ("rope_theta", "partial_rotary_factor")}
        out["rope_parameters"] = {**params, "full_attention": {**kept, **scaling}}
    elif isinstance(params, dict):
        kept = {k: v for k, v in params.items() if k in ("rope_theta", "partial_rotary_factor")}
        out["rope_parameters"] = {**kept, **scaling}
    else:
        out["rope_scaling"] = scaling
    if kind == "linear" and isinstance(out.get("max_position_embeddings"), int):
        out["max_position_embeddings"] = int(out["max_position_embeddings"] * factor)
    return out


def rope_positions(config: dict, override: tuple[str, float] | None) -> int | None:
    """The positions a model embeds: ``config.json``'s (``config_max_positions``), times the factor of a
    ``--rope-scaling``/``--rope-factor`` override, or as far as the config's own RoPE scaling reaches
    (``scaled_positions``)."""
    positions = config_max_positions(config)
    if positions is None:
        return None
    if override is not None:
        return int(positions * override[1])
    return scaled_positions(config_rope_scaling(config), positions)


def config_rope_scaling(config: dict) -> dict:
    """A config's RoPE scaling: transformers 5's ``rope_parameters`` (its full-attention layers' where they are
    per layer kind) or an older ``rope_scaling``, a multimodal config's in its ``text_config``; {} for none."""
    text_config = config.get("text_config")
    rope = text_config if isinstance(text_config, dict) and not any(k in config for k in _LENGTH_KEYS) else config
    scaling = rope.get("rope_parameters") or rope.get("rope_scaling") or {}
    if isinstance(scaling, dict) and isinstance(scaling.get("full_attention"), dict):  # per layer kind
        scaling = scaling["full_attention"]
    return scaling if isinstance(scaling, dict) else {}


def scaled_positions(scaling: dict, max_position_embeddings: int) -> int:
    """How far a RoPE scaling (a config's ``rope_parameters``/``rope_scaling``) stretches a model's positions:
    dynamic NTK reads ``max_position_embeddings`` as the trained length it grows the base past, to the factor
    times it; YaRN reaches its original length times the factor, where the config still says the original
    (Qwen's instructions add the scaling and leave it). Others embed what the config says."""
    kind = scaling.get("rope_type", scaling.get("type"))
    factor = scaling.get("factor")
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor <= 1:
        return max_position_embeddings
    if kind == "dynamic":
        return int(max_position_embeddings * factor)
    if kind == "yarn":
        original = scaling.get("original_max_position_embeddings")
        original = original if isinstance(original, int) and not isinstance(original, bool) else max_position_embeddings
        return max(max_position_embeddings, int(original * factor))
    return max_position_embeddings
