"""Tiny LLaVA and LLaVA-NeXT checkpoints (transformers' ``LlavaForConditionalGeneration`` and
``LlavaNextForConditionalGeneration``, hub layout) and transformers' float32 greedy references over prompts with
images, for these, Qwen2-VL's (``qwen2_vl.py``) and Gemma 3's (``gemma3_vl.py``): what the vision tests compare
llmbus with.

The text model is the demo ``tiny`` Llama (its trained tokenizer and weights, whose greedy margins are
decisive), with ``<image>`` added to its vocabulary; the vision tower is a seeded random CLIP in 14-pixel
patches through a random two-layer GELU projector, and the chat template puts an image item's ``<image>``
where it stands. LLaVA's images are 56 pixels: 16 image tokens each (the CLS token is dropped, the "default"
strategy). LLaVA-NeXT's are 42-pixel tiles over ``NEXT_PINPOINTS``, and an image takes as many tokens as its
size gives (``image_token_counts``: transformers' processor's count).
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from pathlib import Path

IMAGE_TOKEN = "<image>"
IMAGE_SIZE = 56
PATCH_SIZE = 14
IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2  # 16
# LLaVA-NeXT: an image is its base tile and the tiles of the pinpoint resolution it fits best, 42 pixels each
NEXT_TILE = 42
NEXT_PINPOINTS = [[42, 84], [84, 42], [84, 84], [42, 126], [126, 42]]
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


def _tiny_text_model(path: Path):
    """The demo ``tiny`` Llama written into ``path`` with ``<image>`` added to its vocabulary: (the text model,
    the image token's id)."""
    import torch
    import transformers
    from tokenizers import AddedToken, Tokenizer

    from llmbus.supervisor.demo_model import build_demo_model

    build_demo_model(path, "tiny")
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(IMAGE_TOKEN, special=True, normalized=False)])
    tok.save(str(path / "tokenizer.json"))
    text = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    text.resize_token_embeddings(len(tok.get_vocab()), mean_resizing=False)
    return text, tok.token_to_id(IMAGE_TOKEN)


def _save_tiny(path: Path, model, text, image_id: int, image_processor) -> Path:
    """``model`` (a LLaVA family's ``...ForConditionalGeneration``) with ``text``'s decoder, a projector of
    embedding-sized rows, and its image processor and chat template, saved over the demo model in ``path``."""
    import torch

    with torch.no_grad():
        model.model.language_model.load_state_dict(text.model.state_dict())
        model.lm_head.load_state_dict(text.lm_head.state_dict())
        for param in model.model.multi_modal_projector.parameters():
            param.normal_(0.0, PROJECTOR_STD)
        model.lm_head.weight[image_id] = 0  # a placeholder is read, never written
    (path / "model.safetensors").unlink()
    model.save_pretrained(path)
    image_processor.save_pretrained(path)
    tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = CHAT_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return path


def _tiny_clip(image_size: int):
    import transformers

    return transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, image_size=image_size, patch_size=PATCH_SIZE,
                                         projection_dim=32)


def build_tiny_llava(path: str | Path, *, seed: int = 0) -> Path:
    """Write the tiny LLaVA checkpoint, its tokenizer, image processor and chat template into ``path``."""
    import torch
    import transformers

    path = Path(path)
    text, image_id = _tiny_text_model(path)
    config = transformers.LlavaConfig(vision_config=_tiny_clip(IMAGE_SIZE), text_config=text.config,
                                      image_token_index=image_id, image_seq_length=IMAGE_TOKENS,
                                      vision_feature_layer=-2, vision_feature_select_strategy="default",
                                      projector_hidden_act="gelu")
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(config).eval()
    processor = transformers.CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE},
                                                crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    return _save_tiny(path, model, text, image_id, processor)


def build_tiny_llava_next(path: str | Path, *, seed: int = 0) -> Path:
    """Write the tiny LLaVA-NeXT checkpoint: the tiny LLaVA's parts with ``NEXT_TILE``-pixel tiles (9
    patches each) over ``NEXT_PINPOINTS``, and a random ``image_newline``."""
    import torch
    import transformers

    path = Path(path)
    text, image_id = _tiny_text_model(path)
    config = transformers.LlavaNextConfig(vision_config=_tiny_clip(NEXT_TILE), text_config=text.config,
                                          image_token_index=image_id, image_grid_pinpoints=NEXT_PINPOINTS,
                                          vision_feature_layer=-2, vision_feature_select_strategy="default",
                                          projector_hidden_act="gelu")
    torch.manual_seed(seed)
    model = transformers.LlavaNextForConditionalGeneration(config).eval()
    with torch.no_grad():
        model.model.image_newline.normal_(0.0, PROJECTOR_STD)
    processor = transformers.LlavaNextImageProcessorPil(
        size={"shortest_edge": NEXT_TILE}, crop_size={"height": NEXT_TILE, "width": NEXT_TILE},
        image_grid_pinpoints=NEXT_PINPOINTS)
    return _save_tiny(path, model, text, image_id, processor)


