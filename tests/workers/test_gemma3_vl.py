"""Gemma 3's images through ModelRunner: transformers' greedy tokens and logprobs in float32 for prompts with
images, whose placeholders attend each other both ways (the backends' key limits, ``vision.image_key_limits``)
while the local layers' window (shorter than an image here) still starts at each token; in a continuous batch
whose prompt chunks stop before an image or take its rest whole (as the scheduler cuts them), with a
preemption and prefix-cache hits that end inside an image and after it, on the CPU's backends and over two
tensor-parallel ranks."""

import pytest
import torch

from llmbus.testing import gemma3_vl, llava
from llmbus.testing.llava import encoded_image
from llmbus.testing.runner_driver import BLOCK_SIZE, MAX_NEW_TOKENS, MIN_MARGIN, NUM_BLOCKS, Request, drive

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def tiny_gemma3(tiny_gemma3_vl_dir):
    """(model folder, prompts, transformers' (tokens, logprobs) of each)."""
    from tokenizers import Tokenizer

    path = tiny_gemma3_vl_dir
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    words = [tok.encode(text).ids for text in ("look at this", " and tell me what it shows", "Two pictures:",
                                                " then", " which one is brighter?", "A question about the weather")]
    prompts = [gemma3_vl.image_prompt(path, [words[0], words[1]], [encoded_image(1, (64, 48))]),
               gemma3_vl.image_prompt(path, [words[2], words[3], words[4]],
                                      [encoded_image(2, (30, 90)), encoded_image(3, (200, 40), "JPEG")]),
               gemma3_vl.image_prompt(path, [words[5]], []),
               gemma3_vl.image_prompt(path, [[], words[1]], [encoded_image(4, (100, 100), "WEBP")])]
    return path, prompts, llava.generate_reference(path, prompts, MAX_NEW_TOKENS, MIN_MARGIN)


