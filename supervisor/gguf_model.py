"""A GGUF file as a model folder the rest of llmbus reads like any other.

A GGUF holds the config, the tokenizer, the chat template and the weights in one file. The frontend needs
a ``tokenizers`` tokenizer and the chat template, the supervisor the config's limits, the workers the
weights: so the file's metadata is turned once into ``config.json``, ``generation_config.json``,
``tokenizer.json``, ``tokenizer_config.json`` and ``chat_template.jinja`` in a folder under
``~/.cache/llmbus/gguf/`` (keyed by the file's path, size and modification time, written to a temporary
folder and renamed, so a half-written folder is never used), plus ``gguf.json`` naming the file. The
weights stay in the GGUF: ``workers/gguf_checkpoint.py`` reads them from there by their Hugging Face names.

The config and tokenizer come from transformers' own GGUF reading (built on the ``gguf`` package), which
also makes them what ``from_pretrained(dir, gguf_file=...)`` gives, the reference the tests compare
against. What transformers would accept but llmbus cannot run (another architecture, a tensor type
without a dequantizer here) is refused first, in one line naming it. One thing transformers' reading drops
is taken from the file as llama.cpp takes it: RoPE frequency scaling (Llama 3.1/3.2's per-frequency
factors in ``rope_freqs.weight``, or ``rope.scaling.*`` metadata), without which such a model would run
with unscaled rotations. So are the hyperparameters it leaves at its config classes' defaults for the
newer families: Qwen3-MoE's expert width, Phi-3's rotated share of a head, Gemma 3's query scale
(``_read_what_transformers_drops``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np

from llmbus.bus.model_files import GGUF_MANIFEST, GGUFError, gguf_source, is_gguf_folder

# workers.gguf_checkpoint (the file's reader) imports torch, 2 s of CPU: only a folder not yet in the cache
# needs it, so the functions that build one import it, and `llmbus up` on a cached GGUF (the default model,
# every start after the first) does without.

CACHE_ROOT = Path(os.environ.get("LLMBUS_CACHE", Path.home() / ".cache" / "llmbus")) / "gguf"
FORMAT_VERSION = 2  # bump when the folder's contents change, so older caches are rebuilt
# Tokens that end an assistant turn in the chat formats GGUF files carry; llama.cpp stops on them too even
# where the file's eos id names another token (SmolLM2's says <|im_start|>).
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>")


def materialize(gguf_path: str | Path, cache_root: Path | None = None) -> Path:
    """The model folder for ``gguf_path``, built on first use. Raises GGUFError for a file llmbus
    cannot serve (corrupt, truncated, another architecture, an unknown tensor type)."""
    path = Path(gguf_path).expanduser().resolve()
    if not path.is_file():
        raise GGUFError(f"{path}: no such GGUF file")
    stat = path.stat()
    key = hashlib.sha256(f"{FORMAT_VERSION}:{path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    root = cache_root or CACHE_ROOT
    folder = root / f"{path.stem}-{key}"
    if (folder / GGUF_MANIFEST).is_file():
        return folder
    from llmbus.workers.gguf_checkpoint import check_servable, open_gguf

    reader = open_gguf(path)
    summary = check_servable(reader, path)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{folder.name}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        _write_folder(path, tmp, summary, reader)
        try:
            tmp.rename(folder)
        except OSError:  # another process finished the same folder first
            if not (folder / GGUF_MANIFEST).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _write_folder(path: Path, out: Path, summary: dict, reader) -> None:
    import transformers
    from transformers import AutoConfig, AutoTokenizer

    transformers.logging.set_verbosity_error()  # its GGUF loader narrates every tensor
    try:
        with _parsed_once(path, _FieldsHidden(reader, _MISREAD_FIELDS.get(summary["architecture"], ()))):
            config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except (ValueError, KeyError, OSError) as e:
        raise GGUFError(f"{path}: transformers cannot read its config or tokenizer: {e}") from None
    config_dict = config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict["architectures"] = [_causal_lm_class(config_dict["model_type"])]
    if summary["tied"]:
        config_dict["tie_word_embeddings"] = True
    _read_what_transformers_drops(reader, summary["architecture"], config_dict)
    scaling = _rope_scaling(reader, path, summary["architecture"], config_dict)
    rope = config_dict.get("rope_parameters") or {"rope_theta": config_dict.get("rope_theta", 10000.0)}
    if scaling is not None and "full_attention" in rope:  # Gemma 3: the file's scaling is its global layers'
        config_dict["rope_parameters"] = {**rope, "full_attention": {**rope["full_attention"], **scaling}}
    elif scaling is not None:
        # llama.py reads rope_parameters first (transformers 5's key) and rope_scaling otherwise
        config_dict["rope_parameters"] = {"rope_theta": rope.get("rope_theta", 10000.0), **scaling}
        config_dict["rope_scaling"] = scaling
    (out / "config.json").write_text(json.dumps(config_dict, indent=2))
    tokenizer.save_pretrained(str(out))
    eos = _eos_ids(summary, config_dict, tokenizer)
    generation = {"bos_token_id": config_dict.get("bos_token_id"), "eos_token_id": eos}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    manifest = {"format": FORMAT_VERSION, "path": str(path), "size": path.stat().st_size,
                "architecture": summary["architecture"], "file_type": summary["file_type"],
                "tensor_types": summary["tensor_types"]}
    (out / GGUF_MANIFEST).write_text(json.dumps(manifest, indent=2))


# Metadata transformers' GGUF reading gets wrong, hidden from it (the folder reads them itself): transformers 5's
# gpt-oss code takes a rope.scaling field's first part (the key's length) for its value, and fails on it.
_MISREAD_FIELDS = {"gpt-oss": ("gpt-oss.rope.scaling.",)}


class _FieldsHidden:
    """``reader`` with the metadata fields whose names start with one of ``prefixes`` left out."""

    def __init__(self, reader, prefixes: tuple[str, ...]):
        self._reader = reader
        self.fields = {k: v for k, v in reader.fields.items() if not (prefixes and k.startswith(prefixes))}

    def __getattr__(self, name: str):
        return getattr(self._reader, name)


@contextlib.contextmanager
def _parsed_once(path: Path, reader):
    """transformers parses the file afresh for the config and again for the tokenizer, each as long as our
    own parse (design notes, "GGUF"): while the folder is written, opening ``path`` gives the reader already
    made. It is only read from (fields and tensor metadata)."""
    import gguf

    opens = gguf.GGUFReader

    def reuse(file_path, *args, **kwargs):
        if not args and not kwargs and Path(file_path).resolve() == path:
            return reader
        return opens(file_path, *args, **kwargs)

    gguf.GGUFReader = reuse
    try:
        yield
    finally:
        gguf.GGUFReader = opens


# The Gemma size llama.cpp scales queries by hidden/heads (the 27Bs, by their layer count: Gemma 2's 46 layers
# give 144, Gemma 3's 62 give 168); every other size by the head width.
_QUERY_SCALE_BY_WIDTH_LAYERS = {"gemma2": 46, "gemma3": 62}


def _read_what_transformers_drops(reader, arch: str, config: dict) -> None:
    """Hyperparameters transformers' reading leaves at its config class's default, as llama.cpp takes them.
    Qwen3-MoE: the expert width (Qwen3MoeConfig's 768 is right for Qwen3-30B-A3B only; transformers' own
    loading of another width fails on the tensors' shapes). Phi-3: the share of each head RoPE turns
    (rope.dimension_count). Gemma 3: the query scale, 1/sqrt(head_dim) except
    for the 62-layer 27B's hidden/heads (168, what its config.json says); Gemma3TextConfig's default is 256.
    Gemma 2: the same query scale (its 27B has 46 layers) and the soft caps. gpt-oss: the head and expert widths
    (key_length, expert_feed_forward_length) and the window."""
    from llmbus.workers.gguf_checkpoint import field_value

    width = field_value(reader, f"{arch}.expert_feed_forward_length") if arch == "qwen3moe" else None
    if width:
        config["moe_intermediate_size"] = int(width)
    rotary = field_value(reader, f"{arch}.rope.dimension_count") if arch == "phi3" else None
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    if rotary and rotary != head_dim:  # Phi-4-mini's RoPE turns 3/4 of each head; transformers' reading, all
        factor = rotary / head_dim
        config["partial_rotary_factor"] = factor
        config["rope_parameters"] = {**(config.get("rope_parameters") or {}), "partial_rotary_factor": factor}
    if arch in _QUERY_SCALE_BY_WIDTH_LAYERS:
        heads = config["num_attention_heads"]
        by_width = config["num_hidden_layers"] == _QUERY_SCALE_BY_WIDTH_LAYERS[arch]
        config["query_pre_attn_scalar"] = config["hidden_size"] // heads if by_width else config["head_dim"]
    if arch == "gemma2":
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            cap = field_value(reader, f"{arch}.{key}")
            if cap is not None:
                config[key] = float(cap)
    if arch == "gpt-oss":  # GptOssConfig's defaults (head 64, experts 2880 wide, window 128) are gpt-oss-20b's
        config["head_dim"] = int(field_value(reader, f"{arch}.attention.key_length") or config["head_dim"])
        width = field_value(reader, f"{arch}.expert_feed_forward_length")
        config["intermediate_size"] = int(width or config["intermediate_size"])
        window = field_value(reader, f"{arch}.attention.sliding_window")  # transformers looks for .sliding_window
        config["sliding_window"] = int(window or config["sliding_window"])


def _rope_scaling(reader, path: Path, arch: str, config: dict) -> dict | None:
    """The file's RoPE frequency scaling as transformers' ``rope_parameters`` (without the theta), or None
    for plain RoPE. GGUFError for a scaling not served from a GGUF: LongRoPE, and YaRN outside gpt-oss (Qwen's
    long-context files take another ``truncate``, and no test file of theirs checks it yet)."""
    from llmbus.workers.gguf_checkpoint import field_value

    if any(t.name in ("rope_factors_long.weight", "rope_factors_short.weight") for t in reader.tensors):
        # Phi-3's long-context files: transformers' reading drops the factors, so no reference runs them
        raise GGUFError(f"{path}: RoPE scaling 'longrope' (rope_factors_long/short tensors) is not supported "
                        f"(supported: linear, llama3)")
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        rope = config.get("rope_parameters") or {}
        theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        return _llama3_scaling(np.asarray(freqs.data, dtype=np.float64).reshape(-1), theta, head_dim, path)
    kind = field_value(reader, f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = field_value(reader, f"{arch}.rope.scaling.factor")
    if kind == "linear" and factor:
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn" and factor and arch == "gpt-oss":
        # gpt-oss's YaRN as its own config.json has it: the file keeps the factor and the trained length; the
        # betas are llama.cpp's defaults where absent, and its frequencies are not truncated (truncate: false)
        beta_fast = field_value(reader, f"{arch}.rope.scaling.yarn_beta_fast") or 32.0
        beta_slow = field_value(reader, f"{arch}.rope.scaling.yarn_beta_slow") or 1.0
        original = field_value(reader, f"{arch}.rope.scaling.original_context_length")
        return {"rope_type": "yarn", "factor": float(factor), "beta_fast": float(beta_fast),
                "beta_slow": float(beta_slow), "truncate": False,
                "original_max_position_embeddings": int(original or config["max_position_embeddings"])}
    raise GGUFError(f"{path}: RoPE scaling {kind!r} is not supported (supported: linear, llama3; yarn in "
                    f"gpt-oss files)")


# Llama 3.1's own values; a file whose factors need others has them recovered from the factors
LLAMA3_DEFAULTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _llama3_scaling(factors: np.ndarray, theta: float, head_dim: int, path: Path) -> dict | None:
    """llama3 RoPE parameters that give ``factors`` (what llama.cpp divides each frequency by: 1 for the
    fast ones, ``factor`` for the slow ones, a smooth blend between), checked by recomputing them."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if factors.shape != inv_freq.shape:
        raise GGUFError(f"{path}: rope_freqs.weight has {factors.size} factors for {inv_freq.size} frequencies")
    factor = float(factors.max())
    if np.allclose(factors, 1.0, rtol=0, atol=1e-6):
        return None
    wavelen = 2 * np.pi / inv_freq
    candidates = [{"factor": factor, **LLAMA3_DEFAULTS}]
    blended = (factors > 1 + 1e-5) & (factors < factor * (1 - 1e-5))
    if blended.sum() >= 2:
        # Between the two bands 1/factor_i = (1 - s)/factor + s with s linear in 1/wavelength: the line's
        # slope and intercept fix the parameters up to a common scale, chosen so low_freq_factor is 1.
        smooth = (1 / factors[blended] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(1 / wavelen[blended], smooth, 1)
        if intercept < 0:
            candidates.append({"factor": factor, "low_freq_factor": 1.0,
                               "high_freq_factor": round(1 - 1 / intercept, 4),
                               "original_max_position_embeddings": int(round(-slope / intercept))})
    for params in candidates:
        if np.allclose(_llama3_factors(wavelen, params), factors, rtol=1e-4, atol=0):
            return {"rope_type": "llama3", **params}
    raise GGUFError(f"{path}: rope_freqs.weight holds RoPE factors that are not a llama3 scaling")


def _llama3_factors(wavelen: np.ndarray, params: dict) -> np.ndarray:
    """What llama.cpp's converter writes to rope_freqs.weight for these llama3 parameters."""
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    context = params["original_max_position_embeddings"]
    smooth = (context / wavelen - low) / (high - low)
    blended = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < context / high, 1.0, np.where(wavelen > context / low, factor, blended))


def _causal_lm_class(model_type: str) -> str:
    return {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "phi3": "Phi3ForCausalLM",
            "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
            "gpt_oss": "GptOssForCausalLM"}[model_type]


def _eos_ids(summary: dict, config: dict, tokenizer) -> list[int]:
    """Every id that ends a generation: the file's eos, the tokenizer's, and the end-of-turn tokens the
    vocabulary has (llama.cpp's rule, since files often name only one of them)."""
    ids = [summary.get("eos_token_id"), config.get("eos_token_id"), tokenizer.eos_token_id]
    vocab = tokenizer.get_vocab()
    ids += [vocab.get(token) for token in END_OF_TURN_TOKENS]
    out: list[int] = []
    for i in ids:
        for j in (i if isinstance(i, list) else [i]):
            # transformers may append a token past the model's vocabulary; the model never produces it
            if isinstance(j, int) and j not in out and j < config["vocab_size"]:
                out.append(j)
    return out


__all__ = ["GGUFError", "gguf_source", "is_gguf_folder", "materialize"]
