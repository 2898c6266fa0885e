"""Images in prompts, the frontend's side (frontend/images.py, frontend/vision_models.py): which models read
images and how many placeholder tokens an image takes; TGI's ``![](<url>)`` references loaded (base64 data
URLs, http fetches from a local aiohttp server) and checked, with TGI's error texts; the placeholders placed
in the tokens; and, end to end, the ``AddRequest`` a fake scheduler receives from a real frontend serving
the tiny LLaVA checkpoint's folder (llmbus.testing.llava).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import shutil
import time
import warnings
from pathlib import Path

import pytest
from PIL import Image
from tokenizers import Tokenizer

from llmbus.bus import messages as m
from llmbus.frontend.errors import ApiError
from llmbus.frontend.images import (MARKDOWN_IMAGE, FetchRules, LoadedImage, PromptImages, check_image,
                                    decode_data_url, markdown_image, refuse_decompression_bombs)
from llmbus.frontend.vision_models import VisionModelError, vision_spec
from llmbus.testing.fake_scheduler import WAIT, Frontend, last_add
from llmbus.testing.image_server import ImageServer
from llmbus.testing.llava import IMAGE_TOKEN, IMAGE_TOKENS, encoded_image

PNG = encoded_image(0)  # 64x48
JPEG = encoded_image(1, (40, 30), "JPEG")
TOKENS = IMAGE_TOKENS  # the tiny LLaVA's: (56 // 14) ** 2 patches, CLS dropped


def data_url(data: bytes, mimetype: str = "image/png") -> str:
    return f"data:{mimetype};base64,{base64.b64encode(data).decode()}"


def md(url: str) -> str:
    return f"![]({url})"


def digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=m.IMAGE_DIGEST_BYTES).digest()


def validation_text(call) -> str:
    """The detail of the validation error ``call()`` raises."""
    with pytest.raises(ApiError) as raised:
        call()
    assert raised.value.status == 422 and raised.value.error_type == "validation"
    prefix = "Input validation error: "
    assert raised.value.message.startswith(prefix)
    return raised.value.message[len(prefix):]


@pytest.fixture(scope="module")
def llava_dir(tiny_llava_dir) -> Path:
    return tiny_llava_dir


@pytest.fixture(scope="module")
def tok(llava_dir) -> Tokenizer:
    return Tokenizer.from_file(str(llava_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def spec(llava_dir, tok):
    return vision_spec(llava_dir, tok)


# ------------------------------------------------------------------------------------------------
# Which models read images, and how many tokens an image takes
# ------------------------------------------------------------------------------------------------


def test_tiny_llava_spec(spec, tok):
    assert (spec.family, spec.image_token, spec.tokens_per_image) == ("llava", IMAGE_TOKEN, TOKENS)
    assert spec.image_token_id == tok.token_to_id(IMAGE_TOKEN) and spec.tokens_for(640, 480) == TOKENS


def _variant(llava_dir: Path, tmp_path: Path, config: dict | None = None, processor: dict | None = None,
             drop: tuple[str, ...] = ()) -> Path:
    """A copy of the tiny LLaVA's configs with ``config`` and ``processor`` merged in (None values
    delete their key) and the ``drop`` keys of config.json's vision_config removed."""
    out = {}
    for name, change in (("config.json", config), ("preprocessor_config.json", processor)):
        data = json.loads((llava_dir / name).read_text())
        for key, value in (change or {}).items():
            if value is None:
                data.pop(key, None)
            else:
                data[key] = value
        out[name] = data
    for key in drop:
        del out["config.json"]["vision_config"][key]
    for name, data in out.items():
        (tmp_path / name).write_text(json.dumps(data))
    return tmp_path


