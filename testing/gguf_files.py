"""Writing GGUF files for tests with the ``gguf`` package's own writer, from a Llama Hugging Face folder
(the generated demo model): its config as metadata, its byte-level BPE tokenizer and chat template, and
its weights laid out as llama.cpp's converter lays them (query/key rows interleaved per head), the
matrices in the type asked for (F32, F16, BF16, Q8_0, Q4_0, Q4_1, MXFP4 via ``gguf.quants``). gpt-oss's
experts are split as llama.cpp's converter splits them: gate and up apart, each ``[experts, out, in]``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
from pathlib import Path

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file

_LAYER = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
          "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
          "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
          "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
          "mlp.down_proj.weight": "ffn_down.weight",
          "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
          "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
          "self_attn.v_proj.bias": "attn_v.bias"}
_GEMMA_NORMS = {"pre_feedforward_layernorm.weight": "ffn_norm.weight",
                "post_attention_layernorm.weight": "post_attention_norm.weight",
                "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}
# The families whose llama.cpp names differ from a Llama's (gguf.MODEL_TENSORS of each architecture)
_FAMILY_LAYER = {
    "qwen3moe": {"mlp.gate.weight": "ffn_gate_inp.weight"},
    "phi3": {"self_attn.qkv_proj.weight": "attn_qkv.weight", "mlp.gate_up_proj.weight": "ffn_up.weight"},
    "gemma2": _GEMMA_NORMS,
    "gemma3": _GEMMA_NORMS,
    "gpt-oss": {"post_attention_layernorm.weight": "post_attention_norm.weight",
                "self_attn.o_proj.bias": "attn_output.bias", "self_attn.sinks": "attn_sinks.weight",
                "mlp.router.weight": "ffn_gate_inp.weight", "mlp.router.bias": "ffn_gate_inp.bias"},
}
_GPT_OSS_EXPERTS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?")
_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")


def interleave_heads(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's layout of a query/key projection: each head's two rotary halves interleaved by row."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(hf_dir: Path, out: Path, matrix_type: str = "F32", *, architecture: str = "llama",
               overrides: dict | None = None, extra_tensors: dict[str, np.ndarray] | None = None,
               expert_type: str | None = None) -> Path:
    """``hf_dir`` as a GGUF at ``out`` with every 2-D weight stored as ``matrix_type`` (routed experts as
    ``expert_type``, where given); ``overrides`` maps a GGUF tensor name to its type (to mix types, or to name
    one llmbus cannot read); ``extra_tensors`` are added as they are, by their GGUF names (tensors of layouts
    llmbus refuses)."""
    config = json.loads((hf_dir / "config.json").read_text())
    tokenizer = json.loads((hf_dir / "tokenizer.json").read_text())
    tokenizer_config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    weights = _stack_experts(_split_gpt_oss_experts(load_file(str(hf_dir / "model.safetensors"))))
    writer = gguf.GGUFWriter(str(out), architecture)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    rope = config.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)  # Gemma 3: the global layers' base is the file's
    theta = rope.get("rope_theta") or config.get("rope_theta") or 10000.0
    writer.add_name("llmbus test model")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(theta)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_dimension_count(int(head_dim * (rope.get("partial_rotary_factor") or 1.0)))
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if config.get("num_local_experts"):
        writer.add_expert_count(config["num_local_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config.get("moe_intermediate_size", config["intermediate_size"]))
    if architecture in ("gemma2", "gemma3", "gpt-oss"):
        writer.add_sliding_window(config["sliding_window"])
    if architecture == "gemma2":
        writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if rope.get("rope_type") == "yarn":  # as llama.cpp's converter writes it: the factor and the trained length
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    _add_tokenizer(writer, tokenizer, tokenizer_config, config)
    types = overrides or {}
    weights = {**weights, **(extra_tensors or {})}
    for name, tensor in weights.items():
        gguf_name = _gguf_name(name, architecture)
        tensor = tensor.astype(np.float32)
        if architecture in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            tensor = tensor + 1  # llama.cpp's Gemma converters: its norm multiplies by the weight alone
        if name.endswith("q_proj.weight") and architecture == "llama":
            tensor = interleave_heads(tensor, heads)
        if name.endswith("k_proj.weight") and architecture == "llama":
            tensor = interleave_heads(tensor, kv_heads)
        kind = matrix_type if tensor.ndim >= 2 and not gguf_name.endswith(".bias") else "F32"
        if expert_type is not None and gguf_name.endswith("_exps.weight"):
            kind = expert_type
        kind = types.get(gguf_name, kind)
        _add(writer, gguf_name, tensor, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _split_gpt_oss_experts(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """gpt-oss's fused experts (``gate_up_proj [experts, hidden, 2 * width]``, gate in the even columns, and
    ``down_proj [experts, width, hidden]``, with their biases) as llama.cpp stores them: ``ffn_{gate,up,down}
    _exps`` weights ``[experts, out, in]`` and biases ``[experts, out]``. Other weights pass through."""
    out = {}
    for name, tensor in weights.items():
        match = _GPT_OSS_EXPERTS.fullmatch(name)
        if match is None:
            out[name] = tensor
            continue
        layer, stored, bias = match.groups()
        kind = "bias" if bias else "weight"
        if stored == "down_proj":
            out[f"blk.{layer}.ffn_down_exps.{kind}"] = tensor if bias else tensor.transpose(0, 2, 1)
            continue
        for projection, column in (("gate", 0), ("up", 1)):
            part = tensor[..., column::2]
            out[f"blk.{layer}.ffn_{projection}_exps.{kind}"] = np.ascontiguousarray(
                part if bias else part.transpose(0, 2, 1))
    return out


def _stack_experts(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per-expert matrices as llama.cpp stores them: one ``[experts, rows, cols]`` tensor per projection and
    layer, named ``ffn_{gate,up,down}_exps``."""
    out, experts = {}, {}
    for name, tensor in weights.items():
        match = _EXPERT.fullmatch(name)
        if match is None:
            out[name] = tensor
        else:
            layer, expert, projection = match.groups()
            experts.setdefault(f"blk.{layer}.ffn_{projection}_exps.weight", {})[int(expert)] = tensor
    for gguf_name, by_expert in experts.items():
        out[gguf_name] = np.stack([by_expert[e] for e in sorted(by_expert)])
    return out


