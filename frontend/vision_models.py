"""Which served models read images, and how a prompt makes room for one: the placeholder token the model's
embeddings of an image replace, how many of them an image takes (and, for Qwen2-VL, in how many rows and
columns), what marks where an image begins and ends, and what a chat template writes for an image.

Read from the model folder (``config.json``, ``preprocessor_config.json``, ``tokenizer.json``), never from
transformers' processors, which import torch. One reader per vision family (``FAMILIES``, by ``config.json``
``model_type``); a model of no family here is a text model. A vision model whose files do not say how many
tokens an image takes is refused at start (``VisionModelError``), where a request would fail later.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from llmbus.bus.model_files import read_config
from llmbus.frontend.errors import validation_error


class VisionModelError(ValueError):
    """A vision-language model whose image placeholders the frontend cannot count: one line, naming why."""


@dataclass(frozen=True)
class VisionSpec:
    """How a prompt holds an image of this model: ``image_token`` (its text; ``image_token_id``) repeated
    ``tokens_for(width, height)`` times where the image stands, right after ``image_start`` and before
    ``image_end`` (Qwen2-VL's ``<|vision_start|>`` and ``<|vision_end|>``; Gemma 3's ``\\n\\n<start_of_image>``
    and ``<end_of_image>\\n\\n``; LLaVA's mark nothing). LLaVA's count is the same for every image; a family
    whose count depends on the image's size overrides ``tokens_for``, and one whose positions follow the
    placeholders' rows and columns ``grid_for``. Either raises a validation error (422) for an image the
    model's image processor refuses. A chat template writes ``template_token`` for an image part: the image
    token, or (Gemma 3) the mark transformers' processor expands into the whole image."""

    family: str  # config.json's model_type
    image_token: str
    image_token_id: int
    tokens_per_image: int  # for a family whose count varies, the fewest an image takes
    # where not "": image_start ends in a mark token of its own, the placeholders' neighbour (truncation keeps it
    # with the image), and image_end begins with one; text around the marks (Gemma 3's blank lines) is the image's
    image_start: str = ""
    image_end: str = ""
    chat_image: str = ""  # what a chat template writes for an image where that is not image_token

    @property
    def template_token(self) -> str:
        """The text a chat template writes where an image stands, which the image's ``![](<url>)`` replaces."""
        return self.chat_image or self.image_token

    def tokens_for(self, width: int, height: int) -> int:
        return self.tokens_per_image

    def grid_for(self, width: int, height: int) -> tuple[int, int] | None:
        """(rows, cols) of an image's placeholders, rows times cols of them; None for a model that reads them
        as a sequence."""
        return None


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(value) -> bool:
    return _is_int(value) and value > 0


def _token_text(tokenizer: Tokenizer, token_id: int, name: str) -> str:
    """The text of config.json's ``name`` token (``token_id``), which must tokenize as exactly that token."""
    text = tokenizer.id_to_token(token_id)
    if text is None:
        raise VisionModelError(f"config.json's {name} {token_id} is not in tokenizer.json's vocabulary")
    if tokenizer.encode(text, add_special_tokens=False).ids != [token_id]:
        # the prompt's placeholders are written as text: that text must come back as exactly this token
        raise VisionModelError(f"the {name} {text!r} ({token_id}) does not tokenize as itself: tokenizer.json "
                               f"must hold it as an added token")
    return text


def _image_token(config: dict, tokenizer: Tokenizer) -> tuple[str, int]:
    """The placeholder token's text and id: config.json's ``image_token_index`` (or ``image_token_id``)."""
    token_id = config.get("image_token_index", config.get("image_token_id"))
    if not _is_int(token_id):
        raise VisionModelError("config.json names no image token (`image_token_index` or `image_token_id`)")
    return _token_text(tokenizer, token_id, "image token"), token_id


def _square_or_box(value, where: str) -> tuple[int, int]:
    """(height, width) of an image processor's size field: ``{"height", "width"}``, an int, or
    ``{"shortest_edge"}`` (square where the processor crops to it)."""
    if _positive_int(value):
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


QWEN2_VL_MAX_ASPECT_RATIO = 200  # transformers' smart_resize refuses a longer side more than this times the other


def smart_resize(height: int, width: int, factor: int, min_pixels: float, max_pixels: float) -> tuple[int, int]:
    """The (height, width) transformers' Qwen2-VL image processor resizes an image to: each side a multiple of
    ``factor``, the pixels brought within ``min_pixels`` and ``max_pixels`` keeping the aspect ratio about
    (transformers' ``smart_resize``, float operation for float operation, or a count would differ by an image's
    row). An image whose aspect ratio transformers refuses is an invalid image (422)."""
    if min(height, width) < 1:
        raise validation_error(f"invalid image: a {width}x{height} image has no pixels")
    if max(height, width) / min(height, width) > QWEN2_VL_MAX_ASPECT_RATIO:
        raise validation_error(f"invalid image: its aspect ratio must be at most {QWEN2_VL_MAX_ASPECT_RATIO}:1 (the "
                               f"model's image processor refuses a longer one). Given: {width}x{height} pixels")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class Qwen2VLSpec(VisionSpec):
    """Qwen2-VL's and Qwen2.5-VL's count: the image resized (``smart_resize``) to sides of whole ``patch`` x
    ``merge`` pixels with about ``min_pixels`` to ``max_pixels`` pixels in all, then one placeholder per
    ``merge`` x ``merge`` of its ``patch``-pixel patches, in their rows and columns; what transformers'
    ``Qwen2VLImageProcessor`` and ``Qwen2VLProcessor`` lay out. ``tokens_per_image``: a floor no image's
    count goes under."""

    patch: int = 14
    merge: int = 2
    temporal_patch: int = 2  # frames a patch spans (an image is repeated to fill them): no count depends on it
    min_pixels: float = 56 * 56
    max_pixels: float = 28 * 28 * 1280

    def grid_for(self, width: int, height: int) -> tuple[int, int]:
        resized_height, resized_width = smart_resize(height, width, self.patch * self.merge, self.min_pixels,
                                                     self.max_pixels)
        return resized_height // self.patch // self.merge, resized_width // self.patch // self.merge

    def tokens_for(self, width: int, height: int) -> int:
        rows, cols = self.grid_for(width, height)
        return rows * cols


def _patch_size(config: dict) -> int:
    vision = config.get("vision_config")
    if not isinstance(vision, dict):
        raise VisionModelError("config.json has no `vision_config`")
    patch = vision.get("patch_size")
    if not _positive_int(patch):
        raise VisionModelError(f"config.json's vision_config has no `patch_size`: {patch!r}")
    return patch


def _distinct_ids(config: dict, names: tuple[str, ...], known: dict[str, int] | None = None) -> dict[str, int]:
    """``known`` and config.json's token ids ``names``: each a whole number, none of them another's."""
    ids = dict(known or {})
    for name in names:
        token_id = config.get(name)
        if not _is_int(token_id):
            raise VisionModelError(f"config.json has no `{name}`: {token_id!r}")
        same = [other for other, other_id in ids.items() if other_id == token_id]
        if same:
            raise VisionModelError(f"config.json's `{name}` ({token_id}) is its `{same[0]}` too")
        ids[name] = token_id
    return ids


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


def _positive_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _pixel_bounds(processor: dict) -> tuple[float, float]:
    """(min_pixels, max_pixels) of a Qwen2-VL image processor, read as transformers reads them: ``size``'s
    ``shortest_edge`` and ``longest_edge`` (transformers 5's names; its defaults where there is no ``size``),
    each overridden by a top-level ``min_pixels`` or ``max_pixels`` (older checkpoints' names)."""
    size = processor.get("size")
    if size is None:
        size = {"shortest_edge": Qwen2VLSpec.min_pixels, "longest_edge": Qwen2VLSpec.max_pixels}
    if not isinstance(size, dict):
        raise VisionModelError(f"preprocessor_config.json's `size` is no {{shortest_edge, longest_edge}} of pixels "
                               f"(min and max): {size!r}")
    bounds = []
    for name, edge in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
        value = processor.get(name)
        if value is None:
            value = size.get(edge)
        if not _positive_number(value):
            # as transformers' image processor would fail on every image
            raise VisionModelError(f"preprocessor_config.json gives no positive `{name}` (nor `size`'s `{edge}`): "
                                   f"{value!r}")
        bounds.append(value)
    return bounds[0], bounds[1]


def _qwen2_vl(model_dir: Path, config: dict, tokenizer: Tokenizer) -> VisionSpec:
    """Qwen2-VL (``Qwen2VLForConditionalGeneration``) and Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``):
    ``Qwen2VLSpec`` over the image processor's patches and pixel bounds (transformers' defaults where it
    names none), whose patches must be the vision tower's; each image's placeholders between config.json's
    ``vision_start_token_id`` and ``vision_end_token_id``, as transformers' chat templates write an image."""
    text, token_id = _image_token(config, tokenizer)
    ids = _distinct_ids(config, ("vision_start_token_id", "vision_end_token_id"), {"image_token_id": token_id})
    start = _token_text(tokenizer, ids["vision_start_token_id"], "vision start token")
    end = _token_text(tokenizer, ids["vision_end_token_id"], "vision end token")
    processor = _image_processor(model_dir)
    if not processor.get("do_resize", True):
        raise VisionModelError("preprocessor_config.json does not resize images (`do_resize`): only an image whose "
                               "sides are whole merged patches would be read")
    vision = config.get("vision_config") or {}
    sizes = []
    for name, tower_name, default in (("patch_size", "patch_size", Qwen2VLSpec.patch),
                                      ("merge_size", "spatial_merge_size", Qwen2VLSpec.merge),
                                      ("temporal_patch_size", "temporal_patch_size", Qwen2VLSpec.temporal_patch)):
        value = processor.get(name)
        value = default if value is None else value
        if not _positive_int(value):
            raise VisionModelError(f"preprocessor_config.json's `{name}` is no positive whole number: {value!r}")
        tower = vision.get(tower_name, default) if isinstance(vision, dict) else None
        if tower != value:
            raise VisionModelError(f"the image processor's `{name}` ({value}) is not the vision tower's "
                                   f"`{tower_name}` ({tower!r})")
        sizes.append(value)
    patch, merge, temporal_patch = sizes
    min_pixels, max_pixels = _pixel_bounds(processor)
    # an image enlarged or kept takes at least min_pixels' worth; one shrunk to max_pixels loses less than half
    # of each side to the rounding down (a side is at least one merged patch)
    merged = (patch * merge) ** 2
    fewest = max(1, min(int(min_pixels // merged), int(max_pixels // merged // 4)))
    return Qwen2VLSpec(family=config["model_type"], image_token=text, image_token_id=token_id,
                       tokens_per_image=fewest, image_start=start, image_end=end, patch=patch, merge=merge,
                       temporal_patch=temporal_patch, min_pixels=min_pixels, max_pixels=max_pixels)


# transformers' Gemma3Config, for what a config.json leaves out (as the model reads it)
GEMMA3_DEFAULTS = {"image_token_index": 262144, "boi_token_index": 255999, "eoi_token_index": 256000,
                   "mm_tokens_per_image": 256}
GEMMA3_BLANK_LINE = "\n\n"  # transformers' Gemma3Processor sets an image apart from the text around it


def _gemma3(model_dir: Path, config: dict, tokenizer: Tokenizer) -> VisionSpec | None:
    """Gemma 3 (``Gemma3ForConditionalGeneration``): ``mm_tokens_per_image`` placeholders (``image_token_index``,
    ``<image_soft_token>``) whatever the image's size, its tower's patches average-pooled to that many, laid out
    as transformers' ``Gemma3Processor`` expands the ``<start_of_image>`` (``boi_token_index``) its chat template
    writes for an image: ``\\n\\n<start_of_image>``, the placeholders, ``<end_of_image>\\n\\n``
    (``eoi_token_index``). Pan-and-scan, which adds crops of an image with placeholders of their own, is not
    served. A checkpoint without an image processor (``preprocessor_config.json``) is served as a text model,
    as its ranks serve it (``workers/models/gemma3.py``): None."""
    if not (model_dir / "preprocessor_config.json").is_file():
        return None
    ids = _distinct_ids({**GEMMA3_DEFAULTS, **config}, ("image_token_index", "boi_token_index", "eoi_token_index"))
    text = _token_text(tokenizer, ids["image_token_index"], "image token")
    boi = _token_text(tokenizer, ids["boi_token_index"], "start of image token")
    eoi = _token_text(tokenizer, ids["eoi_token_index"], "end of image token")
    tokens = config.get("mm_tokens_per_image", GEMMA3_DEFAULTS["mm_tokens_per_image"])
    if not _positive_int(tokens):
        raise VisionModelError(f"config.json's `mm_tokens_per_image` is no positive whole number: {tokens!r}")
    vision = config.get("vision_config")
    image_size = vision.get("image_size") if isinstance(vision, dict) else None
    if not _positive_int(image_size):
        raise VisionModelError(f"config.json's vision_config has no `image_size`: {image_size!r}")
    # the projector's pooling, as transformers' Gemma3MultiModalProjector sizes it: any other count of embeddings
    # would not fit the placeholders
    patches, side = image_size // _patch_size(config), math.isqrt(tokens)
    kernel = patches // side
    if side * side != tokens or kernel < 1 or patches // kernel != side:
        raise VisionModelError(f"the vision tower's {patches}x{patches} patches do not pool into "
                               f"`mm_tokens_per_image` ({tokens}) embeddings")
    processor = _image_processor(model_dir)
    if processor.get("do_pan_and_scan"):
        raise VisionModelError("preprocessor_config.json turns on pan-and-scan (`do_pan_and_scan`), which is not "
                               "served: set it to false")
    if not processor.get("do_resize", True) or _square_or_box(processor.get("size"), "size") != (image_size,) * 2:
        raise VisionModelError(f"the image processor does not resize images to the vision tower's image_size "
                               f"({image_size}): {processor.get('size')!r}")
    for name, written in (("processor_config.json", read_config(model_dir / "processor_config.json")),
                          ("preprocessor_config.json", processor)):
        length = written.get("image_seq_length")
        if length is not None and length != tokens:
            # transformers' processor writes its own count, the model embeds mm_tokens_per_image
            raise VisionModelError(f"{name}'s `image_seq_length` ({length!r}) is not config.json's "
                                   f"`mm_tokens_per_image` ({tokens})")
    return VisionSpec(family="gemma3", image_token=text, image_token_id=ids["image_token_index"],
                      tokens_per_image=tokens, image_start=GEMMA3_BLANK_LINE + boi,
                      image_end=eoi + GEMMA3_BLANK_LINE, chat_image=boi)


# config.json's model_type -> the reader of that family's VisionSpec (None: the folder is served as text)
FAMILIES: dict[str, Callable[[Path, dict, Tokenizer], VisionSpec | None]] = {
    "llava": _llava, "llava_next": _llava_next, "qwen2_vl": _qwen2_vl, "qwen2_5_vl": _qwen2_vl, "gemma3": _gemma3}


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
