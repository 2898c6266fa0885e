"""Which served models read images, and how a prompt makes room for one: the placeholder token the model's
embeddings of an image replace, and how many of them an image takes.

Read from the model folder (``config.json``, ``preprocessor_config.json``, ``tokenizer.json``), never from
transformers' processors, which import torch. One reader per vision family (``FAMILIES``, by ``config.json``
``model_type``); a model of no family here is a text model. A vision model whose files do not say how many
tokens an image takes is refused at start (``VisionModelError``), where a request would fail later.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from llmbus.bus.model_files import read_config


class VisionModelError(ValueError):
    """A vision-language model whose image placeholders the frontend cannot count: one line, naming why."""


@dataclass(frozen=True)
class VisionSpec:
    """How a prompt holds an image of this model: ``image_token`` (its text; ``image_token_id``) repeated
    ``tokens_for(width, height)`` times where the image stands. LLaVA's count is the same for every image;
    a family whose count depends on the image's size overrides ``tokens_for``."""

    family: str  # config.json's model_type
    image_token: str
    image_token_id: int
    tokens_per_image: int  # for a family whose count varies, the fewest an image takes

    def tokens_for(self, width: int, height: int) -> int:
        return self.tokens_per_image


def _image_token(config: dict, tokenizer: Tokenizer) -> tuple[str, int]:
    """The placeholder token's text and id: config.json's ``image_token_index`` (or ``image_token_id``)."""
    token_id = config.get("image_token_index", config.get("image_token_id"))
    if not isinstance(token_id, int) or isinstance(token_id, bool):
        raise VisionModelError("config.json names no image token (`image_token_index` or `image_token_id`)")
    text = tokenizer.id_to_token(token_id)
    if text is None:
        raise VisionModelError(f"config.json's image token {token_id} is not in tokenizer.json's vocabulary")
    if tokenizer.encode(text, add_special_tokens=False).ids != [token_id]:
        # the prompt's placeholders are written as text: that text must come back as exactly this token
        raise VisionModelError(f"the image token {text!r} ({token_id}) does not tokenize as itself: tokenizer.json "
                               f"must hold it as an added token")
    return text, token_id


def _square_or_box(value, where: str) -> tuple[int, int]:
    """(height, width) of an image processor's size field: ``{"height", "width"}``, an int, or
    ``{"shortest_edge"}`` (square where the processor crops to it)."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value, value
    if isinstance(value, dict):
        height, width = value.get("height"), value.get("width")
        if isinstance(height, int) and isinstance(width, int) and height > 0 and width > 0:
            return height, width
        edge = value.get("shortest_edge")
        if isinstance(edge, int) and edge > 0:
            return edge, edge
    raise VisionModelError(f"preprocessor_config.json's `{where}` gives no image size: {value!r}")


def _processed_size(processor: dict) -> tuple[int, int]:
    """(height, width) of the pixels the image processor hands the vision tower: its center crop where it
    crops, else the size it resizes to (a fixed box; resizing the shortest edge alone keeps the aspect ratio,
    which leaves the count to the image)."""
    if processor.get("do_center_crop", "crop_size" in processor):
        return _square_or_box(processor.get("crop_size"), "crop_size")
    size = processor.get("size")
    if isinstance(size, dict) and "shortest_edge" in size and not {"height", "width"} <= size.keys():
        raise VisionModelError("preprocessor_config.json resizes the shortest edge without a center crop: "
                               "the tokens an image takes would depend on its aspect ratio")
    return _square_or_box(size, "size")


def _llava(model_dir: Path, config: dict, tokenizer: Tokenizer) -> VisionSpec:
    """LLaVA (``LlavaForConditionalGeneration``): one embedding row per vision patch, the tower's CLS row
    dropped by the "default" feature strategy; what transformers' ``LlavaProcessor`` counts."""
    text, token_id = _image_token(config, tokenizer)
    vision = config.get("vision_config")
    if not isinstance(vision, dict):
        raise VisionModelError("config.json has no `vision_config`")
    patch = vision.get("patch_size")
    if not isinstance(patch, int) or isinstance(patch, bool) or patch < 1:
        raise VisionModelError(f"config.json's vision_config has no `patch_size`: {patch!r}")
    processor_path = model_dir / "preprocessor_config.json"
    if not processor_path.is_file():
        raise VisionModelError("no preprocessor_config.json: it says the size of the pixels an image becomes")
    height, width = _processed_size(read_config(processor_path))
    tokens = (height // patch) * (width // patch)
    if vision.get("model_type") == "clip_vision_model":
        tokens += 1  # CLIP's CLS row
    if config.get("vision_feature_select_strategy", "default") == "default":
        tokens -= 1  # which "default" drops (the first row)
    if tokens < 1:
        raise VisionModelError(f"a {height}x{width} image in {patch}-pixel patches leaves no image tokens")
    return VisionSpec(family="llava", image_token=text, image_token_id=token_id, tokens_per_image=tokens)


# config.json's model_type -> the reader of that family's VisionSpec
FAMILIES: dict[str, Callable[[Path, dict, Tokenizer], VisionSpec]] = {"llava": _llava}


def vision_spec(model_dir: str | Path, tokenizer: Tokenizer) -> VisionSpec | None:
    """The served model's ``VisionSpec``; None for a text model. Raises ``VisionModelError`` for a vision
    model whose image tokens cannot be counted."""
    model_dir = Path(model_dir)
    config = read_config(model_dir / "config.json")
    reader = FAMILIES.get(config.get("model_type"))
    if reader is None:
        return None
    try:
        return reader(model_dir, config, tokenizer)
    except VisionModelError as e:
        raise VisionModelError(f"{model_dir}: a {config['model_type']} model whose image tokens the frontend "
                               f"cannot count: {e}") from None