@pytest.mark.parametrize("config, processor, tokens", [
    ({"vision_feature_select_strategy": "full"}, None, 17),  # CLS row kept
    ({"vision_feature_layer": [-2, -5]}, None, 16),  # several layers concatenated: the same rows
    ({"vision_feature_select_strategy": None}, None, 16),  # transformers' default: "default"
    ({"image_token_index": None, "image_token_id": 4096}, None, 16),  # the newer key
    ({"vision_config": {"model_type": "siglip_vision_model", "patch_size": 14}}, None, 15),  # no CLS row to drop
    ({"vision_config": {"model_type": "siglip_vision_model", "patch_size": 14},
      "vision_feature_select_strategy": "full"}, None, 16),
    (None, {"do_center_crop": False, "size": {"height": 42, "width": 56}}, 12),  # resized to a box, not cropped
    (None, {"crop_size": 28}, 4),  # a crop given as one number
    (None, {"crop_size": {"shortest_edge": 84}}, 36),
])
def test_tokens_per_image(llava_dir, tok, tmp_path, config, processor, tokens):
    assert vision_spec(_variant(llava_dir, tmp_path, config, processor), tok).tokens_per_image == tokens


@pytest.mark.parametrize("config, processor, drop, message", [
    ({"image_token_index": None}, None, (), "config.json names no image token"),
    ({"image_token_index": 99999}, None, (), "image token 99999 is not in tokenizer.json's vocabulary"),
    # a vocabulary entry, not an added token: its text ("Ġthere") is not what the text " there" tokenizes from
    ({"image_token_index": "Ġthere"}, None, (), "does not tokenize as itself"),
    (None, None, ("patch_size",), "vision_config has no `patch_size`"),
    (None, {"do_center_crop": False}, (), "resizes the shortest edge without a center crop"),
    (None, {"crop_size": {"depth": 3}}, (), "`crop_size` gives no image size"),
])
def test_uncountable_vision_model_is_refused(llava_dir, tok, tmp_path, config, processor, drop, message):
    if config and isinstance(config.get("image_token_index"), str):
        config = {"image_token_index": tok.token_to_id(config["image_token_index"])}
    with pytest.raises(VisionModelError) as raised:
        vision_spec(_variant(llava_dir, tmp_path, config, processor, drop), tok)
    assert message in str(raised.value) and "a llava model whose image tokens the frontend cannot count" in str(
        raised.value)


def test_missing_preprocessor_config_is_refused(llava_dir, tok, tmp_path):
    shutil.copy(llava_dir / "config.json", tmp_path)
    with pytest.raises(VisionModelError, match="no preprocessor_config.json"):
        vision_spec(tmp_path, tok)


def test_a_text_model_reads_no_images(llava_dir, tok, tmp_path):
    assert vision_spec(_variant(llava_dir, tmp_path, {"model_type": "llama"}), tok) is None


# ------------------------------------------------------------------------------------------------
# Data URLs and decoding, with TGI's texts
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("data, mimetype, size", [
    (PNG, "image/png", (64, 48)), (JPEG, "image/jpeg", (40, 30)), (JPEG, "image/jpg", (40, 30)),
    (encoded_image(2, (20, 10), "GIF"), "image/gif", (20, 10)),
    (encoded_image(3, (8, 9), "WEBP"), "image/webp", (8, 9)),
    (encoded_image(4, (5, 6), "TIFF"), "image/tiff", (5, 6)),
    (encoded_image(5, (7, 7), "BMP"), "image/bmp", (7, 7)),  # a type TGI has no decoder named for: guessed
    (PNG, "", (64, 48)),
])
def test_data_urls_decode(data, mimetype, size):
    decoded, declared = decode_data_url(data_url(data, mimetype))
    assert (decoded, declared) == (data, mimetype)
    assert check_image(decoded, declared) == size


@pytest.mark.parametrize("url, message", [
    ("data:image/png;charset=utf-8;base64,AAAA", "invalid image content: image/png;charset=utf-8;base64,AAAA"),
    ("data:image/png,AAAA", "invalid image content: image/png,AAAA"),
    ("data:image/png;utf8,<svg/>", "invalid image content: utf8,<svg/>"),
    ("data:image/png;base64,AA!A", "base64 encoding is invalid: "),
    ("data:image/png;base64,AAA", "base64 encoding is invalid: "),  # padding is required
    ("data:image/png;base64," + "A" * 1000 + "!", "base64 encoding is invalid: "),
])
def test_data_url_errors(url, message):
    assert validation_text(lambda: decode_data_url(url)).startswith(message)


