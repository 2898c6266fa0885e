"""Gemma 3's images, the frontend's side (frontend/vision_models.py ``_gemma3``, frontend/images.py): every image
takes ``mm_tokens_per_image`` placeholders (``<image_soft_token>``) whatever its size, set apart as transformers'
``Gemma3Processor`` expands the ``<start_of_image>`` its chat template writes: ``\\n\\n<start_of_image>``, the
placeholders, ``<end_of_image>\\n\\n``. The same ids come whether the prompt came as TGI's ``![](<url>)`` or
through the chat template, the template's ``<start_of_image>`` becoming the image rather than a second start.
Checked against transformers' processor over texts and sizes Hypothesis draws; then a real frontend on the tiny
checkpoint (llmbus.testing.gemma3_vl) and on a folder in gemma-3-4b-it's published form sends the AddRequest the
processor makes of the same prompt. Pan-and-scan is refused at start.
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
from llmbus.frontend.images import FetchRules, LoadedImage, PromptImages
from llmbus.frontend.vision_models import VisionModelError, VisionSpec, vision_spec
from llmbus.testing import gemma3_vl
from llmbus.testing.fake_scheduler import Frontend, last_add
from llmbus.testing.gemma3_vl import BOI, EOI, IMAGE_TOKEN, IMAGE_TOKENS
from llmbus.testing.llava import encoded_image

BLANK = "\n\n"

# google/gemma-3-4b-it's config.json, preprocessor_config.json and processor_config.json, as published (the text
# model's fields that no count reads left out)
GEMMA3_4B_CONFIG = {
    "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999, "eoi_token_index": 256000,
    "eos_token_id": [1, 106], "image_token_index": 262144, "initializer_range": 0.02, "mm_tokens_per_image": 256,
    "model_type": "gemma3",
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                    "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
    "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                      "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                      "patch_size": 14, "vision_use_head": False}}
GEMMA3_4B_PROCESSOR = {
    "do_convert_rgb": None, "do_normalize": True, "do_pan_and_scan": None, "do_rescale": True, "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5], "image_processor_type": "Gemma3ImageProcessor", "image_seq_length": 256,
    "image_std": [0.5, 0.5, 0.5], "pan_and_scan_max_num_crops": None, "pan_and_scan_min_crop_size": None,
    "pan_and_scan_min_ratio_to_activate": None, "processor_class": "Gemma3Processor", "resample": 2,
    "rescale_factor": 0.00392156862745098, "size": {"height": 896, "width": 896}}
GEMMA3_4B_PROCESSOR_CONFIG = {"image_seq_length": 256, "processor_class": "Gemma3Processor"}


@pytest.fixture(scope="module")
def tok(tiny_gemma3_vl_dir) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_gemma3_vl_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def spec(tiny_gemma3_vl_dir, tok) -> VisionSpec:
    return vision_spec(tiny_gemma3_vl_dir, tok)


@functools.cache
def processor(model_dir: Path):
    return gemma3_vl.processor(model_dir)


def data_url(data: bytes) -> str:
    return f"data:image/png;base64,{base64.b64encode(data).decode()}"


def _pil(datas: list[bytes]):
    from PIL import Image

    return [Image.open(io.BytesIO(data)) for data in datas]


def _variant(model_dir: Path, tmp_path: Path, config: dict | None = None, processor_config: dict | None = None,
             files: dict[str, dict] | None = None) -> Path:
    """A copy of ``model_dir``'s config files with ``config`` and ``processor_config`` merged in and ``files``
    written (the weights are not needed to count)."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, tmp_path)
    for name, change in (("config.json", config), ("preprocessor_config.json", processor_config)):
        data = json.loads((model_dir / name).read_text())
        data.update(change or {})
        (tmp_path / name).write_text(json.dumps(data))
    for name, data in (files or {}).items():
        (tmp_path / name).write_text(json.dumps(data))
    return tmp_path


# ------------------------------------------------------------------------------------------------
# The spec: the same count for every image, marks and blank lines around it
# ------------------------------------------------------------------------------------------------


def test_the_tiny_checkpoints_spec(spec, tok):
    assert type(spec) is VisionSpec and spec.family == "gemma3"
    assert (spec.image_token, spec.image_token_id) == (IMAGE_TOKEN, tok.token_to_id(IMAGE_TOKEN))
    assert spec.tokens_per_image == IMAGE_TOKENS == 16
    assert (spec.image_start, spec.image_end) == (f"{BLANK}{BOI}", f"{EOI}{BLANK}")
    assert spec.template_token == BOI  # what the chat template writes for an image
    assert spec.grid_for(32, 32) is None  # the placeholders are read as a sequence


