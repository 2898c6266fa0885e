"""A tiny LLaVA checkpoint (transformers' ``LlavaForConditionalGeneration``, hub layout) and transformers'
float32 greedy reference over prompts with images: what the vision tests compare llmbus with.

The text model is the demo ``tiny`` Llama (its trained tokenizer and weights, whose greedy margins are
decisive), with ``<image>`` added to its vocabulary; the vision tower is a seeded random CLIP of 56-pixel
images in 14-pixel patches: 16 image tokens an image (the CLS token is dropped, LLaVA's "default" strategy),
through a random two-layer GELU projector. ``preprocessor_config.json`` is CLIP's image processor at 56
pixels, and the chat template puts an image item's ``<image>`` where it stands.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path

IMAGE_TOKEN = "<image>"
IMAGE_SIZE = 56
PATCH_SIZE = 14
IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2  # 16
PROJECTOR_STD = 0.05  # the projector's weights: image rows of the embeddings' size, not a thousand times it

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}USER: {% else %}ASSISTANT: {% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' or item['type'] == 'image_url' %}<image>\n"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% if message['role'] != 'user' %}</s>{% endif %}{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


def build_tiny_llava(path: str | Path, *, seed: int = 0) -> Path:
    """Write the tiny LLaVA checkpoint, its tokenizer, image processor and chat template into ``path``."""
    import torch
    import transformers
    from tokenizers import AddedToken, Tokenizer

    from llmbus.supervisor.demo_model import build_demo_model

    path = Path(path)
    build_demo_model(path, "tiny")
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(IMAGE_TOKEN, special=True, normalized=False)])
    tok.save(str(path / "tokenizer.json"))
    image_id = tok.token_to_id(IMAGE_TOKEN)

    text = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    text.resize_token_embeddings(len(tok.get_vocab()), mean_resizing=False)
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=2, image_size=IMAGE_SIZE, patch_size=PATCH_SIZE,
                                           projection_dim=32)
    config = transformers.LlavaConfig(vision_config=vision, text_config=text.config, image_token_index=image_id,
                                      image_seq_length=IMAGE_TOKENS, vision_feature_layer=-2,
                                      vision_feature_select_strategy="default", projector_hidden_act="gelu")
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():
        model.model.language_model.load_state_dict(text.model.state_dict())
        model.lm_head.load_state_dict(text.lm_head.state_dict())
        for param in model.model.multi_modal_projector.parameters():
            param.normal_(0.0, PROJECTOR_STD)
        model.lm_head.weight[image_id] = 0  # a placeholder is read, never written
    (path / "model.safetensors").unlink()
    model.save_pretrained(path)

    transformers.CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE},
                                    crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}).save_pretrained(path)
    tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = CHAT_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return path


def encoded_image(seed: int, size: tuple[int, int] = (64, 48), fmt: str = "PNG") -> bytes:
    """An encoded image of random pixels (``size``: width, height), distinct for each seed."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt)
    return out.getvalue()


def pixel_values(model_dir: str | Path, images: list[bytes]):
    """transformers' image processor's ``pixel_values`` of ``images`` (float32, ``[n, 3, H, W]``)."""
    import transformers
    from PIL import Image

    processor = transformers.AutoImageProcessor.from_pretrained(model_dir)
    return processor(images=[Image.open(io.BytesIO(b)) for b in images], return_tensors="pt")["pixel_values"]


@dataclass
class ImagePrompt:
    """A prompt's token ids with ``IMAGE_TOKENS`` placeholders for each of ``images`` at ``image_offsets``."""

    ids: list[int]
    images: list[bytes]
    image_offsets: list[int]


def image_prompt(text_ids: list[list[int]], images: list[bytes], image_id: int) -> ImagePrompt:
    """``text_ids[0]``, then an image's placeholders and ``text_ids[i + 1]`` for each image."""
    assert len(text_ids) == len(images) + 1
    ids, offsets = list(text_ids[0]), []
    for after in text_ids[1:]:
        offsets.append(len(ids))
        ids += [image_id] * IMAGE_TOKENS + list(after)
    return ImagePrompt(ids=ids, images=list(images), image_offsets=offsets)


def _greedy(model, inputs: dict, max_new_tokens: int, min_margin: float) -> tuple[list[int], list[float]]:
    """``model.generate``'s greedy tokens after ``inputs`` (input_ids, attention_mask, pixel_values) and their
    logprobs; every step's top-1/top-2 logit margin must exceed ``min_margin``."""
    import torch

    gen = model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens, output_logits=True,
                         return_dict_in_generate=True, eos_token_id=None, pad_token_id=None)
    logits = torch.stack(gen.logits)[:, 0].float()
    top2 = logits.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min() > min_margin, "reference margins too thin to compare tokens"
    tokens = gen.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    return tokens, torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None]).squeeze(1).tolist()


def llava_reference(model_dir: str | Path, prompts: list[ImagePrompt], max_new_tokens: int,
                    min_margin: float) -> list[tuple[list[int], list[float]]]:
    """transformers' float32 greedy generate of each prompt, alone: (tokens, their logprobs); every step's
    top-1/top-2 logit margin must exceed ``min_margin``."""
    import torch
    import transformers

    model = transformers.LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt.ids])
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if prompt.images:
            inputs["pixel_values"] = pixel_values(model_dir, prompt.images)
        out.append(_greedy(model, inputs, max_new_tokens, min_margin))
    return out


def processor_reference(model_dir: str | Path, texts: list[tuple[str, list[bytes], bool]], max_new_tokens: int,
                        min_margin: float) -> list[list[int]]:
    """transformers' greedy tokens for each (text with an ``<image>`` where each image goes, images, whether the
    tokenizer adds its special tokens), as a transformers user runs LLaVA: ``LlavaProcessor`` expands each
    ``<image>`` and prepares the pixels, then ``generate`` in float32; every step's top-1/top-2 logit margin
    must exceed ``min_margin``."""
    import torch
    import transformers
    from PIL import Image

    processor = transformers.LlavaProcessor(
        image_processor=transformers.AutoImageProcessor.from_pretrained(model_dir),
        tokenizer=transformers.AutoTokenizer.from_pretrained(model_dir), patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default", num_additional_image_tokens=1, image_token=IMAGE_TOKEN)
    model = transformers.LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for text, images, add_special_tokens in texts:
        inputs = processor(text=text, images=[Image.open(io.BytesIO(b)) for b in images] or None,
                           add_special_tokens=add_special_tokens, return_tensors="pt")
        out.append(_greedy(model, dict(inputs), max_new_tokens, min_margin)[0])
    return out
