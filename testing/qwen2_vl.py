"""Tiny Qwen2-VL and Qwen2.5-VL checkpoints (transformers' ``Qwen2VLForConditionalGeneration`` and
``Qwen2_5_VLForConditionalGeneration``), their prompts' layout and their processor: what the M-RoPE tests
compare llmbus with, through ``llava.py``'s references (which serve every vision family).

The text model is the demo ``tiny`` Llama's weights in Qwen2-VL's text model (zero QKV biases, the demo's
norms and MLP: the same function, so its greedy margins stay decisive), with ``<|vision_start|>``,
``<|image_pad|>`` and ``<|vision_end|>`` added to its vocabulary and M-RoPE over sections ``MROPE_SECTION``
of its 16 rotary pairs. The vision tower is seeded and random: 14-pixel patches, 2x2 merged, so an image
takes one placeholder per 28x28 pixels of the size its processor resizes it to (between ``MIN_PIXELS`` and
``MAX_PIXELS``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

IMAGE_TOKEN = "<|image_pad|>"
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
MROPE_SECTION = [4, 6, 6]  # Qwen2-VL's [16, 24, 24] for 64 rotary pairs, scaled to the tiny model's 16
PATCH, MERGE = 14, 2
MIN_PIXELS, MAX_PIXELS = 28 * 28 * 4, 28 * 28 * 48
PROJECTOR_STD = 0.05

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}USER: {% else %}ASSISTANT: {% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' or item['type'] == 'image_url' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% if message['role'] != 'user' %}</s>{% endif %}{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)

FAMILIES = {"qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration"),
            "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration")}


def build_tiny_qwen2_vl(path: str | Path, family: str = "qwen2_vl", *, seed: int = 0) -> Path:
    """Write the tiny checkpoint of ``family`` (qwen2_vl or qwen2_5_vl), its tokenizer, image processor and
    chat template into ``path``."""
    import torch
    import transformers
    from tokenizers import AddedToken, Tokenizer

    from llmbus.supervisor.demo_model import build_demo_model

    path = Path(path)
    build_demo_model(path, "tiny")
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in (VISION_START, IMAGE_TOKEN, VISION_END)])
    tok.save(str(path / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in (VISION_START, IMAGE_TOKEN, VISION_END)}
    llama = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    demo = llama.config
    config_class, model_class = (getattr(transformers, name) for name in FAMILIES[family])
    vision = dict(depth=2, embed_dim=32, hidden_size=demo.hidden_size, num_heads=2, patch_size=PATCH,
                  spatial_merge_size=MERGE, temporal_patch_size=2)
    if family == "qwen2_5_vl":  # its tower: a windowed block and a full one, SwiGLU, the merger's width apart
        vision = dict(vision, hidden_size=32, intermediate_size=64, out_hidden_size=demo.hidden_size,
                      window_size=56, fullatt_block_indexes=[1])
    text = dict(vocab_size=len(tok.get_vocab()), hidden_size=demo.hidden_size,
                intermediate_size=demo.intermediate_size, num_hidden_layers=demo.num_hidden_layers,
                num_attention_heads=demo.num_attention_heads, num_key_value_heads=demo.num_key_value_heads,
                rms_norm_eps=demo.rms_norm_eps, max_position_embeddings=demo.max_position_embeddings,
                rope_parameters={"rope_type": "default", "rope_theta": demo.rope_parameters["rope_theta"],
                                 "mrope_section": MROPE_SECTION}, tie_word_embeddings=False,
                bos_token_id=demo.bos_token_id, eos_token_id=demo.eos_token_id)
    config = config_class(text_config=text, vision_config=vision, image_token_id=ids[IMAGE_TOKEN],
                          vision_start_token_id=ids[VISION_START], vision_end_token_id=ids[VISION_END],
                          video_token_id=ids[IMAGE_TOKEN] + 100_000)
    torch.manual_seed(seed)
    model = model_class(config).eval()
    llama.resize_token_embeddings(len(tok.get_vocab()), mean_resizing=False)
    with torch.no_grad():
        state = {name: tensor for name, tensor in llama.model.state_dict().items()}
        for layer in range(demo.num_hidden_layers):
            for proj in ("q_proj", "k_proj", "v_proj"):
                weight = state[f"layers.{layer}.self_attn.{proj}.weight"]
                state[f"layers.{layer}.self_attn.{proj}.bias"] = torch.zeros(weight.shape[0])
        model.model.language_model.load_state_dict(state)
        model.lm_head.load_state_dict(llama.lm_head.state_dict())
        for param in model.model.visual.merger.parameters():
            param.normal_(0.0, PROJECTOR_STD)
        model.lm_head.weight[list(ids.values())] = 0  # placeholders are read, never written
    (path / "model.safetensors").unlink()
    model.save_pretrained(path)
    transformers.Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=PATCH,
                                          merge_size=MERGE, temporal_patch_size=2).save_pretrained(path)
    tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = CHAT_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return path


def image_grids(model_dir: str | Path, images: list[bytes]) -> list[tuple[int, int]]:
    """(rows, cols) of each image's placeholders, as transformers' image processor lays them out."""
    from llmbus.testing import llava

    grid = llava.image_inputs(model_dir, images)["image_grid_thw"] if images else []
    return [(int(h) // MERGE, int(w) // MERGE) for _, h, w in grid]


def image_prompt(model_dir: str | Path, text_ids: list[list[int]], images: list[bytes]):
    """A ``llava.ImagePrompt`` as Qwen2-VL's processor lays one out: ``text_ids[0]``, then for each image
    ``<|vision_start|>``, its placeholders (rows x cols of its grid) and ``<|vision_end|>``, then
    ``text_ids[i + 1]``; and each image's grid."""
    from tokenizers import Tokenizer

    from llmbus.testing import llava

    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    start, pad, end = (tok.token_to_id(t) for t in (VISION_START, IMAGE_TOKEN, VISION_END))
    grids = image_grids(model_dir, images)
    texts = [list(text_ids[0]) + ([start] if images else [])]
    texts += [[end] + list(after) + ([start] if i + 1 < len(images) else []) for i, after in enumerate(text_ids[1:])]
    prompt = llava.image_prompt(texts, images, pad, [rows * cols for rows, cols in grids])
    return dataclasses.replace(prompt, grids=grids)


def processor(model_dir: str | Path):
    """transformers' ``Qwen2VLProcessor`` over ``model_dir``'s image processor and tokenizer, as its users build
    it, with the tiny checkpoints' chat template; without a video processor, whose class check of an absent one
    looks up torchvision's video processors (not installed here)."""
    import transformers

    class Processor(transformers.Qwen2VLProcessor):
        def check_argument_for_proper_class(self, argument_name, argument):
            return None if argument is None else super().check_argument_for_proper_class(argument_name, argument)

    return Processor(image_processor=transformers.AutoImageProcessor.from_pretrained(model_dir),
                     tokenizer=transformers.AutoTokenizer.from_pretrained(model_dir), chat_template=CHAT_TEMPLATE)