@settings(max_examples=30, deadline=None)
@given(width=st.integers(1, 1500), height=st.integers(1, 1500))
@example(width=1, height=1500)
@example(width=32, height=32)  # the tower's own size
def test_every_image_takes_the_processors_count(spec, tiny_gemma3_vl_dir, width, height):
    """transformers' processor, run on an image of the size drawn, writes ``mm_tokens_per_image`` placeholders for
    it, as the spec counts."""
    from PIL import Image

    ids = list(processor(tiny_gemma3_vl_dir)(text=[BOI], images=[Image.new("RGB", (width, height))])["input_ids"][0])
    assert spec.tokens_for(width, height) == ids.count(spec.image_token_id) == IMAGE_TOKENS


def _loaded(data: bytes, width: int, height: int) -> LoadedImage:
    return LoadedImage(data, width, height, b"d" * m.IMAGE_DIGEST_BYTES)


@pytest.fixture(scope="module")
def images(spec):
    with ThreadPoolExecutor(1) as executor:
        yield PromptImages(spec, FetchRules(), executor)


# the text between images: words, spaces and newlines (which a BPE merges with the image's blank line), and Gemma's
# turn markers
pieces = st.lists(st.sampled_from(["a", "look", " ", "\n", "\n\n", ".", "<start_of_turn>", "user\n", "é"]),
                  max_size=5).map("".join)


sizes = st.tuples(st.integers(1, 80), st.integers(1, 80))


@settings(max_examples=60, deadline=None)
@given(first=pieces, rest=st.lists(st.tuples(sizes, pieces), max_size=3))
@example(first="a ", rest=[((40, 30), " b")])
@example(first="look\n\n", rest=[((40, 30), "\n\n"), ((3, 70), "")])  # the text's blank lines against the image's
def test_generate_text_is_laid_out_as_the_processor_lays_it_out(images, tok, tiny_gemma3_vl_dir, first, rest):
    """A prompt with ``![](<url>)`` where each image is, expanded, tokenized and placed as /generate does, gives the
    ids transformers' processor gives for the same text with ``<start_of_image>`` there, each image's
    placeholders right after its start."""
    from PIL import Image

    refs = [f"![]({i})" for i in range(len(rest))]
    loaded = {ref: _loaded(b"%d" % i, *shape) for i, (ref, (shape, _)) in enumerate(zip(refs, rest))}
    expanded, found = asyncio.run(images.expand(first + "".join(ref + after for ref, (_, after) in zip(refs, rest)),
                                                10_000, dict(loaded)))
    assert found == [loaded[ref] for ref in refs]
    ids = tok.encode(expanded).ids
    expected = processor(tiny_gemma3_vl_dir)(text=[first + "".join(BOI + after for _, after in rest)],
                                             images=[Image.new("RGB", shape) for shape, _ in rest] or None)
    assert ids == list(expected["input_ids"][0])
    placed = images.place(ids, found, cut=0)
    assert [image.num_tokens for image in placed] == [IMAGE_TOKENS] * len(rest)
    assert all(ids[image.offset - 1] == tok.token_to_id(BOI) for image in placed)


@pytest.mark.parametrize("text, expected", [
    ("a ![](x) b", "a {s}{pads}{e} b"),  # TGI's markdown: the marks and blank lines written
    ("a {s}![](x){e} b", "a {s}{pads}{e} b"),  # the whole layout around the reference already: kept, once
    ("![](x)![](x)", "{s}{pads}{e}{s}{pads}{e}"),
    ("look:\n\n![](x)\n\nok", "look:\n\n{s}{pads}{e}\n\nok"),  # the text's own blank lines are the text's
])
def test_each_image_stands_between_one_start_and_one_end(images, text, expected):
    image = _loaded(encoded_image(0, (20, 50)), 20, 50)
    marks = {"s": f"{BLANK}{BOI}", "e": f"{EOI}{BLANK}"}
    expanded, loaded = asyncio.run(images.expand(text.format(**marks), 1000, {"![](x)": image}))
    assert expanded == expected.format(**marks, pads=IMAGE_TOKEN * IMAGE_TOKENS)
    assert loaded == [image] * text.count("![](x)")


