"""LLaVA and LLaVA-NeXT through ModelRunner: transformers' LlavaForConditionalGeneration's and
LlavaNextForConditionalGeneration's greedy tokens and logprobs in float32, for prompts with images in a
continuous batch whose prompt chunks cut an image, a preemption, and a prefix-cache hit that ends inside an
image. LLaVA-NeXT's images take as many placeholders as their size gives (the prompts' images are of five
sizes and aspect ratios, so each grid resolution and both ways of cutting the padding back are met)."""


import pytest

from llmbus.bus.messages import ImageInput
from llmbus.testing import llava
from llmbus.testing.runner_driver import BLOCK_SIZE, MAX_NEW_TOKENS, MIN_MARGIN, NUM_BLOCKS, Request, drive

pytestmark = pytest.mark.timeout(300)


def family_prompts(path) -> list[llava.ImagePrompt]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    image_id = tok.token_to_id(llava.IMAGE_TOKEN)
    words = [tok.encode(text).ids for text in ("USER: look at this", " and tell me what it shows",
                                                "Two pictures:", " then", " which one is brighter?",
                                                "A question without a picture, about the weather")]
    texts_and_images = [([words[0], words[1]], [llava.encoded_image(1)]),
                        ([words[2], words[3], words[4]], [llava.encoded_image(2, (30, 90)),
                                                          llava.encoded_image(3, (200, 40), "JPEG")]),
                        ([words[5]], []),
                        ([[], words[1]], [llava.encoded_image(4, (100, 100), "WEBP")])]
    return [llava.image_prompt(texts, images, image_id, llava.image_token_counts(path, images))
            for texts, images in texts_and_images]


@pytest.fixture(scope="module", params=["llava", "llava_next"])
def tiny_llava(request):
    """(model folder, prompts, transformers' (tokens, logprobs) of each), for each family."""
    path = request.getfixturevalue(f"tiny_{request.param}_dir")
    prompts = family_prompts(path)
    return path, prompts, llava.generate_reference(path, prompts, MAX_NEW_TOKENS, MIN_MARGIN)


def image_requests(prompts: list[llava.ImagePrompt]) -> list[Request]:
    """The prompts in a continuous batch whose chunks cut images, with r1 preempted once it has 5 tokens
    (resuming from its first block: its images are encoded again) and "hit", which starts from r0's first 3
    blocks (12 tokens) computed: r0's image starts at token 4, so the cached prefix ends inside it and only its
    last placeholders are computed."""
    requests = [Request(rid=f"r{i}", prompt=p.ids, images=llava.bus_images(p), arrival_step=step, prefill_chunk=chunk)
                for i, (p, step, chunk) in enumerate(zip(prompts, (0, 1, 0, 2), (7, None, 5, 3)))]
    requests[1].preempt_after, requests[1].resume_cached_blocks = 5, 1
    lender = requests[0]
    assert prompts[0].image_offsets[0] < 3 * BLOCK_SIZE < prompts[0].image_offsets[0] + prompts[0].image_tokens[0]
    lender.blocks = [NUM_BLOCKS - 1, NUM_BLOCKS - 2, NUM_BLOCKS - 3]
    requests.append(Request(rid="hit", prompt=prompts[0].ids, images=llava.bus_images(prompts[0]), arrival_step=9,
                            computed=3 * BLOCK_SIZE, blocks=list(lender.blocks), prefill_chunk=6))
    return requests


def assert_transformers_results(expected, results, atol=1e-4) -> None:
    llava.assert_reference_results(expected, results, {"r0": 0, "r1": 1, "r2": 2, "r3": 3, "hit": 0}, atol)


def test_images_in_a_continuous_batch_give_transformers_tokens(tiny_llava):
    from llmbus.workers.model_runner import ModelRunner

    path, prompts, expected = tiny_llava
    runner = ModelRunner(str(path), block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_batch_prefill_tokens=256)
    runner.warmup()
    assert runner.images is not None and runner.image_layout == "sequence"
    results = drive(runner, image_requests(prompts))
    assert results["r1"].preemptions == 1
    assert_transformers_results(expected, {rid: (r.tokens, r.logprobs) for rid, r in results.items()})
    assert len(runner.images) == 0, "a finished request left its encoded images behind"


