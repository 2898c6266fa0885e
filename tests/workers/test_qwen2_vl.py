"""Qwen2-VL and Qwen2.5-VL through ModelRunner: transformers' greedy tokens and logprobs in float32 for
prompts with images, whose rows after an image are rotated by M-RoPE's positions (mrope.py): in a continuous
batch whose prompt chunks cut images, with a preemption, a prefix-cache hit that ends inside an image and
one that ends after it (the rank then holds that image as a stub without its file: only its place and grid),
and over two tensor-parallel ranks."""


import numpy as np
import pytest
import torch

from llmbus.testing import llava, qwen2_vl
from llmbus.testing.llava import encoded_image
from llmbus.testing.runner_driver import BLOCK_SIZE, MAX_NEW_TOKENS, MIN_MARGIN, NUM_BLOCKS, Request, drive

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def tiny_qwen(request):
    """(model folder, prompts, transformers' (tokens, logprobs) of each), for each family."""
    from tokenizers import Tokenizer

    path = request.getfixturevalue(f"tiny_{request.param}_dir")
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    words = [tok.encode(text).ids for text in ("USER: look at this", " and tell me what it shows",
                                                "Two pictures:", " then", " which one is brighter?",
                                                "A question without a picture, about the weather")]
    prompts = [qwen2_vl.image_prompt(path, [words[0], words[1]], [encoded_image(1, (64, 48))]),
               qwen2_vl.image_prompt(path, [words[2], words[3], words[4]],
                                     [encoded_image(2, (30, 90)), encoded_image(3, (200, 40), "JPEG")]),
               qwen2_vl.image_prompt(path, [words[5]], []),
               qwen2_vl.image_prompt(path, [[], words[1]], [encoded_image(4, (100, 100), "WEBP")])]
    assert [p.grids for p in prompts] == [[(2, 2)], [(4, 2), (1, 7)], [], [(4, 4)]]
    return path, prompts, llava.generate_reference(path, prompts, MAX_NEW_TOKENS, MIN_MARGIN)


def image_requests(prompts) -> list[Request]:
    """The prompts in a continuous batch whose chunks cut images, r1 preempted once it has 5 tokens (it
    resumes from its first block), and two prefix-cache hits on r1's prompt: "inside" starts with 8 tokens
    computed, inside its first image, "after" with 16, past it (its first image comes as a stub)."""
    requests = [Request(rid=f"r{i}", prompt=p.ids, images=llava.bus_images(p), arrival_step=step, prefill_chunk=chunk)
                for i, (p, step, chunk) in enumerate(zip(prompts, (0, 1, 0, 2), (7, None, 5, 3)))]
    requests[1].preempt_after, requests[1].resume_cached_blocks = 5, 1
    lender, first = requests[1], prompts[1].image_offsets[0]
    assert first < 2 * BLOCK_SIZE < first + prompts[1].image_tokens[0] <= 4 * BLOCK_SIZE < prompts[1].image_offsets[1]
    lender.blocks = [NUM_BLOCKS - 1 - i for i in range(4)]
    for rid, blocks, step in (("inside", 2, 9), ("after", 4, 10)):
        requests.append(Request(rid=rid, prompt=prompts[1].ids,
                                images=llava.bus_images(prompts[1], blocks * BLOCK_SIZE), arrival_step=step,
                                computed=blocks * BLOCK_SIZE, blocks=lender.blocks[:blocks], prefill_chunk=6))
    assert not requests[-1].images[0].data, "the hit past the first image holds it as a stub"
    return requests


def assert_transformers_results(expected, results, atol=1e-4) -> None:
    llava.assert_reference_results(expected, results, {"r0": 0, "r1": 1, "r2": 2, "r3": 3, "inside": 1, "after": 1},
                                   atol)


def test_images_in_a_continuous_batch_give_transformers_tokens(tiny_qwen):
    from llmbus.workers.model_runner import ModelRunner

    path, prompts, expected = tiny_qwen
    runner = ModelRunner(str(path), block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_batch_prefill_tokens=256)
    runner.warmup()
    assert runner.images is not None and runner.image_layout == "grid"
    results = drive(runner, image_requests(prompts))
    assert results["r1"].preemptions == 1
    assert_transformers_results(expected, {rid: (r.tokens, r.logprobs) for rid, r in results.items()})
    assert len(runner.images) == 0, "a finished request left its encoded images behind"


def test_two_tensor_parallel_ranks_rotate_alike(tiny_qwen, tmp_path):
    from llmbus.testing.runner_driver import drive_tensor_parallel

    path, prompts, expected = tiny_qwen
    results = drive_tensor_parallel(str(path), {"qwen": image_requests(prompts)}, str(tmp_path))["qwen"]
    # two ranks sum the row-parallel products in another order: float32 rounding grows over the steps
    assert_transformers_results(expected, results, atol=3e-4)