def test_a_long_bad_reference_is_echoed_cut():
    text = validation_text(lambda: decode_data_url("data:image/png;" + "x" * 5000))
    assert text.startswith("invalid image content: xxxx") and text.endswith("...") and len(text) < 200


@pytest.mark.parametrize("data, mimetype, message", [
    (JPEG, "image/png", "invalid image: the data is not a PNG image (image/png)"),
    (b"hello, not an image", "image/x-unknown", "invalid image: The image format could not be determined"),
    (b"hello, not an image", None, "invalid image: The image format could not be determined"),
    (b"", "image/png", "invalid image: the data is not a PNG image"),
    (PNG[:len(PNG) // 2], "image/png", "invalid image: "),  # truncated: the header reads, the pixels do not
])
def test_what_does_not_decode_is_an_invalid_image(data, mimetype, message):
    assert validation_text(lambda: check_image(data, mimetype)).startswith(message)


@pytest.mark.parametrize("limit", [2000, 1000])  # Pillow's warning zone (up to twice the limit), then its error
@pytest.mark.parametrize("served", [True, False])  # the filter a vision model's frontend sets, or none
def test_decompression_bombs_are_invalid_images(monkeypatch, limit, served):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", limit)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if served:
            refuse_decompression_bombs()
        text = validation_text(lambda: check_image(PNG, "image/png"))  # 64 x 48 = 3072 pixels
    assert text == f"invalid image: more than {limit} pixels (a possible decompression bomb)"
    warned = [w for w in caught if issubclass(w.category, Image.DecompressionBombWarning)]
    assert len(warned) == (0 if served or limit == 1000 else 1)


# ------------------------------------------------------------------------------------------------
# Fetching over http, from a local aiohttp server
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    srv = ImageServer(PNG, JPEG)
    yield srv
    srv.close()


# ------------------------------------------------------------------------------------------------
# A prompt's images: references expanded into placeholders, placeholders placed in the tokens
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def images(spec):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as executor:
        yield PromptImages(spec, FetchRules(1 << 20, WAIT), executor)


def expand(images: PromptImages, text: str, max_input_tokens: int = 1000, loaded=None):
    return asyncio.run(images.expand(text, max_input_tokens, loaded))


def test_tgi_pattern():
    text = "a ![](x) b ![alt](y) ![](z)) ![](  ) ![] (w)"
    assert [m.group() for m in MARKDOWN_IMAGE.finditer(text)] == ["![](x)", "![](z)", "![](  )"]


def test_a_chat_images_url_stays_one_reference():
    written = markdown_image("http://host/a_(1).png")
    assert written == "![](http://host/a_(1%29.png)" and MARKDOWN_IMAGE.fullmatch(written)


def test_expand_replaces_each_reference_in_order(images, server):
    text, loaded = expand(images, f"look {md(data_url(PNG))} and{md(server.url + '/img.jpg')}!")
    assert text == f"look {IMAGE_TOKEN * TOKENS} and{IMAGE_TOKEN * TOKENS}!"
    assert [(i.data, i.width, i.height, i.digest) for i in loaded] == [
        (PNG, 64, 48, digest(PNG)), (JPEG, 40, 30, digest(JPEG))]
    assert expand(images, "no images here") == ("no images here", [])


def test_each_reference_loads_once_per_request(images, server):
    before = server.hits.get("/img.png", 0)
    loaded: dict = {}
    ref = md(server.url + "/img.png")
    expand(images, ref + ref, loaded=loaded)
    expand(images, "again " + ref, loaded=loaded)  # another choice of the same request
    assert server.hits["/img.png"] == before + 1


@pytest.mark.parametrize("text, message", [
    ("see ![](ftp://host/a.png)", "invalid image content: ![](ftp://host/a.png)"),
    ("see ![](HTTP://host/a.png)", "invalid image content: ![](HTTP://host/a.png)"),  # TGI's prefixes are exact
    ("see ![](img.png)", "invalid image content: ![](img.png)"),
    (f"{md(data_url(PNG))} then {md(data_url(b'junk'))}", "invalid image: the data is not a PNG image"),
])
def test_expand_errors(images, text, message):
    assert validation_text(lambda: expand(images, text)).startswith(message)


def test_the_first_failure_stops_the_other_fetches(images, server):
    started = time.monotonic()
    text = f"{md(server.url + '/hang')} {md('data:image/png;base64,!!')}"
    assert validation_text(lambda: expand(images, text)).startswith("base64 encoding is invalid")
    assert time.monotonic() - started < WAIT / 2  # not the hanging fetch's timeout


def test_more_images_than_the_prompt_holds_fetch_nothing(images, server):
    before = server.hits.get("/img.jpg", 0)
    text = md(server.url + "/img.jpg") * 3
    assert validation_text(lambda: expand(images, text, max_input_tokens=3 * TOKENS - 1)) == (
        f"`inputs` holds 3 images, which take at least {3 * TOKENS} tokens: `inputs` must have less than "
        f"{3 * TOKENS - 1} tokens")
    assert server.hits.get("/img.jpg", 0) == before


def _image(seed: int) -> LoadedImage:
    data = bytes([seed]) * 10
    return LoadedImage(data, 56, 56, digest(data))


def test_place_finds_each_images_run(images, spec):
    t = spec.image_token_id
    ids = [0, 5, 6] + [t] * TOKENS + [7] + [t] * (2 * TOKENS) + [8]  # the last two images side by side
    a, b, c = _image(1), _image(2), _image(3)
    placed = images.place(ids, [a, b, c], cut=0)
    assert [(p.offset, p.num_tokens, p.data, p.digest) for p in placed] == [
        (3, TOKENS, a.data, a.digest), (4 + TOKENS, TOKENS, b.data, b.digest),
        (4 + 2 * TOKENS, TOKENS, c.data, c.digest)]
    placed = images.place(ids, [a, b, c], cut=3)  # truncation kept the prompt from the first image on
    assert [p.offset for p in placed] == [0, 1 + TOKENS, 1 + 2 * TOKENS]
    assert images.place([0, 5, 6], [], cut=0) == []


@pytest.mark.parametrize("extra_before, extra_after, n_images", [
    (1, 0, 1), (0, 1, 1), (0, 0, 0), (0, -1, 1),
])
def test_image_tokens_where_no_image_stands_are_refused(images, spec, extra_before, extra_after, n_images):
    t = spec.image_token_id
    ids = [0, 5] + [t] * (TOKENS + extra_before + extra_after) + [6]
    text = validation_text(lambda: images.place(ids, [_image(i) for i in range(n_images)], cut=0))
    assert text == (f"the prompt holds {TOKENS + extra_before + extra_after} image tokens ({IMAGE_TOKEN}) where "
                    f"its images take {TOKENS * n_images}: an image is written ![](<url>), and the image token "
                    f"may not appear otherwise")


def test_a_stray_image_token_elsewhere_is_refused(images, spec):
    t = spec.image_token_id
    with pytest.raises(ApiError):
        images.place([0] + [t] * TOKENS + [5, t, 6], [_image(1)], cut=0)


def test_a_requests_images_stay_under_the_bus_limit(images, spec):
    """The bus carries a request's images in one message: more than m.MAX_IMAGE_BYTES together is refused."""
    from llmbus.bus import messages as m

    half = m.MAX_IMAGE_BYTES // 2
    big = [LoadedImage(bytes([i]) * (half + i), 56, 56, digest(bytes([i]))) for i in range(2)]
    ids = [0] + [spec.image_token_id] * (2 * TOKENS)
    assert len(images.place(ids, [big[0], _image(1)], cut=0)) == 2
    assert validation_text(lambda: images.place(ids, big, cut=0)) == (
        f"a request's images must be at most {m.MAX_IMAGE_BYTES} bytes together. Given: {2 * half + 1} bytes "
        f"in 2 images")


def test_truncation_may_not_cut_an_image(images, spec):
    ids = [0, 5, 6] + [spec.image_token_id] * TOKENS + [7, 8]
    assert validation_text(lambda: images.place(ids, [_image(1)], cut=4)) == (
        f"`truncate` would cut into an image: the prompt's last {len(ids) - 4} tokens are kept, and its first "
        f"image begins {len(ids) - 3} tokens from its end")


# ------------------------------------------------------------------------------------------------
# The frontend, end to end: what the scheduler receives
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fe(llava_dir):
    frontend = Frontend(llava_dir, max_input_tokens=200, max_total_tokens=256, max_image_fetch_size=2000)
    yield frontend
    frontend.close()


def assert_images(add: m.AddRequest, expected_ids: list[int], datas: list[bytes], image_id: int) -> None:
    assert add.input_ids == expected_ids
    assert add.problem(vocab_size=4097) is None
    assert [i.data for i in add.images] == datas and [i.digest for i in add.images] == [digest(d) for d in datas]
    assert all(i.num_tokens == TOKENS for i in add.images)
    runs = [i for i, t in enumerate(expected_ids) if t == image_id and (i == 0 or expected_ids[i - 1] != image_id)]
    assert [i.offset for i in add.images] == runs and len(runs) == len(datas)


def test_generate_sends_the_images_with_their_placeholders(fe, tok, spec):
    inputs = f"Compare {md(data_url(PNG))} with{md(data_url(JPEG, 'image/jpeg'))} please"
    status, _, body = fe.post("/generate", {"inputs": inputs, "parameters": {"max_new_tokens": 5}})
    assert status == 200, body
    expected = tok.encode(f"Compare {IMAGE_TOKEN * TOKENS} with{IMAGE_TOKEN * TOKENS} please").ids
    assert_images(last_add(fe), expected, [PNG, JPEG], spec.image_token_id)


def test_tokenize_shows_the_placeholders(fe, tok, spec):
    status, _, tokens = fe.post("/tokenize", {"inputs": f"what {md(data_url(JPEG, 'image/jpeg'))}?"})
    assert status == 200, tokens
    assert [t["id"] for t in tokens] == tok.encode(f"what {IMAGE_TOKEN * TOKENS}?").ids
    assert [t["text"] for t in tokens if t["id"] == spec.image_token_id] == [IMAGE_TOKEN] * TOKENS
    status, _, counted = fe.post("/tokenize", {"prompt": f"what {md(data_url(JPEG, 'image/jpeg'))}?"})  # vLLM's
    assert counted["count"] == len(tokens)


def test_generate_with_truncate_keeps_the_images_whole(fe, tok, spec):
    inputs = f"a long preamble of words {md(data_url(PNG))} what is it?"
    full = tok.encode(f"a long preamble of words {IMAGE_TOKEN * TOKENS} what is it?").ids
    start = full.index(spec.image_token_id)
    keep = len(full) - start
    status, _, body = fe.post("/generate", {"inputs": inputs, "parameters": {"max_new_tokens": 5, "truncate": keep}})
    assert status == 200, body
    assert_images(last_add(fe), full[start:], [PNG], spec.image_token_id)
    status, _, body = fe.post("/generate", {"inputs": inputs,
                                            "parameters": {"max_new_tokens": 5, "truncate": keep - 1}})
    assert status == 422 and body["error"].startswith("Input validation error: `truncate` would cut into an image")


def test_generate_errors_are_tgis(fe):
    status, _, body = fe.post("/generate", {"inputs": f"x {md('data:image/png;base64,@@@@')}",
                                            "parameters": {"max_new_tokens": 5}})
    assert status == 422 and body["error_type"] == "validation"
    assert body["error"].startswith("Input validation error: base64 encoding is invalid: ")
    status, _, body = fe.post("/generate", {"inputs": f"what is {IMAGE_TOKEN}?", "parameters": {"max_new_tokens": 5}})
    assert status == 422 and "image token may not appear otherwise" in body["error"]


def test_http_images_are_fetched_under_the_flags_cap(fe, server, spec):
    status, _, body = fe.post("/generate", {"inputs": f"what {md(server.url + '/img.jpg')}",
                                            "parameters": {"max_new_tokens": 5}})
    assert status == 200, body
    assert [i.data for i in last_add(fe).images] == [JPEG]
    status, _, body = fe.post("/generate", {"inputs": f"what {md(server.url + '/img.png')}",
                                            "parameters": {"max_new_tokens": 5}})
    assert len(JPEG) <= 2000 < len(PNG)
    assert (status, body["error"]) == (422, f"Input validation error: Image size {len(PNG)} bytes exceeds "
                                            f"maximum allowed size of 2000 bytes")


def test_chat_image_parts_become_images(fe, tok, spec):
    content = [{"type": "text", "text": "Describe "}, {"type": "image_url", "image_url": {"url": data_url(PNG)}},
               {"type": "text", "text": " briefly"}]
    status, _, body = fe.post("/v1/chat/completions", {"messages": [{"role": "user", "content": content}],
                                                       "max_tokens": 5})
    assert status == 200, body
    # the template read content parts (it writes an image part as "<image>\n"), and the image's reference took
    # the place of the image token it wrote: what /chat_tokenize shows
    _, _, tokenized = fe.post("/chat_tokenize", {"messages": [{"role": "user", "content": content}]})
    templated = tokenized["templated_text"]
    assert templated.startswith(f"USER: Describe {md(data_url(PNG))}\n briefly")
    expected = tok.encode(templated.replace(md(data_url(PNG)), IMAGE_TOKEN * TOKENS), add_special_tokens=False).ids
    assert_images(last_add(fe), expected, [PNG], spec.image_token_id)
    assert [t["id"] for t in tokenized["tokenize_response"]] == expected


# A template that prints a message's content as it is (TGI's form: the image a reference in the text); one that
# picks a message's parts by type, images first (as llava-hf's templates do: a plain string's text would be
# lost); one that writes text parts only (its images would be lost).
STRING_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
PARTS_TEMPLATE = ("{% for m in messages %}{{ m['role'].upper() }}: "
                  "{% for p in m['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\\n' }}{% endfor %}"
                  "{% for p in m['content'] | selectattr('type', 'equalto', 'text') %}{{ p['text'] + ' ' }}{% endfor %}"
                  "{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}")
TEXT_ONLY_TEMPLATE = ("{% for m in messages %}{% for p in m['content'] %}{% if p['type'] == 'text' %}{{ p['text'] }}"
                      "{% endif %}{% endfor %}{% endfor %}")


@pytest.mark.parametrize("template, reads_parts, expected", [
    (STRING_TEMPLATE, False, "user: Look: ![](a) and ![](b)!\n"),
    (PARTS_TEMPLATE, True, "USER: ![](a)\n![](b)\nLook:   and  ! ASSISTANT:"),
])
def test_templates_get_images_as_they_read_them(tmp_path, template, reads_parts, expected):
    from llmbus.frontend.chat import ChatTemplate

    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    chat = ChatTemplate(tmp_path)
    assert chat.reads_content_parts is reads_parts
    assert chat.render([{"role": "user", "content": "Look: ![](a) and ![](b)!"}], image_token=IMAGE_TOKEN) == expected


def test_a_template_that_drops_images_is_refused(tmp_path):
    from llmbus.frontend.chat import ChatTemplate

    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEXT_ONLY_TEMPLATE}))
    chat = ChatTemplate(tmp_path)
    assert chat.reads_content_parts
    with pytest.raises(ApiError) as caught:
        chat.render([{"role": "user", "content": "Look: ![](a)"}], image_token=IMAGE_TOKEN)
    assert "the chat template wrote 0 image tokens (<image>) for the conversation's 1 images" in str(caught.value)
    # a message without images reaches it as a text part too: a plain string's text would be lost
    assert chat.render([{"role": "user", "content": "Look"}], image_token=IMAGE_TOKEN) == "Look"