def encoded_image(seed: int, size: tuple[int, int] = (64, 48), fmt: str = "PNG") -> bytes:
    """An encoded image of random pixels (``size``: width, height), distinct for each seed."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt)
    return out.getvalue()


def _family(model_dir: str | Path) -> str:
    return json.loads((Path(model_dir) / "config.json").read_text())["model_type"]


def _model(model_dir: str | Path):
    """transformers' float32 model of the checkpoint (LLaVA, LLaVA-NeXT, Qwen2-VL or Qwen2.5-VL)."""
    import torch
    import transformers

    from llmbus.testing import qwen2_vl

    names = {"llava": "LlavaForConditionalGeneration", "llava_next": "LlavaNextForConditionalGeneration",
             "gemma3": "Gemma3ForConditionalGeneration"} | {
        family: classes[1] for family, classes in qwen2_vl.FAMILIES.items()}
    return getattr(transformers, names[_family(model_dir)]).from_pretrained(model_dir, dtype=torch.float32).eval()


def processor(model_dir: str | Path):
    """transformers' processor of the checkpoint, as its users build it (``LlavaProcessor``,
    ``LlavaNextProcessor``, or Qwen2-VL's: ``qwen2_vl.processor``): it expands each image's placeholder and
    prepares the pixels."""
    import transformers

    from llmbus.testing import gemma3_vl, qwen2_vl

    if _family(model_dir) in qwen2_vl.FAMILIES:
        return qwen2_vl.processor(model_dir)
    if _family(model_dir) == "gemma3":
        return gemma3_vl.processor(model_dir)
    cls = {"llava": transformers.LlavaProcessor, "llava_next": transformers.LlavaNextProcessor}[_family(model_dir)]
    return cls(image_processor=transformers.AutoImageProcessor.from_pretrained(model_dir),
               tokenizer=transformers.AutoTokenizer.from_pretrained(model_dir), patch_size=PATCH_SIZE,
               vision_feature_select_strategy="default", num_additional_image_tokens=1, image_token=IMAGE_TOKEN)


def image_inputs(model_dir: str | Path, images: list[bytes]) -> dict:
    """transformers' image processor's outputs for ``images``: ``pixel_values`` (float32), and LLaVA-NeXT's
    ``image_sizes`` or Qwen2-VL's ``image_grid_thw``."""
    import transformers
    from PIL import Image

    image_processor = transformers.AutoImageProcessor.from_pretrained(model_dir)
    out = image_processor(images=[Image.open(io.BytesIO(b)) for b in images], return_tensors="pt")
    return {key: out[key] for key in ("pixel_values", "image_sizes", "image_grid_thw") if key in out}


def image_token_counts(model_dir: str | Path, images: list[bytes]) -> list[int]:
    """How many placeholders transformers' processor gives each image."""
    from PIL import Image

    proc = processor(model_dir)
    image_id = proc.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    counts = []
    for image in images:
        ids = proc(text=IMAGE_TOKEN, images=[Image.open(io.BytesIO(image))], return_tensors="pt")["input_ids"][0]
        counts.append(int((ids == image_id).sum()))
    return counts


@dataclass
class ImagePrompt:
    """A prompt's token ids with ``image_tokens[i]`` placeholders for ``images[i]`` at ``image_offsets[i]``
    (laid out in ``grids[i]``'s rows and columns, for a model whose positions follow them)."""

    ids: list[int]
    images: list[bytes]
    image_offsets: list[int]
    image_tokens: list[int]
    grids: list[tuple[int, int]] = field(default_factory=list)


