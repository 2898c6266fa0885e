"""A tiny Gemma 3 vision-language checkpoint (transformers' ``Gemma3ForConditionalGeneration``, hub layout), its
prompts' layout and its processor: what the tests of Gemma 3's images compare llmbus with, through
``llava.py``'s references (which serve every vision family).

The text model is a seeded, widened Gemma 3 text model (``runner_driver.widen_weights``: decisive greedy margins)
over the demo tokenizer with ``<start_of_image>``, ``<image_soft_token>`` and ``<end_of_image>`` added. Its local
layers' window (``SLIDING_WINDOW``) is shorter than an image, so the both-ways attention of an image's placeholders
meets the window. The vision tower is a seeded random SigLIP in ``PATCH``-pixel patches of ``IMAGE_SIZE``-pixel
images, average-pooled to ``IMAGE_TOKENS`` placeholders: the processor writes each image as
``\\n\\n<start_of_image>``, its placeholders, ``<end_of_image>\\n\\n``.
"""

from __future__ import annotations

import json
from pathlib import Path

IMAGE_TOKEN, BOI, EOI = "<image_soft_token>", "<start_of_image>", "<end_of_image>"
IMAGE_SIZE, PATCH = 32, 4  # 8 x 8 patches ...
IMAGE_TOKENS = 16  # ... pooled 2 x 2 into 4 x 4 placeholders
SLIDING_WINDOW = 8
PROJECTOR_STD = 0.5

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<start_of_turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' or item['type'] == 'image_url' %}<start_of_image>"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def build_tiny_gemma3_vl(path: str | Path, *, seed: int = 0) -> Path:
    """Write the tiny checkpoint, its tokenizer (naming its image tokens as Gemma 3's does), image processor and
    chat template into ``path``."""
    import torch
    import transformers
    from tokenizers import AddedToken, Tokenizer

    from llmbus.supervisor.demo_model import build_demo_model
    from llmbus.testing.runner_driver import widen_weights

    path = Path(path)
    build_demo_model(path, "tiny")
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (BOI, IMAGE_TOKEN, EOI)])
    tok.save(str(path / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in (BOI, IMAGE_TOKEN, EOI)}
    demo = json.loads((path / "config.json").read_text())
    text = dict(vocab_size=len(tok.get_vocab()), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                sliding_window=SLIDING_WINDOW, max_position_embeddings=512,
                layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000.0},
                                 "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}},
                bos_token_id=demo["bos_token_id"], eos_token_id=demo["eos_token_id"],
                pad_token_id=demo["pad_token_id"])
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  image_size=IMAGE_SIZE, patch_size=PATCH)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=IMAGE_TOKENS,
                                       image_token_index=ids[IMAGE_TOKEN], boi_token_index=ids[BOI],
                                       eoi_token_index=ids[EOI])
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    widen_weights(model.model.language_model)
    with torch.no_grad():
        for name, param in model.model.language_model.named_parameters():
            if param.dim() == 1 and "norm" in name:  # norm weights other than zeros (Gemma scales by 1 + w)
                param.uniform_(0.5, 1.5)
        for param in model.model.multi_modal_projector.parameters():
            param.normal_(0.0, PROJECTOR_STD)
        model.lm_head.weight[list(ids.values())] = 0  # placeholders and marks are read, never written
    (path / "model.safetensors").unlink()
    model.save_pretrained(path)
    transformers.Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}).save_pretrained(path)
    tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = CHAT_TEMPLATE
    tokenizer_config["extra_special_tokens"] = {"boi_token": BOI, "image_token": IMAGE_TOKEN, "eoi_token": EOI}
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return path


def image_prompt(model_dir: str | Path, text_ids: list[list[int]], images: list[bytes]):
    """A ``llava.ImagePrompt`` as Gemma 3's processor lays one out: ``text_ids[0]``, then for each image
    ``\\n\\n<start_of_image>``, its ``IMAGE_TOKENS`` placeholders, ``<end_of_image>\\n\\n``, then
    ``text_ids[i + 1]``."""
    from tokenizers import Tokenizer

    from llmbus.testing import llava

    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    boi, pad, eoi = (tok.token_to_id(t) for t in (BOI, IMAGE_TOKEN, EOI))
    newlines = tok.encode("\n\n", add_special_tokens=False).ids
    texts = [list(text_ids[0]) + (newlines + [boi] if images else [])]
    texts += [[eoi] + newlines + list(after) + (newlines + [boi] if i + 1 < len(images) else [])
              for i, after in enumerate(text_ids[1:])]
    return llava.image_prompt(texts, images, pad, [IMAGE_TOKENS] * len(images))


def processor(model_dir: str | Path):
    """transformers' ``Gemma3Processor`` over ``model_dir``'s image processor and tokenizer, as its users build it."""
    import transformers

    return transformers.Gemma3Processor(image_processor=transformers.AutoImageProcessor.from_pretrained(model_dir),
                                        tokenizer=transformers.AutoTokenizer.from_pretrained(model_dir),
                                        image_seq_length=IMAGE_TOKENS, chat_template=CHAT_TEMPLATE)