def test_chat_choices_share_one_fetch(fe, server):
    before = server.hits.get("/img.jpg", 0)
    content = [{"type": "image_url", "image_url": {"url": server.url + "/img.jpg", "detail": "low"}}]
    status, _, body = fe.post("/v1/chat/completions", {"messages": [{"role": "user", "content": content}],
                                                       "max_tokens": 5, "n": 2, "temperature": 0.5})
    assert status == 200 and len(body["choices"]) == 2, body
    assert server.hits["/img.jpg"] == before + 1
    with fe.sched.cond:
        adds = list(fe.sched.adds.values())[-2:]
    assert [[i.data for i in add.images] for add in adds] == [[JPEG], [JPEG]]


@pytest.mark.parametrize("part, message", [
    ({"type": "image_url", "image_url": {"url": 5}}, "`messages[0].content[0].image_url` must be an object with a "
                                                     "string `url`"),
    ({"type": "image_url", "image_url": "http://x/a.png"}, "`messages[0].content[0].image_url` must be an object"),
    ({"type": "input_audio", "input_audio": {}}, "`messages[0].content`: input_audio content is not supported by "
                                                 "this model; text and image_url parts are"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}, "base64 encoding is invalid"),
])
def test_chat_part_errors(fe, part, message):
    status, _, body = fe.post("/v1/chat/completions", {"messages": [{"role": "user", "content": [part]}],
                                                       "max_tokens": 5})
    assert status == 422 and message in body["error"]["message"], body