def image_prompt(text_ids: list[list[int]], images: list[bytes], image_id: int,
                 counts: list[int] | None = None) -> ImagePrompt:
    """``text_ids[0]``, then an image's placeholders (``counts[i]``, or LLaVA's ``IMAGE_TOKENS``) and
    ``text_ids[i + 1]`` for each image."""
    assert len(text_ids) == len(images) + 1
    counts = [IMAGE_TOKENS] * len(images) if counts is None else counts
    ids, offsets = list(text_ids[0]), []
    for after, count in zip(text_ids[1:], counts):
        offsets.append(len(ids))
        ids += [image_id] * count + list(after)
    return ImagePrompt(ids=ids, images=list(images), image_offsets=offsets, image_tokens=list(counts))


def _greedy(model, inputs: dict, max_new_tokens: int, min_margin: float) -> tuple[list[int], list[float]]:
    """``model.generate``'s greedy tokens after ``inputs`` (input_ids, attention_mask, the image inputs) and
    their logprobs; every step's top-1/top-2 logit margin must exceed ``min_margin``."""
    import torch

    gen = model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens, output_logits=True,
                         return_dict_in_generate=True, eos_token_id=None, pad_token_id=None)
    logits = torch.stack(gen.logits)[:, 0].float()
    top2 = logits.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min() > min_margin, "reference margins too thin to compare tokens"
    tokens = gen.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    return tokens, torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None]).squeeze(1).tolist()


def generate_reference(model_dir: str | Path, prompts: list[ImagePrompt], max_new_tokens: int,
                       min_margin: float, both_ways: bool = True) -> list[tuple[list[int], list[float]]]:
    """transformers' float32 greedy generate of each prompt, alone: (tokens, their logprobs); every step's
    top-1/top-2 logit margin must exceed ``min_margin``. (Qwen2-VL's generate also takes which tokens are an
    image's, for its M-RoPE positions, and Gemma 3's, whose image tokens attend each other both ways, as their
    processors give them; ``both_ways=False``: not Gemma 3's, whose image tokens then attend causally.)"""
    import torch

    from llmbus.testing import qwen2_vl

    model = _model(model_dir)
    family = _family(model_dir)
    marks = ("mm_token_type_ids" if family in qwen2_vl.FAMILIES
             else "token_type_ids" if family == "gemma3" and both_ways else None)
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt.ids])
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if marks is not None:
            inputs[marks] = (ids == model.config.image_token_id).int()
        if prompt.images:
            inputs |= image_inputs(model_dir, prompt.images)
        out.append(_greedy(model, inputs, max_new_tokens, min_margin))
    return out


def processor_reference(model_dir: str | Path, texts: list[tuple[str, list[bytes], bool]], max_new_tokens: int,
                        min_margin: float) -> list[list[int]]:
    """transformers' greedy tokens for each (text with an ``<image>`` where each image goes, images, whether the
    tokenizer adds its special tokens), as a transformers user runs the model: its processor expands each
    ``<image>`` and prepares the pixels, then ``generate`` in float32; every step's top-1/top-2 logit margin
    must exceed ``min_margin``."""
    from PIL import Image

    proc, model = processor(model_dir), _model(model_dir)
    out = []
    for text, images, add_special_tokens in texts:
        inputs = proc(text=text, images=[Image.open(io.BytesIO(b)) for b in images] or None,
                      add_special_tokens=add_special_tokens, return_tensors="pt")
        out.append(_greedy(model, dict(inputs), max_new_tokens, min_margin)[0])
    return out


def assert_reference_results(expected: list[tuple[list[int], list[float]]], results: dict, index_of: dict[str, int],
                             atol: float = 1e-4) -> None:
    """Each request's (tokens, logprobs) of ``results`` equals ``expected[index_of[rid]]``: the tokens exactly,
    the logprobs within ``atol``."""
    import torch

    for rid, i in index_of.items():
        tokens, logprobs = expected[i]
        assert results[rid][0] == tokens, rid
        torch.testing.assert_close(torch.tensor(results[rid][1]), torch.tensor(logprobs), rtol=0, atol=atol)


def bus_images(prompt: ImagePrompt, stub_before: int = 0):
    """The prompt's images as the scheduler sends them (``ImageInput``s, with their grids where the prompt has
    them); those ending at or before ``stub_before`` as a cached prefix's: stubs without their files."""
    import hashlib

    from llmbus.bus.messages import ImageInput

    grids = prompt.grids or [()] * len(prompt.images)
    images = [ImageInput(offset, count, data, hashlib.blake2b(data, digest_size=16).digest(), list(grid))
              for offset, count, data, grid in zip(prompt.image_offsets, prompt.image_tokens, prompt.images, grids)]
    return [image.stub() if image.offset + image.num_tokens <= stub_before else image for image in images]