def test_two_tensor_parallel_ranks_read_the_same_images(tiny_llava, tmp_path):
    """Every rank holds the whole vision side and puts the same rows in: the sharded decoder's result is
    transformers' too."""
    from llmbus.testing.runner_driver import drive_tensor_parallel

    path, prompts, expected = tiny_llava
    results = drive_tensor_parallel(str(path), {"llava": image_requests(prompts)}, str(tmp_path))["llava"]
    # two ranks sum the row-parallel products in another order: float32's rounding differences grow over the
    # steps, to 1.2e-4 by the twelfth of LLaVA-NeXT's longer prompts (the tokens are still transformers')
    assert_transformers_results(expected, results, atol=3e-4)


def test_another_image_in_the_same_place_gives_other_tokens(tiny_llava):
    """The image is read, not its placeholders' embeddings: one more image changes the continuation."""
    from llmbus.workers.model_runner import ModelRunner

    path, prompts, expected = tiny_llava
    runner = ModelRunner(str(path), block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_batch_prefill_tokens=256)
    other = llava.ImagePrompt(ids=prompts[0].ids, images=[llava.encoded_image(99)],
                              image_offsets=prompts[0].image_offsets, image_tokens=prompts[0].image_tokens)
    results = drive(runner, [Request(rid="other", prompt=other.ids, images=llava.bus_images(other))])
    assert results["other"].tokens == llava.generate_reference(path, [other], MAX_NEW_TOKENS, 0.0)[0][0]
    assert results["other"].tokens != expected[0][0]


def test_an_image_the_ranks_cannot_read_fails_its_request_alone(tiny_llava):
    """The image processor refusing an image (here: bytes that are no image at all) fails that request in the
    step's errors; the rank lives on and the request beside it gets its tokens."""
    from llmbus.bus.messages import SamplingParams
    from llmbus.workers.model_runner import ModelRunner, SeqInput

    path, prompts, expected = tiny_llava
    runner = ModelRunner(str(path), block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_batch_prefill_tokens=256)
    broken = [ImageInput(offset=prompts[0].image_offsets[0], num_tokens=prompts[0].image_tokens[0],
                         data=b"not an image", digest=bytes(16))]
    blocks = -(-len(prompts[0].ids) // BLOCK_SIZE)
    seqs = [SeqInput(rid=rid, token_ids=list(prompts[0].ids), num_computed=0, sample=True,
                     block_table=list(range(first, first + blocks)), sampling=SamplingParams(),
                     prompt_len=len(prompts[0].ids), images=images)
            for rid, first, images in (("broken", 0, broken), ("fine", blocks, llava.bus_images(prompts[0])))]
    out = runner.step(seqs)
    assert [(rid, kind) for rid, kind, _ in out.errors] == [("broken", "validation")]
    assert out.errors[0][2].startswith("invalid image content")
    assert out.token_ids[out.rids.index("fine")] == expected[0][0][0]
    runner.drop(["broken", "fine"])
    assert len(runner.images) == 0


def test_transformers_5s_flat_layout_reads_the_same_model(tiny_llava, tmp_path):
    """The same weights named as transformers 5 keeps them in memory (model.language_model.*, lm_head.weight,
    model.vision_tower.*, model.multi_modal_projector.*) give the same tokens."""
    import shutil

    from safetensors.torch import load_file, save_file

    from llmbus.workers.model_runner import ModelRunner

    path, prompts, expected = tiny_llava
    flat = tmp_path / "flat"
    shutil.copytree(path, flat)
    state = load_file(str(flat / "model.safetensors"))
    renamed = {}
    for name, tensor in state.items():
        if name.startswith("language_model.model."):
            name = "model.language_model." + name.removeprefix("language_model.model.")
        elif name.startswith("language_model."):
            name = name.removeprefix("language_model.")
        else:
            name = "model." + name
        renamed[name] = tensor
    assert "lm_head.weight" in renamed and any(name.startswith("model.vision_tower.") for name in renamed)
    save_file(renamed, str(flat / "model.safetensors"), metadata={"format": "pt"})
    runner = ModelRunner(str(flat), block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_batch_prefill_tokens=256)
    results = drive(runner, [Request(rid="flat", prompt=prompts[0].ids, images=llava.bus_images(prompts[0]))])
    assert results["flat"].tokens == expected[0][0]