def image_requests(prompts) -> list[Request]:
    """The prompts in a continuous batch of small chunks, r1 preempted once it has 5 tokens (it resumes from its
    first block), and two prefix-cache hits on r1's prompt: "inside" starts inside its first image, "after"
    past it (its first image comes as a stub)."""
    requests = [Request(rid=f"r{i}", prompt=p.ids, images=llava.bus_images(p), arrival_step=step, prefill_chunk=chunk,
                        whole_images=True)
                for i, (p, step, chunk) in enumerate(zip(prompts, (0, 1, 0, 2), (7, None, 5, 3)))]
    requests[1].preempt_after, requests[1].resume_cached_blocks = 5, 1
    lender, first = requests[1], prompts[1].image_offsets[0]
    inside, after = -(-first // BLOCK_SIZE) + 1, -(-(first + prompts[1].image_tokens[0]) // BLOCK_SIZE)
    assert first < inside * BLOCK_SIZE < first + prompts[1].image_tokens[0] <= after * BLOCK_SIZE
    assert after * BLOCK_SIZE < prompts[1].image_offsets[1]
    lender.blocks = [NUM_BLOCKS - 1 - i for i in range(after)]
    for rid, blocks, step in (("inside", inside, 9), ("after", after, 10)):
        requests.append(Request(rid=rid, prompt=prompts[1].ids,
                                images=llava.bus_images(prompts[1], blocks * BLOCK_SIZE), arrival_step=step,
                                computed=blocks * BLOCK_SIZE, blocks=lender.blocks[:blocks], prefill_chunk=6,
                                whole_images=True))
    assert not requests[-1].images[0].data, "the hit past the first image holds it as a stub"
    return requests


def assert_transformers_results(expected, results, atol=1e-4) -> None:
    llava.assert_reference_results(expected, results, {"r0": 0, "r1": 1, "r2": 2, "r3": 3, "inside": 1, "after": 1},
                                   atol)


@pytest.mark.parametrize("backend", ["auto", "torch_sdpa"])
def test_images_in_a_continuous_batch_give_transformers_tokens(tiny_gemma3, backend):
    from llmbus.workers.model_runner import ModelRunner

    path, prompts, expected = tiny_gemma3
    runner = ModelRunner(str(path), block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_batch_prefill_tokens=256,
                         attention_backend=backend)
    runner.warmup()
    assert runner.images is not None and runner.image_layout == "whole"
    results = drive(runner, image_requests(prompts))
    assert results["r1"].preemptions == 1
    assert_transformers_results(expected, {rid: (r.tokens, r.logprobs) for rid, r in results.items()})
    assert len(runner.images) == 0, "a finished request left its encoded images behind"


def test_the_images_both_ways_attention_is_what_the_reference_shows(tiny_gemma3):
    """The reference itself depends on the image tokens' both-ways attention (else this file would not test it):
    attending causally, transformers gives logprobs further from these than the comparisons' tolerance (1e-4) for
    every prompt with an image."""
    path, prompts, expected = tiny_gemma3
    causal = llava.generate_reference(path, prompts, 2, 0.0, both_ways=False)
    for i, prompt in enumerate(prompts):
        differs = max(abs(a - b) for a, b in zip(causal[i][1], expected[i][1][:2])) > 2e-4
        assert differs == bool(prompt.images), i


def test_a_step_that_would_cut_an_image_is_refused(tiny_gemma3):
    """A step that ends inside an image would leave its later placeholders out of the earlier ones' keys: the
    rank refuses it rather than compute it wrongly (the scheduler never sends one)."""
    from llmbus.workers.model_runner import ModelRunner

    path, prompts, _ = tiny_gemma3
    runner = ModelRunner(str(path), block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    cut = prompts[0].image_offsets[0] + 3
    with pytest.raises(ValueError, match="a step ends inside an image"):
        drive(runner, [Request(rid="cut", prompt=prompts[0].ids, images=llava.bus_images(prompts[0]),
                               prefill_chunk=cut)])


def test_two_tensor_parallel_ranks_read_the_same_images(tiny_gemma3, tmp_path):
    from llmbus.testing.runner_driver import drive_tensor_parallel

    path, prompts, expected = tiny_gemma3
    results = drive_tensor_parallel(str(path), {"gemma3": image_requests(prompts)}, str(tmp_path))["gemma3"]
    # two ranks sum the row-parallel products in another order: float32 rounding grows over the steps
    assert_transformers_results(expected, results, atol=3e-4)


def test_the_published_layout_reads_the_same_model(tiny_gemma3, tmp_path):
    """The published checkpoints keep the SigLIP tower under ``vision_tower.vision_model.*`` (transformers 5
    saves it without that level): the same weights so named give the same tokens."""
    import shutil

    from safetensors.torch import load_file, save_file

    from llmbus.workers.model_runner import ModelRunner

    path, prompts, expected = tiny_gemma3
    hub = tmp_path / "hub"
    shutil.copytree(path, hub)
    state = load_file(str(hub / "model.safetensors"))
    renamed = {("vision_tower.vision_model." + name.removeprefix("vision_tower.") if name.startswith("vision_tower.")
                else name): tensor for name, tensor in state.items()}
    assert any(name.startswith("vision_tower.vision_model.encoder.") for name in renamed)
    save_file(renamed, str(hub / "model.safetensors"), metadata={"format": "pt"})
    runner = ModelRunner(str(hub), block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_batch_prefill_tokens=256)
    results = drive(runner, [Request(rid="hub", prompt=prompts[1].ids, images=llava.bus_images(prompts[1]),
                                     whole_images=True)])
    assert results["hub"].tokens == expected[1][0]
    torch.testing.assert_close(torch.tensor(results["hub"].logprobs), torch.tensor(expected[1][1]), rtol=0,
                               atol=1e-4)


def test_the_warmup_step_of_an_image_runs_the_key_limits(tiny_gemma3):
    """On a GPU the warmup runs one step of a blank image (``_compile_image_rows``), so the Triton kernel's
    key-limits variant compiles at start: here on the CPU, that step's rows reach the backend with their image's
    limits, and it leaves no image behind."""
    from llmbus.workers.model_runner import ModelRunner

    path, _, _ = tiny_gemma3
    runner = ModelRunner(str(path), block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    backend, seen = runner.model.attention_backend, []
    build = backend.build_metadata

    def spy(**kwargs):
        seen.append(kwargs.get("key_limits"))
        return build(**kwargs)

    backend.build_metadata = spy
    assert runner._compile_image_rows(runner.kv_cache)
    tokens = gemma3_vl.IMAGE_TOKENS
    assert seen == [[0] + [tokens] * tokens + [tokens + 1]]
    assert len(runner.images) == 0