# ------------------------------------------------------------------------------------------------
# Checkpoints the frontend refuses, and gemma-3-4b-it's published form
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config, processor_config, files, message", [
    (None, {"do_pan_and_scan": True}, None, "turns on pan-and-scan (`do_pan_and_scan`), which is not served"),
    ({"mm_tokens_per_image": 15}, None, None, "8x8 patches do not pool into `mm_tokens_per_image` (15)"),
    ({"mm_tokens_per_image": 36}, None, None, "8x8 patches do not pool into `mm_tokens_per_image` (36)"),
    ({"mm_tokens_per_image": "16"}, None, None, "`mm_tokens_per_image` is no positive whole number: '16'"),
    ({"boi_token_index": 4097}, None, None, "`boi_token_index` (4097) is its `image_token_index` too"),
    ({"eoi_token_index": 99999}, None, None, "end of image token 99999 is not in tokenizer.json's vocabulary"),
    ({"image_token_index": None}, None, None, "config.json has no `image_token_index`: None"),
    (None, {"size": {"height": 64, "width": 64}}, None, "does not resize images to the vision tower's image_size"),
    (None, {"do_resize": False}, None, "does not resize images to the vision tower's image_size (32)"),
    (None, {"image_seq_length": 256}, None, "preprocessor_config.json's `image_seq_length` (256) is not config.json's "
                                            "`mm_tokens_per_image` (16)"),
    (None, None, {"processor_config.json": GEMMA3_4B_PROCESSOR_CONFIG},
     "processor_config.json's `image_seq_length` (256) is not"),
])
def test_a_gemma3_the_frontend_cannot_lay_out_is_refused(tiny_gemma3_vl_dir, tmp_path, config, processor_config,
                                                         files, message):
    variant = _variant(tiny_gemma3_vl_dir, tmp_path, config, processor_config, files)
    with pytest.raises(VisionModelError) as raised:
        vision_spec(variant, Tokenizer.from_file(str(variant / "tokenizer.json")))
    assert message in str(raised.value) and "a gemma3 model whose image tokens" in str(raised.value)


def test_a_gemma3_folder_without_an_image_processor_is_a_text_model(tiny_gemma3_vl_dir, tmp_path):
    """As its ranks serve it (text only, the vision side not loaded): no spec, so the frontend starts as a text
    model's and refuses images, instead of refusing the folder."""
    variant = _variant(tiny_gemma3_vl_dir, tmp_path)
    (variant / "preprocessor_config.json").unlink()
    assert vision_spec(variant, Tokenizer.from_file(str(variant / "tokenizer.json"))) is None


@pytest.mark.parametrize("pan_and_scan", [None, False])
def test_pan_and_scan_off_is_served(tiny_gemma3_vl_dir, tmp_path, pan_and_scan):
    variant = _variant(tiny_gemma3_vl_dir, tmp_path, processor_config={"do_pan_and_scan": pan_and_scan},
                       files={"processor_config.json": {"image_seq_length": IMAGE_TOKENS}})
    assert vision_spec(variant, Tokenizer.from_file(str(variant / "tokenizer.json"))).tokens_per_image == IMAGE_TOKENS


def test_pan_and_scan_stops_the_frontend_at_start(tiny_gemma3_vl_dir, tmp_path):
    variant = _variant(tiny_gemma3_vl_dir, tmp_path, processor_config={"do_pan_and_scan": True})
    with pytest.raises(VisionModelError) as raised:
        Frontend(variant).close()
    assert "\n" not in str(raised.value)
    assert str(raised.value).endswith("a gemma3 model whose image tokens the frontend cannot count: "
                                      "preprocessor_config.json turns on pan-and-scan (`do_pan_and_scan`), which is "
                                      "not served: set it to false")


@pytest.fixture(scope="module")
def gemma3_4b_dir(tiny_gemma3_vl_dir, tmp_path_factory) -> Path:
    """gemma-3-4b-it's config files as published, over the tiny tokenizer with Gemma 3's three image tokens moved to
    the published ids (the spec checks each id against the tokenizer: the tiny ones would not do)."""
    path = tmp_path_factory.mktemp("gemma-3-4b-it")
    tokenizer = json.loads((tiny_gemma3_vl_dir / "tokenizer.json").read_text())
    ids = {BOI: 255999, EOI: 256000, IMAGE_TOKEN: 262144}
    for token in tokenizer["added_tokens"]:
        token["id"] = ids.get(token["content"], token["id"])
    tokenizer["model"]["vocab"].update(ids)  # tokenizers keeps an added token's id where the model's vocab has it
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    shutil.copy(tiny_gemma3_vl_dir / "tokenizer_config.json", path)
    for name, data in (("config.json", GEMMA3_4B_CONFIG), ("preprocessor_config.json", GEMMA3_4B_PROCESSOR),
                       ("processor_config.json", GEMMA3_4B_PROCESSOR_CONFIG)):
        (path / name).write_text(json.dumps(data))
    return path


