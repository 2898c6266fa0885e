"""LLaVA-NeXT's image placeholders, the frontend's side (frontend/vision_models.py ``AnyresSpec``): how many an
image takes depends on its size, and the count must be transformers' ``LlavaNextProcessor``'s for every
size, or the ranks' embeddings would not fit the prompt's placeholders. Checked against the processor's own
count over sizes Hypothesis draws, for the tiny checkpoint and llava-v1.6's 336-pixel tiles; then a real
frontend on the tiny LLaVA-NeXT folder sends images of three sizes with as many placeholders as
transformers' processor puts in the same prompt."""

from __future__ import annotations

import base64
import functools
import io
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from llmbus.frontend.vision_models import AnyresSpec, VisionModelError, best_resolution, vision_spec
from llmbus.testing import llava
from llmbus.testing.fake_scheduler import Frontend, last_rid

# llava-hf/llava-v1.6-*: CLIP ViT-L/14 at 336 pixels
V16_PINPOINTS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]


@pytest.fixture(scope="module")
def next_dir(tiny_llava_next_dir) -> Path:
    return tiny_llava_next_dir


@pytest.fixture(scope="module")
def tok(next_dir) -> Tokenizer:
    return Tokenizer.from_file(str(next_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def spec(next_dir, tok) -> AnyresSpec:
    return vision_spec(next_dir, tok)


@functools.cache
def processor_counts(next_dir: Path, tile: int, pinpoints: tuple[tuple[int, int], ...]):
    """transformers' ``LlavaNextProcessor`` over the tiny folder's tokenizer with ``tile``-pixel tiles:
    ``count(height, width)`` is how many placeholders it gives an image of that size."""
    import transformers

    processor = transformers.LlavaNextProcessor(
        image_processor=transformers.LlavaNextImageProcessorPil(size={"shortest_edge": tile},
                                                                crop_size={"height": tile, "width": tile},
                                                                image_grid_pinpoints=[list(box) for box in pinpoints]),
        tokenizer=transformers.AutoTokenizer.from_pretrained(next_dir), patch_size=llava.PATCH_SIZE,
        vision_feature_select_strategy="default", num_additional_image_tokens=1, image_token=llava.IMAGE_TOKEN)
    return lambda height, width: processor._get_num_multimodal_tokens(image_sizes=[(height, width)]).num_image_tokens[0]


def test_the_tiny_checkpoints_spec(spec, tok):
    assert isinstance(spec, AnyresSpec) and spec.family == "llava_next"
    assert spec.image_token_id == tok.token_to_id(llava.IMAGE_TOKEN)
    assert (spec.tile, spec.patch, spec.tokens_per_image) == ((42, 42), 14, 9)  # the base tile: 3x3 patches
    assert [list(box) for box in spec.pinpoints] == llava.NEXT_PINPOINTS


sides = st.integers(1, 4000)


@settings(max_examples=300, deadline=None)
@given(height=sides, width=sides)
def test_counts_are_the_processors_for_the_tiny_tiles(next_dir, spec, height, width):
    assert spec.tokens_for(width, height) == processor_counts(next_dir, 42, spec.pinpoints)(height, width)


@settings(max_examples=300, deadline=None)
@given(height=sides, width=sides)
def test_counts_are_the_processors_for_llava_v16s_tiles(next_dir, height, width):
    spec = AnyresSpec(family="llava_next", image_token=llava.IMAGE_TOKEN, image_token_id=0, tokens_per_image=576,
                      tile=(336, 336), patch=14, pinpoints=tuple(tuple(box) for box in V16_PINPOINTS))
    assert spec.tokens_for(width, height) == processor_counts(next_dir, 336, spec.pinpoints)(height, width)


@pytest.mark.parametrize("size, expected", [
    ((480, 640), (672, 672)),  # 4:3 fits the 2x2 grid best
    ((336, 1000), (336, 1008)),  # a wide strip: the 1x3 grid
    ((2000, 400), (1008, 336)),
    ((10, 10), (336, 672)),  # all keep the whole image: the least padding wins, the first of equals
])
def test_best_resolution(size, expected):
    assert best_resolution(*size, V16_PINPOINTS) == expected


def _variant(next_dir: Path, tmp_path: Path, config: dict | None = None, processor: dict | None = None) -> Path:
    for name, change in (("config.json", config), ("preprocessor_config.json", processor)):
        data = json.loads((next_dir / name).read_text())
        data.update(change or {})
        (tmp_path / name).write_text(json.dumps(data))
    return tmp_path


@pytest.mark.parametrize("config, processor, message", [
    ({"image_grid_pinpoints": [[84, 84]]}, None, "`image_grid_pinpoints` are not config.json's"),
    (None, {"image_grid_pinpoints": [[84, 84]]}, "`image_grid_pinpoints` are not config.json's"),
    ({"image_grid_pinpoints": []}, {"image_grid_pinpoints": []}, "`image_grid_pinpoints` is no list"),
    ({"image_grid_pinpoints": [[20, 84]]}, {"image_grid_pinpoints": [[20, 84]]}, "of at least a tile (42x42)"),
    (None, {"crop_size": {"height": 56, "width": 56}}, "56x56 tiles are not the vision tower's image_size (42)"),
])
def test_a_llava_next_the_frontend_cannot_count_is_refused(next_dir, tok, tmp_path, config, processor, message):
    with pytest.raises(VisionModelError) as raised:
        vision_spec(_variant(next_dir, tmp_path, config, processor), tok)
    assert message in str(raised.value) and "a llava_next model" in str(raised.value)


def test_pinpoints_from_config_json_alone(next_dir, tok, tmp_path):
    """An image processor that leaves its grid resolutions to the model's config reads config.json's."""
    variant = _variant(next_dir, tmp_path)
    processor = json.loads((variant / "preprocessor_config.json").read_text())
    del processor["image_grid_pinpoints"]
    (variant / "preprocessor_config.json").write_text(json.dumps(processor))
    assert vision_spec(variant, tok).pinpoints == vision_spec(next_dir, tok).pinpoints


def test_generate_gives_each_image_its_sizes_placeholders(next_dir, tok, spec):
    """Three images of three sizes: the AddRequest's prompt is the one transformers' processor makes of the
    same text (its ``<image>`` expanded per image), and each ImageInput spans its own run."""
    from PIL import Image

    images = [llava.encoded_image(1, (64, 48)), llava.encoded_image(2, (30, 90)), llava.encoded_image(3, (200, 40))]
    urls = [f"data:image/png;base64,{base64.b64encode(image).decode()}" for image in images]
    frontend = Frontend(next_dir, max_input_tokens=300, max_total_tokens=400)
    try:
        inputs = f"one ![]({urls[0]}) two ![]({urls[1]}) three ![]({urls[2]})"
        status, _, body = frontend.post("/generate", {"inputs": inputs, "parameters": {"max_new_tokens": 2}})
        assert status == 200, body
        with frontend.sched.cond:
            add = frontend.sched.adds[last_rid(frontend)]
    finally:
        frontend.close()
    expected = llava.processor(next_dir)(text=f"one {llava.IMAGE_TOKEN} two {llava.IMAGE_TOKEN} three "
                                              f"{llava.IMAGE_TOKEN}",
                                         images=[Image.open(io.BytesIO(b)) for b in images], return_tensors="pt")
    assert add.input_ids == expected["input_ids"][0].tolist()
    counts = llava.image_token_counts(next_dir, images)
    assert [image.num_tokens for image in add.images] == counts == [spec.tokens_for(64, 48), spec.tokens_for(30, 90),
                                                                    spec.tokens_for(200, 40)]
    assert len(set(counts)) == 3
    assert all(add.input_ids[i.offset:i.offset + i.num_tokens] == [spec.image_token_id] * i.num_tokens
               for i in add.images)