def test_positions_are_transformers_rope_index(tiny_qwen):
    """A prompt's [3] positions, computed chunk by chunk and on into generated tokens, are transformers'
    get_rope_index's, and its generated tokens continue from its rope delta."""
    from llmbus.workers.mrope import sequence_positions

    path, prompts, _ = tiny_qwen
    model = llava._model(path)
    prompt = prompts[1]
    ids = torch.tensor([prompt.ids])
    grid_thw = llava.image_inputs(path, prompt.images)["image_grid_thw"]
    positions, delta = model.model.get_rope_index(ids, mm_token_type_ids=(ids == model.config.image_token_id).int(),
                                                  image_grid_thw=grid_thw)
    images = llava.bus_images(prompt)
    ours = np.concatenate([sequence_positions(images, start, n) for start, n in ((0, 5), (5, 13), (18, 100))], 1)
    assert (ours[:, :len(prompt.ids)] == positions[:, 0].numpy()).all()
    generated = np.arange(len(prompt.ids), 118) + int(delta)
    assert (ours[:, len(prompt.ids):] == generated).all()


def test_transformers_5s_flat_layout_reads_the_same_model(tiny_qwen, tmp_path):
    """The same weights named as transformers 5 keeps them in memory (model.language_model.*, model.visual.*,
    lm_head.weight) give the same tokens."""
    import shutil

    from safetensors.torch import load_file, save_file

    from llmbus.workers.model_runner import ModelRunner

    path, prompts, expected = tiny_qwen
    flat = tmp_path / "flat"
    shutil.copytree(path, flat)
    state = load_file(str(flat / "model.safetensors"))
    renamed = {("model.language_model." + name.removeprefix("model.") if name.startswith("model.")
                else "model." + name if name.startswith("visual.") else name): tensor for name, tensor in state.items()}
    assert "lm_head.weight" in renamed and any(name.startswith("model.visual.") for name in renamed)
    save_file(renamed, str(flat / "model.safetensors"), metadata={"format": "pt"})
    runner = ModelRunner(str(flat), block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_batch_prefill_tokens=256)
    results = drive(runner, [Request(rid="flat", prompt=prompts[0].ids, images=llava.bus_images(prompts[0]))])
    assert results["flat"].tokens == expected[0][0]


def test_the_hubs_flat_config_reads_the_same_model(tiny_qwen, tmp_path):
    """Qwen2-VL's and Qwen2.5-VL's published config.json keep the text model's fields at the top level, with
    M-RoPE as ``rope_scaling: {"type": "mrope", ...}`` and the vision config in the names of the time
    (``in_chans``): the same weights so configured give the same tokens, and the frontend the same count."""
    import json
    import shutil

    from tokenizers import Tokenizer

    from llmbus.frontend.vision_models import vision_spec
    from llmbus.workers.model_runner import ModelRunner

    path, prompts, expected = tiny_qwen
    hub = tmp_path / "hub"
    shutil.copytree(path, hub)
    config = json.loads((hub / "config.json").read_text())
    text = config.pop("text_config")
    rope = text.pop("rope_parameters")
    for key in ("model_type", "layer_types", "dtype"):
        text.pop(key, None)
    vision = config["vision_config"]
    vision["in_chans"] = vision.pop("in_channels")
    vision.pop("model_type")
    config |= text | {"rope_theta": rope["rope_theta"],
                      "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]}}
    (hub / "config.json").write_text(json.dumps(config))
    runner = ModelRunner(str(hub), block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_batch_prefill_tokens=256)
    results = drive(runner, [Request(rid="hub", prompt=prompts[1].ids, images=llava.bus_images(prompts[1]))])
    assert results["hub"].tokens == expected[1][0]
    tok = Tokenizer.from_file(str(hub / "tokenizer.json"))
    assert vision_spec(hub, tok) == vision_spec(path, tok)


def test_an_image_laid_out_otherwise_than_the_frontend_said_is_refused(tiny_qwen):
    """The vision side checks the placeholders' count and grid it computes against the ones the frontend sent:
    a grid of the same count but another shape would rotate the text after it wrongly, so it fails the image."""
    import dataclasses

    from llmbus.workers.model_runner import ModelRunner

    path, prompts, _ = tiny_qwen
    vision = ModelRunner(str(path), block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS).model.vision
    image = llava.bus_images(prompts[0])[0]
    assert image.grid == [2, 2] and vision.encode(image).shape[0] == 4
    with pytest.raises(ValueError, match="lie in a 2x2 grid, not in"):
        vision.encode(dataclasses.replace(image, grid=[1, 4]))
    with pytest.raises(ValueError, match="gave 4 embeddings for its 5 placeholders"):
        vision.encode(dataclasses.replace(image, num_tokens=5, grid=[]))