def _gguf_name(name: str, architecture: str = "llama") -> str:
    if not name.startswith(("model.", "lm_head.")):  # already a GGUF name (stacked experts, extra tensors)
        return name
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    if name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = name.split(".", 3)
    return f"blk.{layer}.{_FAMILY_LAYER.get(architecture, {}).get(rest) or _LAYER[rest]}"


def _add(writer, name: str, tensor: np.ndarray, kind: str) -> None:
    qtype = gguf.GGMLQuantizationType[kind]
    if kind == "F32":
        writer.add_tensor(name, tensor)
    elif kind == "F16":
        writer.add_tensor(name, tensor.astype(np.float16))
    else:  # BF16 and the block types: bytes from gguf.quants, the shape and type told to the writer
        writer.add_tensor(name, gguf.quants.quantize(tensor, qtype), raw_dtype=qtype)


def _add_tokenizer(writer, tokenizer: dict, tokenizer_config: dict, config: dict) -> None:
    vocab = tokenizer["model"]["vocab"]
    tokens = [None] * config["vocab_size"]
    for token, i in vocab.items():
        tokens[i] = token
    special = {t["id"]: t["content"] for t in tokenizer.get("added_tokens", [])}
    for i, token in special.items():
        tokens[i] = token
    tokens = [t if t is not None else f"[PAD{i}]" for i, t in enumerate(tokens)]
    types = [gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in range(len(tokens))]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    ids = {v: k for k, v in special.items()}
    if tokenizer_config.get("bos_token") in ids:
        writer.add_bos_token_id(ids[tokenizer_config["bos_token"]])
    if tokenizer_config.get("eos_token") in ids:
        writer.add_eos_token_id(ids[tokenizer_config["eos_token"]])
    if config.get("pad_token_id") is not None:  # else transformers takes the config class's (Phi-3's: 32000)
        writer.add_pad_token_id(config["pad_token_id"])
    # the demo tokenizer's post-processor puts its BOS first, as llama.cpp's add_bos_token does
    writer.add_add_bos_token("TemplateProcessing" in json.dumps(tokenizer.get("post_processor"))
                             or tokenizer_config.get("add_bos_token", False))
    if tokenizer_config.get("chat_template"):
        writer.add_chat_template(tokenizer_config["chat_template"])


@contextlib.contextmanager
def transformers_reads_cached():
    """While transformers loads a GGUF: it parses the file once for the config, once for the weights and once
    for the tokenizer (7 s each for SmolLM2's here), and builds gguf's tensor-name map once per tensor (9 s
    in all). The same reader and maps, made once, cut the SmolLM2 reference's load from about 30 s to 10.
    Nothing read changes: the reader is read-only and the map a pure function of its arguments."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", functools.cache(gguf.GGUFReader))
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        yield