def test_gemma_3_4b_its_published_config_takes_256_placeholders_an_image(gemma3_4b_dir):
    """Read from the published files: 256 placeholders, id 262144, between 255999 and 256000; a real frontend's
    /generate and /tokenize give the ids transformers' processor (from_pretrained, as its users load it) gives."""
    import transformers

    tok = Tokenizer.from_file(str(gemma3_4b_dir / "tokenizer.json"))
    spec = vision_spec(gemma3_4b_dir, tok)
    assert (spec.family, spec.image_token, spec.image_token_id, spec.tokens_per_image) == (
        "gemma3", IMAGE_TOKEN, 262144, 256)
    assert (spec.tokens_for(896, 896), spec.tokens_for(3000, 20)) == (256, 256)
    data = encoded_image(3, (60, 40))
    fe = Frontend(gemma3_4b_dir, max_input_tokens=600, max_total_tokens=700)
    try:
        inputs = f"one ![]({data_url(data)}) two ![]({data_url(data)})"
        status, _, body = fe.post("/generate", {"inputs": inputs, "parameters": {"max_new_tokens": 2}})
        assert status == 200, body
        add = last_add(fe)
        status, _, tokens = fe.post("/tokenize", {"inputs": inputs})
        assert status == 200 and [t["id"] for t in tokens] == add.input_ids
    finally:
        fe.close()
    proc = transformers.Gemma3Processor.from_pretrained(gemma3_4b_dir)
    assert proc.image_seq_length == 256
    expected = proc(text=[f"one {BOI} two {BOI}"], images=_pil([data, data]))
    assert add.input_ids == list(expected["input_ids"][0])
    assert [(image.num_tokens, image.grid) for image in add.images] == [(256, [])] * 2
    for image in add.images:
        assert add.input_ids[image.offset - 1] == 255999 and add.input_ids[image.offset + 256] == 256000
    assert add.input_ids.count(262144) == 512


# ------------------------------------------------------------------------------------------------
# The frontend, end to end: what the scheduler receives, against transformers' processor
# ------------------------------------------------------------------------------------------------


SHAPES = [(30, 90), (200, 40), (32, 32)]  # (width, height): the same count for each
IMAGES = [encoded_image(i + 1, shape) for i, shape in enumerate(SHAPES)]


@pytest.fixture(scope="module")
def fe(tiny_gemma3_vl_dir):
    frontend = Frontend(tiny_gemma3_vl_dir, max_input_tokens=300, max_total_tokens=400)
    yield frontend
    frontend.close()


def assert_images_as_the_processor_lays_them_out(add: m.AddRequest, expected, tok: Tokenizer,
                                                 datas: list[bytes]) -> None:
    """``add``'s prompt is transformers' ``expected`` (its processor's output), and each image stands where its
    placeholders do: after one blank line and start, before one end and blank line."""
    ids = add.input_ids
    assert ids == list(expected["input_ids"][0])
    image_id, boi, eoi = (tok.token_to_id(t) for t in (IMAGE_TOKEN, BOI, EOI))
    blank = tok.encode(BLANK, add_special_tokens=False).ids
    assert [(image.num_tokens, image.grid) for image in add.images] == [(IMAGE_TOKENS, [])] * len(datas)
    assert [image.data for image in add.images] == datas
    assert ids.count(boi) == ids.count(eoi) == len(datas)
    for image in add.images:
        assert ids[image.offset - 1] == boi and ids[image.offset + image.num_tokens] == eoi
        assert ids[image.offset:image.offset + image.num_tokens] == [image_id] * image.num_tokens
    assert add.problem(vocab_size=len(tok.get_vocab())) is None
    assert blank and all(tok.decode(ids[i.offset - 1 - len(blank):i.offset - 1]).endswith(BLANK)
                         for i in add.images)


