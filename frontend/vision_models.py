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


@dataclass(frozen=True)
class AnyresSpec(VisionSpec):
    """LLaVA-NeXT's count ("anyres"): the base tile's rows, then the rows of the grid resolution
    (``pinpoints``, (height, width) each) the image fits best, in tiles of ``tile`` pixels, cut back to the
    image's aspect ratio, with one newline row after each row of patches; what transformers'
    ``LlavaNextProcessor`` counts. ``tokens_per_image`` is the base tile's, which every image takes."""

    tile: tuple[int, int] = (0, 0)  # (height, width) of a tile: the image processor's crop
    patch: int = 1
    pinpoints: tuple[tuple[int, int], ...] = ()

    def tokens_for(self, width: int, height: int) -> int:
        best_height, best_width = best_resolution(height, width, self.pinpoints)
        rows = self.tile[0] // self.patch * (best_height // self.tile[0])
        cols = self.tile[1] // self.patch * (best_width // self.tile[1])
        if width / height > cols / rows:  # wider than the grid: its padding above and below is cut
            rows -= (rows - int(round(height * (cols / width), 7))) // 2 * 2
        else:
            cols -= (cols - int(round(width * (rows / height), 7))) // 2 * 2
        return self.tokens_per_image + rows * cols + rows


def best_resolution(height: int, width: int, pinpoints) -> tuple[int, int]:
    """The (height, width) of ``pinpoints`` an image is resized into: the most of its pixels kept, then the
    least padding (transformers' ``select_best_resolution``)."""
    best, most_kept, least_wasted = pinpoints[0], -1, float("inf")
    for box_height, box_width in pinpoints:
        scale = min(box_width / width, box_height / height)
        kept = min(int(width * scale) * int(height * scale), width * height)
        wasted = box_width * box_height - kept
        if kept > most_kept or (kept == most_kept and wasted < least_wasted):
            best, most_kept, least_wasted = (box_height, box_width), kept, wasted
    return best


def _patch_size(config: dict) -> int:
    vision = config.get("vision_config")
    if not isinstance(vision, dict):
        raise VisionModelError("config.json has no `vision_config`")
    patch = vision.get("patch_size")
    if not isinstance(patch, int) or isinstance(patch, bool) or patch < 1:
        raise VisionModelError(f"config.json's vision_config has no `patch_size`: {patch!r}")
    return patch


def _image_processor(model_dir: Path) -> dict:
    processor_path = model_dir / "preprocessor_config.json"
    if not processor_path.is_file():
        raise VisionModelError("no preprocessor_config.json: it says the size of the pixels an image becomes")
    return read_config(processor_path)


def _extra_rows(config: dict) -> int:
    """The rows a tile gives beyond its patches': CLIP's class row, which the "default" feature strategy
    drops (it drops the first row of any tower)."""
    extra = 1 if config["vision_config"].get("model_type") == "clip_vision_model" else 0
    return extra - (config.get("vision_feature_select_strategy", "default") == "default")


def _llava(model_dir: Path, config: dict, tokenizer: Tokenizer) -> VisionSpec:
    """LLaVA (``LlavaForConditionalGeneration``): one embedding row per vision patch, the tower's CLS row
    dropped by the "default" feature strategy; what transformers' ``LlavaProcessor`` counts."""
    text, token_id = _image_token(config, tokenizer)
    patch = _patch_size(config)
    height, width = _processed_size(_image_processor(model_dir))
    tokens = (height // patch) * (width // patch) + _extra_rows(config)
    if tokens < 1:
        raise VisionModelError(f"a {height}x{width} image in {patch}-pixel patches leaves no image tokens")
    return VisionSpec(family="llava", image_token=text, image_token_id=token_id, tokens_per_image=tokens)


def _llava_next(model_dir: Path, config: dict, tokenizer: Tokenizer) -> VisionSpec:
    """LLaVA-NeXT (``LlavaNextForConditionalGeneration``): ``AnyresSpec`` over the image processor's tile
    and grid resolutions, which must be the model's."""
    text, token_id = _image_token(config, tokenizer)
    patch = _patch_size(config)
    processor = _image_processor(model_dir)
    tile = _processed_size(processor)
    if tile != (config["vision_config"].get("image_size"),) * 2:
        raise VisionModelError(f"the image processor's {tile[0]}x{tile[1]} tiles are not the vision tower's "
                               f"image_size ({config['vision_config'].get('image_size')!r})")
    pinpoints = processor.get("image_grid_pinpoints", config.get("image_grid_pinpoints"))
    if (not isinstance(pinpoints, list) or not pinpoints
            or not all(isinstance(box, list) and len(box) == 2 and all(isinstance(side, int) and side >= max(tile)
                                                                       for side in box) for box in pinpoints)):
        raise VisionModelError(f"`image_grid_pinpoints` is no list of [height, width] of at least a tile "
                               f"({tile[0]}x{tile[1]}): {pinpoints!r}")
    if config.get("image_grid_pinpoints", pinpoints) != pinpoints:
        raise VisionModelError("preprocessor_config.json's `image_grid_pinpoints` are not config.json's: the "
                               "image processor would cut images into other tiles than the model reads")
    base = (tile[0] // patch) * (tile[1] // patch) + _extra_rows(config)
    if base < 1:
        raise VisionModelError(f"a {tile[0]}x{tile[1]} tile in {patch}-pixel patches leaves no image tokens")
    return AnyresSpec(family="llava_next", image_token=text, image_token_id=token_id, tokens_per_image=base,
                      tile=tile, patch=patch, pinpoints=tuple(tuple(box) for box in pinpoints))


# config.json's model_type -> the reader of that family's VisionSpec
FAMILIES: dict[str, Callable[[Path, dict, Tokenizer], VisionSpec]] = {"llava": _llava, "llava_next": _llava_next}


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
