"""A vision-language model through the whole stack: `llmbus up` on the tiny LLaVA, LLaVA-NeXT, Qwen2-VL and Gemma 3
checkpoints, images sent as TGI's users send them (markdown in `/generate`'s inputs) and as OpenAI's SDK sends
them (`image_url` parts of a chat message), real processes, sockets and HTTP.

Each answer's greedy tokens equal transformers' as its users run the model (its processor, then the model's
``generate`` in float32). The prefix cache serves a prompt holding an
image to the same image only: asked again with the same image the answer is the same and its prompt comes
from the cache; asked with another image in the same place, the answer is that image's."""

from __future__ import annotations

import base64
import io

import pytest

from llmbus.testing import Server
from llmbus.testing import gemma3_vl, llava, qwen2_vl
from llmbus.testing.http import post
from llmbus.testing.runner_driver import MIN_MARGIN

MAX_NEW = 12
CAT, DOG = llava.encoded_image(11), llava.encoded_image(12, (80, 40), "JPEG")


# the family's placeholder token, which the prefix cache keys by its image
PLACEHOLDERS = {"llava": llava.IMAGE_TOKEN, "llava_next": llava.IMAGE_TOKEN, "qwen2_vl": qwen2_vl.IMAGE_TOKEN,
                "gemma3": gemma3_vl.IMAGE_TOKEN}


def data_url(image: bytes) -> str:
    kind = "jpeg" if image[:2] == b"\xff\xd8" else "png"
    return f"data:image/{kind};base64,{base64.b64encode(image).decode()}"


# the family's image in a prompt as transformers' processor reads it
FAMILIES = {"llava": llava.IMAGE_TOKEN, "llava_next": llava.IMAGE_TOKEN,
            "qwen2_vl": qwen2_vl.VISION_START + qwen2_vl.IMAGE_TOKEN + qwen2_vl.VISION_END, "gemma3": gemma3_vl.BOI}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    return request.param


@pytest.fixture(scope="module")
def model_dir(request, family):
    """The tiny LLaVA; the tiny LLaVA-NeXT, whose images take as many placeholders as their size gives; the
    tiny Qwen2-VL, whose text after an image is rotated by M-RoPE's positions; the tiny Gemma 3, whose image
    placeholders attend each other both ways (its server's small prefill budget cuts prompts into chunks that
    must stop before an image or take its rest whole)."""
    return request.getfixturevalue("tiny_gemma3_vl_dir" if family == "gemma3" else f"tiny_{family}_dir")


@pytest.fixture(scope="module")
def server(model_dir, family):
    chunks = ["--max-batch-prefill-tokens", "12"] if family == "gemma3" else []
    srv = Server(["--model-id", str(model_dir), "--dtype", "float32", "--max-total-tokens", "256",
                  "--num-blocks", "128", "--block-size", "8", *chunks])
    yield srv
    assert srv.stop() == 0, srv.stderr.text[-3000:]


@pytest.fixture(scope="module")
def expected(model_dir, family):
    """transformers' tokens per asked (text, images): a /generate prompt (the tokenizer adds BOS), and a user
    message of an image part and a text part through the chat template as transformers renders it (content
    parts, the image as {"type": "image"}), which the chat route tokenizes as it is (the template writes any
    special tokens; this one writes none)."""
    from PIL import Image
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    image_text = FAMILIES[family]
    generate_text = f"USER: look at this{image_text} and tell me what it shows"
    chat_text = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in the picture?"}]}],
        tokenize=False, add_generation_prompt=True)
    assert chat_text.count(image_text) == 1
    asked = [(generate_text, [CAT], True), (generate_text, [DOG], True), (chat_text, [CAT], False),
             (chat_text, [DOG], False)]
    tokens = llava.processor_reference(model_dir, asked, MAX_NEW, MIN_MARGIN)
    chat_ids = list(llava.processor(model_dir)(text=chat_text, images=[Image.open(io.BytesIO(CAT))],
                                               add_special_tokens=False)["input_ids"][0])
    image_at = chat_ids.index(tokenizer.convert_tokens_to_ids(PLACEHOLDERS[family]))
    return {"generate": {CAT: tokens[0], DOG: tokens[1]}, "chat": {CAT: tokens[2], DOG: tokens[3]},
            "tokenizer": tokenizer, "chat_image_at": image_at}


def generated_ids(server, image: bytes) -> tuple[list[int], dict]:
    status, _, body = post(f"{server.url}/generate", {
        "inputs": f"USER: look at this![]({data_url(image)}) and tell me what it shows",
        "parameters": {"max_new_tokens": MAX_NEW, "details": True, "ignore_eos_token": True}})
    assert status == 200, body
    return [t["id"] for t in body["details"]["tokens"]], body


def test_generate_reads_markdown_images_as_transformers_does(server, expected):
    for image in (CAT, DOG):
        ids, body = generated_ids(server, image)
        assert ids == expected["generate"][image]
        assert body["details"]["prefill"] == [] and body["details"]["generated_tokens"] == MAX_NEW
    assert expected["generate"][CAT] != expected["generate"][DOG], "the image must change the answer"


def test_openai_chat_image_parts_and_the_prefix_cache(server, expected):
    """The OpenAI SDK's image_url parts; the same image again comes from the prefix cache with the same
    answer, another image in its place is read afresh."""
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="-")
    tokenizer = expected["tokenizer"]

    def ask(image: bytes):
        return client.chat.completions.create(
            model="tgi", max_tokens=MAX_NEW, temperature=0, extra_body={"ignore_eos": True},
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}},
                                                   {"type": "text", "text": "What is in the picture?"}]}])

    first, again, other = ask(CAT), ask(CAT), ask(DOG)
    for answer, image in ((first, CAT), (again, CAT), (other, DOG)):
        assert answer.choices[0].message.content == tokenizer.decode(expected["chat"][image],
                                                                     skip_special_tokens=True)
    prompt_tokens = first.usage.prompt_tokens
    assert prompt_tokens > llava.IMAGE_TOKENS
    # the cache holds the whole prompt's full blocks of 8 tokens, the image among them, for the same image;
    # for another one only the blocks before it
    assert again.usage.prompt_tokens_details.cached_tokens == (prompt_tokens - 1) // 8 * 8
    assert other.usage.prompt_tokens_details.cached_tokens == expected["chat_image_at"] // 8 * 8