def test_anthropic_image_blocks_become_images(fe, server, spec):
    content = [{"type": "text", "text": "what are"},
               {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                            "data": base64.b64encode(PNG).decode()}},
               {"type": "image", "source": {"type": "url", "url": server.url + "/img.jpg"}}]
    body = {"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": content}]}
    status, _, answer = fe.post("/v1/messages", body)
    assert status == 200, answer
    add = last_add(fe)
    assert [i.data for i in add.images] == [PNG, JPEG] and add.problem(vocab_size=4097) is None
    status, _, counted = fe.post("/v1/messages/count_tokens", {k: v for k, v in body.items() if k != "max_tokens"})
    assert status == 200 and counted == {"input_tokens": len(add.input_ids)}  # the placeholders counted
    content = [{"type": "image", "source": {"type": "file", "file_id": "f"}}]
    status, _, answer = fe.post("/v1/messages", {**body, "messages": [{"role": "user", "content": content}]})
    assert status == 400 and "`messages[0].content[0].source` must be" in answer["error"]["message"], answer


def test_responses_input_images_become_images(fe, spec):
    content = [{"type": "input_text", "text": "what is"}, {"type": "input_image", "image_url": data_url(PNG)}]
    status, _, answer = fe.post("/v1/responses", {"input": [{"role": "user", "content": content}],
                                                  "max_output_tokens": 5, "store": False})
    assert status == 200, answer
    assert [i.data for i in last_add(fe).images] == [PNG]
    content = [{"type": "input_image", "file_id": "file-1"}]
    status, _, answer = fe.post("/v1/responses", {"input": [{"role": "user", "content": content}],
                                                  "max_output_tokens": 5})
    assert status == 400 and "input_image parts by `file_id` are not supported" in answer["error"]["message"]


def test_token_id_prompts_may_not_hold_image_tokens(fe, spec):
    status, _, body = fe.post("/v1/completions", {"prompt": [0, 5, spec.image_token_id, 6], "max_tokens": 5})
    assert status == 422 and "the prompt holds 1 image tokens" in body["error"]["message"], body


def test_a_text_model_reads_references_as_text(make_frontend):
    fe = make_frontend()
    inputs = f"hello {md('data:image/png;base64,AAAA')}"  # not even an image
    status, _, body = fe.post("/generate", {"inputs": inputs, "parameters": {"max_new_tokens": 5}})
    assert status == 200, body
    add = last_add(fe)
    assert add.images == [] and add.input_ids == fe.sched.tok.encode(inputs).ids


def test_an_uncountable_vision_model_does_not_start(llava_dir, tmp_path):
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(llava_dir / name, tmp_path)
    with pytest.raises(VisionModelError, match="no preprocessor_config.json"):
        Frontend(tmp_path).close()
