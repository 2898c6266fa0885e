"""Qwen2-VL's and Qwen2.5-VL's images, the frontend's side (frontend/vision_models.py ``Qwen2VLSpec``,
frontend/images.py): an image takes as many placeholders as transformers' image processor makes merged patches
of it after ``smart_resize``, in its rows and columns (``ImageInput.grid``, what the ranks' M-RoPE reads), and the
placeholders stand between ``<|vision_start|>`` and ``<|vision_end|>``, written once whether the prompt came as
TGI's ``![](<url>)`` or through a chat template that writes the marks itself. Counts are checked against
transformers' own over sizes Hypothesis draws (the tiny checkpoints' pixel bounds and Qwen2-VL-7B's); then a
real frontend on each tiny checkpoint (llmbus.testing.qwen2_vl) sends the AddRequest transformers' processor
makes of the same prompt.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import io
import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from llmbus.bus import messages as m
from llmbus.frontend.errors import ApiError
from llmbus.frontend.images import FetchRules, LoadedImage, PromptImages
from llmbus.frontend.vision_models import Qwen2VLSpec, VisionModelError, VisionSpec, vision_spec
from llmbus.testing import qwen2_vl
from llmbus.testing.fake_scheduler import Frontend, last_add
from llmbus.testing.llava import encoded_image
from llmbus.testing.qwen2_vl import IMAGE_TOKEN, MERGE, PATCH, VISION_END, VISION_START

FAMILIES = ["qwen2_vl", "qwen2_5_vl"]
IMAGE_PART = f"{VISION_START}{IMAGE_TOKEN}{VISION_END}"  # what transformers' chat templates write for an image
# Qwen/Qwen2-VL-7B-Instruct's preprocessor_config.json, as published (written before transformers named the pixel
# bounds `size`)
QWEN2_VL_7B_PROCESSOR = {
    "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor"}


def data_url(data: bytes) -> str:
    return f"data:image/png;base64,{base64.b64encode(data).decode()}"


@pytest.fixture(scope="module", params=FAMILIES)
def qwen_dir(request) -> Path:
    return request.getfixturevalue(f"tiny_{request.param}_dir")


@pytest.fixture(scope="module")
def tok(qwen_dir) -> Tokenizer:
    return Tokenizer.from_file(str(qwen_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def spec(qwen_dir, tok) -> Qwen2VLSpec:
    return vision_spec(qwen_dir, tok)


@functools.cache
def processor(model_dir: Path):
    return qwen2_vl.processor(model_dir)


def transformers_layout(model_dir: Path, height: int, width: int) -> tuple[int, tuple[int, int]] | None:
    """What transformers makes of a ``height`` x ``width`` image under ``model_dir``'s image processor, by its
    cheap paths (no pixels): the processor's placeholder count, and the (rows, cols) of its ``image_grid_thw``
    (``smart_resize``'s size in patches) merged; None where it refuses the image."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    proc = processor(model_dir)
    image_processor = proc.image_processor
    try:
        count = proc._get_num_multimodal_tokens(image_sizes=[(height, width)]).num_image_tokens[0]
        resized = smart_resize(height, width, image_processor.patch_size * image_processor.merge_size,
                               image_processor.size["shortest_edge"], image_processor.size["longest_edge"])
    except ValueError:
        return None
    patch, merge = image_processor.patch_size, image_processor.merge_size
    return count, (resized[0] // patch // merge, resized[1] // patch // merge)


def validation_text(call) -> str:
    with pytest.raises(ApiError) as raised:
        call()
    assert raised.value.status == 422 and raised.value.error_type == "validation"
    return raised.value.message.removeprefix("Input validation error: ")


def _variant(model_dir: Path, tmp_path: Path, config: dict | None = None, processor_config: dict | None = None,
             drop: tuple[str, ...] = ()) -> Path:
    """A copy of ``model_dir``'s config files with ``config`` and ``processor_config`` merged in and ``drop``'s
    keys of preprocessor_config.json taken out (the weights are not needed to count)."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, tmp_path)
    for name, change in (("config.json", config), ("preprocessor_config.json", processor_config)):
        data = json.loads((model_dir / name).read_text())
        data.update(change or {})
        for key in drop if name == "preprocessor_config.json" else ():
            data.pop(key, None)
        (tmp_path / name).write_text(json.dumps(data))
    return tmp_path


# ------------------------------------------------------------------------------------------------
# The count: transformers' for every size
# ------------------------------------------------------------------------------------------------


def test_the_tiny_checkpoints_spec(spec, tok, qwen_dir):
    family = json.loads((qwen_dir / "config.json").read_text())["model_type"]
    assert isinstance(spec, Qwen2VLSpec) and spec.family == family
    assert (spec.image_token, spec.image_token_id) == (IMAGE_TOKEN, tok.token_to_id(IMAGE_TOKEN))
    assert (spec.image_start, spec.image_end) == (VISION_START, VISION_END)
    assert (spec.patch, spec.merge, spec.temporal_patch) == (PATCH, MERGE, 2)
    assert (spec.min_pixels, spec.max_pixels) == (qwen2_vl.MIN_PIXELS, qwen2_vl.MAX_PIXELS)
    assert spec.tokens_per_image == 4  # MIN_PIXELS: 2x2 merged patches
    assert spec.grid_for(64, 48) == (2, 2) and spec.grid_for(200, 40) == (1, 7)  # (rows, cols): height first


sides = st.integers(1, 5000)
# sizes at the edges: a side rounding half to even (42 = 1.5 x 28, 70 = 2.5 x 28), the aspect ratio's limit either
# side, the smallest and largest, and sides whose shrinking divides out to whole multiples of 28
EDGES = [(42, 42), (70, 70), (1, 200), (1, 201), (200, 1), (25, 5000), (1, 1), (5000, 5000), (300, 400), (28, 5600)]


def _check_against_transformers(spec: VisionSpec, model_dir: Path, height: int, width: int) -> None:
    expected = transformers_layout(model_dir, height, width)
    if expected is None:  # transformers refuses the aspect ratio: a 422 for the request, not a crash
        assert max(height, width) / min(height, width) > 200
        assert "aspect ratio must be at most 200:1" in validation_text(lambda: spec.tokens_for(width, height))
        assert "aspect ratio must be at most 200:1" in validation_text(lambda: spec.grid_for(width, height))
        return
    count, grid = expected
    assert spec.tokens_for(width, height) == count
    assert spec.grid_for(width, height) == grid
    assert grid[0] * grid[1] == count >= spec.tokens_per_image


@settings(max_examples=400, deadline=None)
@given(height=sides, width=sides)
def test_counts_and_grids_are_transformers_for_the_tiny_bounds(spec, qwen_dir, height, width):
    for edge_height, edge_width in EDGES:
        _check_against_transformers(spec, qwen_dir, edge_height, edge_width)
    _check_against_transformers(spec, qwen_dir, height, width)


# Qwen2-VL-7B's pixel bounds: as its preprocessor_config.json publishes them (top-level `min_pixels` /
# `max_pixels`), and as transformers' Qwen2VLImageProcessor defaults them (min 56x56, max 28x28x1280; the max
# Qwen's model card suggests serving with); and bounds so near each other that shrinking an image to max_pixels
# can leave it fewer placeholders than min_pixels' (``tokens_per_image`` must stay a floor)
BOUNDS = {"published": (QWEN2_VL_7B_PROCESSOR, (56 * 56, 14 * 14 * 4 * 16384), 4),
          "defaults": ({k: v for k, v in QWEN2_VL_7B_PROCESSOR.items() if not k.endswith("_pixels")},
                       (56 * 56, 28 * 28 * 1280), 4),
          "narrow": ({**QWEN2_VL_7B_PROCESSOR, "min_pixels": 28 * 28 * 16, "max_pixels": 28 * 28 * 16},
                     (28 * 28 * 16, 28 * 28 * 16), 4)}


@pytest.fixture(scope="module", params=list(BOUNDS))
def qwen2_vl_7b(request, tiny_qwen2_vl_dir, tmp_path_factory) -> tuple[Path, Qwen2VLSpec]:
    """The tiny Qwen2-VL's config and tokenizer with Qwen2-VL-7B's image processor (or one of narrow bounds), and
    its spec."""
    processor_config, bounds, fewest = BOUNDS[request.param]
    variant = _variant(tiny_qwen2_vl_dir, tmp_path_factory.mktemp("qwen2-vl-7b-processor"))
    (variant / "preprocessor_config.json").write_text(json.dumps(processor_config))
    spec = vision_spec(variant, Tokenizer.from_file(str(variant / "tokenizer.json")))
    assert (spec.min_pixels, spec.max_pixels, spec.tokens_per_image) == (*bounds, fewest)
    return variant, spec


@settings(max_examples=400, deadline=None)
@given(height=sides, width=sides)
@example(height=5000, width=5000)
@example(height=1001, width=1002)  # about 28x28x1280 pixels
@example(height=3584, width=3584)  # exactly 28x28x16384
@example(height=316, width=79)  # under the narrow bounds: shrunk to 7 placeholders, under min_pixels' 16
def test_counts_and_grids_are_transformers_for_qwen2_vl_7bs_bounds(qwen2_vl_7b, height, width):
    model_dir, spec = qwen2_vl_7b
    _check_against_transformers(spec, model_dir, height, width)


@pytest.mark.parametrize("processor_config, drop, bounds", [
    (None, (), (qwen2_vl.MIN_PIXELS, qwen2_vl.MAX_PIXELS)),  # transformers 5's `size`
    ({"min_pixels": 1000, "max_pixels": 20000}, ("size",), (1000, 20000)),  # older checkpoints'
    ({"max_pixels": 20000}, (), (qwen2_vl.MIN_PIXELS, 20000)),  # both: the top-level names win
    ({"min_pixels": 1000, "max_pixels": 20000, "size": {"min_pixels": 5, "max_pixels": 6}}, (), (1000, 20000)),
    (None, ("size", "patch_size", "merge_size", "temporal_patch_size"), (56 * 56, 28 * 28 * 1280)),  # defaults
])
def test_the_pixel_bounds_are_read_as_transformers_reads_them(tiny_qwen2_vl_dir, tmp_path, processor_config, drop,
                                                              bounds):
    import transformers

    variant = _variant(tiny_qwen2_vl_dir, tmp_path, processor_config=processor_config, drop=drop)
    spec = vision_spec(variant, Tokenizer.from_file(str(variant / "tokenizer.json")))
    size = transformers.AutoImageProcessor.from_pretrained(variant).size
    assert (spec.min_pixels, spec.max_pixels) == (size["shortest_edge"], size["longest_edge"]) == bounds


@pytest.mark.parametrize("config, processor_config, drop, message", [
    (None, {"size": {"min_pixels": 3136, "max_pixels": 37632}}, (),  # transformers 5 fails on every image
     "gives no positive `min_pixels` (nor `size`'s `shortest_edge`): None"),
    (None, {"size": {"longest_edge": 37632}}, (), "gives no positive `min_pixels`"),
    (None, {"min_pixels": 0}, (), "gives no positive `min_pixels` (nor `size`'s `shortest_edge`): 0"),
    (None, {"max_pixels": "big"}, (), "gives no positive `max_pixels`"),
    (None, {"size": 448}, (), "`size` is no {shortest_edge, longest_edge} of pixels"),
    (None, {"do_resize": False}, (), "does not resize images (`do_resize`)"),
    (None, {"patch_size": 16}, (), "the image processor's `patch_size` (16) is not the vision tower's `patch_size` "
                                   "(14)"),
    (None, {"merge_size": 1}, (), "`merge_size` (1) is not the vision tower's `spatial_merge_size` (2)"),
    (None, {"temporal_patch_size": 0}, (), "`temporal_patch_size` is no positive whole number: 0"),
    ({"vision_start_token_id": None}, None, (), "config.json has no `vision_start_token_id`: None"),
    ({"vision_end_token_id": 4097}, None, (), "`vision_end_token_id` (4097) is its `image_token_id` too"),
    ({"vision_start_token_id": 99999}, None, (), "vision start token 99999 is not in tokenizer.json's vocabulary"),
    ({"image_token_id": None}, None, (), "config.json names no image token"),
])
def test_a_qwen2_vl_the_frontend_cannot_count_is_refused(tiny_qwen2_vl_dir, tmp_path, config, processor_config,
                                                        drop, message):
    assert json.loads((tiny_qwen2_vl_dir / "config.json").read_text())["image_token_id"] == 4097
    variant = _variant(tiny_qwen2_vl_dir, tmp_path, config, processor_config, drop)
    with pytest.raises(VisionModelError) as raised:
        vision_spec(variant, Tokenizer.from_file(str(variant / "tokenizer.json")))
    assert message in str(raised.value) and "a qwen2_vl model whose image tokens" in str(raised.value)


def test_an_uncountable_qwen2_5_vl_does_not_start(tiny_qwen2_5_vl_dir, tmp_path):
    variant = _variant(tiny_qwen2_5_vl_dir, tmp_path, processor_config={"do_resize": False})
    with pytest.raises(VisionModelError, match="a qwen2_5_vl model whose image tokens the frontend cannot count"):
        Frontend(variant).close()


# ------------------------------------------------------------------------------------------------
# The marks around an image, and its grid
# ------------------------------------------------------------------------------------------------


def _loaded(data: bytes, width: int, height: int) -> LoadedImage:
    return LoadedImage(data, width, height, b"d" * m.IMAGE_DIGEST_BYTES)


@pytest.fixture
def images(spec):
    with ThreadPoolExecutor(1) as executor:
        yield PromptImages(spec, FetchRules(), executor)


@pytest.mark.parametrize("text, expected", [
    ("a ![](x) b", "a {s}{pads}{e} b"),  # TGI's markdown: the marks written
    ("a {s}![](x){e} b", "a {s}{pads}{e} b"),  # a chat template wrote them around the image token: kept, once
    ("{s}![](x) b", "{s}{pads}{e} b"),
    ("![](x){e}", "{s}{pads}{e}"),
    ("![](x)![](x)", "{s}{pads}{e}{s}{pads}{e}"),
    ("{s}![](x){e}{s}![](x){e}", "{s}{pads}{e}{s}{pads}{e}"),
])
def test_each_image_stands_between_one_start_and_one_end(images, spec, text, expected):
    image = _loaded(encoded_image(0, (200, 40)), 200, 40)
    marks = {"s": VISION_START, "e": VISION_END}
    expanded, loaded = asyncio.run(images.expand(text.format(**marks), 1000, {"![](x)": image}))
    assert expanded == expected.format(**marks, pads=IMAGE_TOKEN * spec.tokens_for(200, 40))
    assert loaded == [image] * text.count("![](x)")


def test_place_gives_each_image_its_grid(images, spec):
    shapes = [(64, 48), (30, 90), (200, 40)]
    loaded = [_loaded(encoded_image(i, shape), *shape) for i, shape in enumerate(shapes)]
    grids = [spec.grid_for(*shape) for shape in shapes]
    ids, offsets = [7, 8], []
    for rows, cols in grids:  # 9 and 10 stand for the marks, which place leaves to expand
        offsets.append(len(ids) + 1)
        ids += [9] + [spec.image_token_id] * (rows * cols) + [10, 11]
    placed = images.place(ids, loaded, cut=0)
    assert [image.grid for image in placed] == [[2, 2], [4, 2], [1, 7]] == [list(grid) for grid in grids]
    assert [(image.offset, image.num_tokens) for image in placed] == [(o, r * c) for o, (r, c) in zip(offsets, grids)]
    assert all(image.problem(len(ids)) is None for image in placed)


def test_a_model_that_reads_placeholders_as_a_sequence_has_no_grid():
    spec = VisionSpec(family="llava", image_token="<image>", image_token_id=5, tokens_per_image=3)
    with ThreadPoolExecutor(1) as executor:
        placed = PromptImages(spec, FetchRules(), executor).place([1, 5, 5, 5, 2], [_loaded(b"x", 9, 9)], cut=0)
    assert spec.grid_for(9, 9) is None and [(i.offset, i.num_tokens, i.grid) for i in placed] == [(1, 3, [])]


# ------------------------------------------------------------------------------------------------
# The frontend, end to end: what the scheduler receives, against transformers' processor
# ------------------------------------------------------------------------------------------------


SHAPES = [(30, 90), (200, 40), (400, 300)]  # (width, height): enlarged to min_pixels, kept, shrunk to max_pixels
IMAGES = [encoded_image(i + 1, shape) for i, shape in enumerate(SHAPES)]


@pytest.fixture(scope="module")
def fe(qwen_dir):
    frontend = Frontend(qwen_dir, max_input_tokens=400, max_total_tokens=512)
    yield frontend
    frontend.close()


def _pil(datas: list[bytes]):
    from PIL import Image

    return [Image.open(io.BytesIO(data)) for data in datas]


def assert_images_as_transformers_lays_them_out(add: m.AddRequest, expected, spec: Qwen2VLSpec, qwen_dir: Path,
                                                datas: list[bytes], tok: Tokenizer) -> None:
    """``add``'s prompt is transformers' ``expected`` (its processor's output), and each image stands where its
    placeholders do, between one start and one end, with transformers' grid."""
    ids = add.input_ids
    assert ids == list(expected["input_ids"][0])
    grids = [(int(h) // MERGE, int(w) // MERGE) for _, h, w in expected["image_grid_thw"]]
    assert grids == qwen2_vl.image_grids(qwen_dir, datas)
    assert [(image.num_tokens, image.grid) for image in add.images] == [(r * c, [r, c]) for r, c in grids]
    assert [image.data for image in add.images] == datas
    start, end = tok.token_to_id(VISION_START), tok.token_to_id(VISION_END)
    assert ids.count(start) == ids.count(end) == len(datas)
    for image in add.images:
        assert ids[image.offset - 1] == start and ids[image.offset + image.num_tokens] == end
        assert ids[image.offset:image.offset + image.num_tokens] == [spec.image_token_id] * image.num_tokens
    assert add.problem(vocab_size=len(tok.get_vocab())) is None


def test_generate_gives_transformers_prompt_and_layout(fe, tok, spec, qwen_dir):
    """Three images of three sizes in TGI's markdown: the prompt transformers' processor makes of the same text with
    ``<|vision_start|><|image_pad|><|vision_end|>`` where each image is; /tokenize counts the same tokens."""
    inputs = " and ".join(f"image {i} ![]({data_url(data)})" for i, data in enumerate(IMAGES)) + " differ?"
    status, _, body = fe.post("/generate", {"inputs": inputs, "parameters": {"max_new_tokens": 2}})
    assert status == 200, body
    add = last_add(fe)
    text = " and ".join(f"image {i} {IMAGE_PART}" for i in range(len(IMAGES))) + " differ?"
    expected = processor(qwen_dir)(text=[text], images=_pil(IMAGES))
    assert_images_as_transformers_lays_them_out(add, expected, spec, qwen_dir, IMAGES, tok)
    assert len({image.num_tokens for image in add.images}) == 3 and add.images[2].num_tokens > 40
    status, _, tokens = fe.post("/tokenize", {"inputs": inputs})
    assert status == 200 and [t["id"] for t in tokens] == add.input_ids


def test_generate_keeps_marks_the_text_already_has(fe, tok, spec, qwen_dir):
    inputs = f"look {VISION_START}![]({data_url(IMAGES[0])}){VISION_END} here"
    status, _, body = fe.post("/generate", {"inputs": inputs, "parameters": {"max_new_tokens": 2}})
    assert status == 200, body
    expected = processor(qwen_dir)(text=[f"look {IMAGE_PART} here"], images=_pil(IMAGES[:1]))
    assert_images_as_transformers_lays_them_out(last_add(fe), expected, spec, qwen_dir, IMAGES[:1], tok)


def test_chat_image_parts_give_transformers_prompt_and_layout(fe, tok, spec, qwen_dir):
    """OpenAI image_url parts through the checkpoint's template, which writes the marks around the image token
    itself: transformers' ``apply_chat_template`` of the same parts, then its processor, marks written once."""
    content = [{"type": "text", "text": "Compare "}, {"type": "image_url", "image_url": {"url": data_url(IMAGES[0])}},
               {"type": "text", "text": " with"}, {"type": "image_url", "image_url": {"url": data_url(IMAGES[2])}},
               {"type": "image_url", "image_url": {"url": data_url(IMAGES[1])}}]
    messages = [{"role": "user", "content": content}]
    status, _, body = fe.post("/v1/chat/completions", {"messages": messages, "max_tokens": 2})
    assert status == 200, body
    add = last_add(fe)
    parts = [{"type": "image"} if part["type"] == "image_url" else part for part in content]
    proc = processor(qwen_dir)
    templated = proc.apply_chat_template([{"role": "user", "content": parts}], tokenize=False,
                                         add_generation_prompt=True)
    assert templated.count(VISION_START) == 3
    datas = [IMAGES[0], IMAGES[2], IMAGES[1]]
    # the frontend tokenizes a rendered template as it stands (TGI's way): the template writes no BOS, so neither
    # does the processor here
    expected = proc(text=[templated], images=_pil(datas), add_special_tokens=False)
    assert_images_as_transformers_lays_them_out(add, expected, spec, qwen_dir, datas, tok)
    status, _, tokenized = fe.post("/chat_tokenize", {"messages": messages})
    assert status == 200 and [t["id"] for t in tokenized["tokenize_response"]] == add.input_ids
    assert f"{VISION_START}![]({data_url(IMAGES[0])}){VISION_END}" in tokenized["templated_text"]


def test_truncate_keeps_an_images_start_mark(fe, tok, spec):
    inputs = f"a long preamble of words ![]({data_url(IMAGES[1])}) what is it?"
    status, _, tokens = fe.post("/tokenize", {"inputs": inputs})
    ids = [t["id"] for t in tokens]
    keep = len(ids) - ids.index(tok.token_to_id(VISION_START))
    status, _, body = fe.post("/generate", {"inputs": inputs, "parameters": {"max_new_tokens": 2, "truncate": keep}})
    assert status == 200, body
    add = last_add(fe)
    assert add.input_ids == ids[-keep:] and [image.offset for image in add.images] == [1]
    status, _, body = fe.post("/generate", {"inputs": inputs,
                                            "parameters": {"max_new_tokens": 2, "truncate": keep - 1}})
    assert status == 422 and body["error"].startswith("Input validation error: `truncate` would cut into an image")


@pytest.mark.parametrize("shape", [(1, 250), (4000, 19)])
def test_an_extreme_aspect_ratio_is_a_validation_error(fe, shape):
    url = data_url(encoded_image(5, shape))
    status, _, body = fe.post("/generate", {"inputs": f"what is ![]({url})?", "parameters": {"max_new_tokens": 2}})
    width, height = shape
    assert (status, body["error_type"]) == (422, "validation"), body
    assert body["error"] == (f"Input validation error: invalid image: its aspect ratio must be at most 200:1 (the "
                             f"model's image processor refuses a longer one). Given: {width}x{height} pixels")
    content = [{"type": "image_url", "image_url": {"url": url}}]
    status, _, body = fe.post("/v1/chat/completions", {"messages": [{"role": "user", "content": content}],
                                                       "max_tokens": 2})
    assert status == 422 and "invalid image: its aspect ratio must be at most 200:1" in body["error"]["message"]
    status, _, body = fe.post("/generate", {"inputs": "still fine", "parameters": {"max_new_tokens": 2}})
    assert status == 200, body