def test_generate_gives_the_processors_prompt_and_layout(fe, tok, tiny_gemma3_vl_dir):
    """Three images of three sizes in TGI's markdown: the prompt transformers' processor makes of the same text with
    ``<start_of_image>`` where each image is; /tokenize counts the same tokens."""
    inputs = " and ".join(f"image {i} ![]({data_url(data)})" for i, data in enumerate(IMAGES)) + " differ?"
    status, _, body = fe.post("/generate", {"inputs": inputs, "parameters": {"max_new_tokens": 2}})
    assert status == 200, body
    add = last_add(fe)
    text = " and ".join(f"image {i} {BOI}" for i in range(len(IMAGES))) + " differ?"
    expected = processor(tiny_gemma3_vl_dir)(text=[text], images=_pil(IMAGES))
    assert_images_as_the_processor_lays_them_out(add, expected, tok, IMAGES)
    status, _, tokens = fe.post("/tokenize", {"inputs": inputs})
    assert status == 200 and [t["id"] for t in tokens] == add.input_ids


def test_chat_image_parts_give_the_processors_prompt_and_layout(fe, tok, tiny_gemma3_vl_dir):
    """OpenAI image_url parts through the checkpoint's template, which writes ``<start_of_image>`` for each:
    transformers' ``apply_chat_template`` of the same parts, then its processor; each image started once."""
    content = [{"type": "text", "text": "Compare"}, {"type": "image_url", "image_url": {"url": data_url(IMAGES[0])}},
               {"type": "text", "text": "with"}, {"type": "image_url", "image_url": {"url": data_url(IMAGES[2])}},
               {"type": "image_url", "image_url": {"url": data_url(IMAGES[1])}}]
    messages = [{"role": "user", "content": content}]
    status, _, body = fe.post("/v1/chat/completions", {"messages": messages, "max_tokens": 2})
    assert status == 200, body
    add = last_add(fe)
    parts = [{"type": "image"} if part["type"] == "image_url" else part for part in content]
    proc = processor(tiny_gemma3_vl_dir)
    templated = proc.apply_chat_template([{"role": "user", "content": parts}], tokenize=False,
                                         add_generation_prompt=True)
    assert templated.count(BOI) == 3 and BLANK not in templated
    datas = [IMAGES[0], IMAGES[2], IMAGES[1]]
    # the template writes the BOS itself: the frontend tokenizes a rendered template as it stands, and so does the
    # processor here
    expected = proc(text=[templated], images=_pil(datas), add_special_tokens=False)
    assert_images_as_the_processor_lays_them_out(add, expected, tok, datas)
    status, _, tokenized = fe.post("/chat_tokenize", {"messages": messages})
    assert status == 200 and [t["id"] for t in tokenized["tokenize_response"]] == add.input_ids
    # the template's <start_of_image> is where the image's reference went, not a second start before it
    assert BOI not in tokenized["templated_text"]
    assert f"<start_of_turn>user\nCompare![]({data_url(IMAGES[0])})with" in tokenized["templated_text"]


def test_a_start_of_image_typed_in_a_chat_message_is_refused(fe):
    content = [{"type": "text", "text": f"see {BOI} here"}, {"type": "image_url", "image_url": {"url":
                                                                                             data_url(IMAGES[0])}}]
    status, _, body = fe.post("/v1/chat/completions", {"messages": [{"role": "user", "content": content}],
                                                       "max_tokens": 2})
    assert status == 422 and "the chat template wrote 2 image tokens (<start_of_image>)" in body["error"]["message"]


def test_truncate_keeps_an_images_start_mark(fe, tok):
    inputs = f"a long preamble of words ![]({data_url(IMAGES[1])}) what is it?"
    status, _, tokens = fe.post("/tokenize", {"inputs": inputs})
    ids = [t["id"] for t in tokens]
    keep = len(ids) - ids.index(tok.token_to_id(BOI))
    for kept in (keep, keep + 1):  # from the start mark, or from the blank line before it
        status, _, body = fe.post("/generate", {"inputs": inputs,
                                                "parameters": {"max_new_tokens": 2, "truncate": kept}})
        assert status == 200, body
        add = last_add(fe)
        assert add.input_ids == ids[-kept:] and [image.offset for image in add.images] == [1 + kept - keep]
    status, _, body = fe.post("/generate", {"inputs": inputs,
                                            "parameters": {"max_new_tokens": 2, "truncate": keep - 1}})
    assert status == 422 and body["error"].startswith("Input validation error: `truncate` would cut into an image")
