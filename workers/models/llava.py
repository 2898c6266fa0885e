"""LLaVA (``model_type`` llava: llava-1.5 and the checkpoints shaped like it): a vision tower and a
projector in front of one of the native decoders.

The decoder is the text config's own family (``llama.py`` for llava-1.5's Llama, or Mistral, Qwen2, ...) over
the checkpoint's ``language_model.*`` weights, tensor-parallel as ever. The vision side is small beside it
(llava-1.5's CLIP ViT-L/336 is 0.3 B parameters against the decoder's 7 B) and runs once per image, so every
rank holds all of it and computes the same rows, which the decoder then reads in place of the image's
placeholder embeddings; no collective is added. It is transformers' own modules (``AutoModel`` over the
vision config, ``LlavaMultiModalProjector``) with the checkpoint's weights, so it computes what
``LlavaForConditionalGeneration.get_image_features`` does, for any tower transformers knows; the image
processor is the checkpoint's (``preprocessor_config.json``), as TGI's shards and vLLM run it.
"""

from __future__ import annotations

import io

import torch

from llmbus.bus.messages import ImageInput
from llmbus.workers.models.gemma3 import PrefixedReader

# Where a checkpoint keeps the text model: the hub's layout (transformers 4's save_pretrained, and 5's) and
# transformers 5's in-memory one, in case a checkpoint was written from its state dict.
HUB_TEXT_PREFIX = "language_model."
HUB_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.")
FLAT_TEXT_PREFIX = "model.language_model."
FLAT_VISION_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.")


class FlatLayoutReader(PrefixedReader):
    """A checkpoint reader of the text model in transformers 5's layout: ``model.X`` is
    ``model.language_model.X``; ``lm_head.weight`` keeps its name."""

    def __init__(self, reader):
        super().__init__(reader, FLAT_TEXT_PREFIX)

    def stored(self, name: str) -> str:
        return FLAT_TEXT_PREFIX + name.removeprefix("model.") if name.startswith("model.") else name

    def shown(self, stored: str) -> str | None:
        if stored.startswith(FLAT_TEXT_PREFIX):
            return "model." + stored.removeprefix(FLAT_TEXT_PREFIX)
        return stored if stored.startswith("lm_head.") else None


class LlavaVision:
    """The image side of a LLaVA checkpoint: ``encode`` turns an image into its placeholders' embeddings."""

    def __init__(self, hf_config: dict, model_dir: str, reader, *, dtype: torch.dtype, device: torch.device):
        import transformers
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

        config = transformers.LlavaConfig(**hf_config)
        self.feature_layer = config.vision_feature_layer
        self.strategy = config.vision_feature_select_strategy
        if self.strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy {self.strategy!r}: LLaVA knows 'default' and 'full'")
        self.tower = transformers.AutoModel.from_config(config.vision_config)
        self.projector = LlavaMultiModalProjector(config)
        flat = reader.has(FLAT_VISION_PREFIXES[0] + next(iter(self.tower.state_dict())))
        for module, prefix in zip((self.tower, self.projector), FLAT_VISION_PREFIXES if flat else HUB_VISION_PREFIXES):
            state = {name: reader.read(prefix + name) for name in module.state_dict()}
            module.load_state_dict(state, strict=True)
            module.to(device=device, dtype=dtype).eval()
        self.processor = transformers.AutoImageProcessor.from_pretrained(model_dir)
        self.device, self.dtype = device, dtype

    def encode(self, image: ImageInput) -> torch.Tensor:
        """``[image.num_tokens, text hidden]``: the embeddings of the image's placeholders."""
        from PIL import Image

        with Image.open(io.BytesIO(image.data)) as picture:
            features = self._features(picture)
        if features.shape[0] != image.num_tokens:
            raise ValueError(f"an image gave {features.shape[0]} embeddings for its {image.num_tokens} placeholders")
        return features

    def warm(self) -> None:
        """Encode a blank image: the vision side's first run (and, on CUDA, its memory peak) happen at warmup,
        not in the first request's step."""
        from PIL import Image

        self._features(Image.new("RGB", (64, 64), (127, 127, 127)))

    @torch.inference_mode()
    def _features(self, picture) -> torch.Tensor:
        pixels = self.processor(images=[picture], return_tensors="pt")["pixel_values"]
        hidden = self.tower(pixels.to(self.device, self.dtype), output_hidden_states=True).hidden_states
        layers = [self.feature_layer] if isinstance(self.feature_layer, int) else list(self.feature_layer)
        selected = [hidden[i][:, 1:] if self.strategy == "default" else hidden[i] for i in layers]
        return self.projector(torch.cat(selected, dim=-1))[0]


class LlavaForConditionalGeneration:
    """Builds a LLaVA checkpoint's model: its text family's decoder, with a ``vision`` (``LlavaVision``)."""

    @classmethod
    def from_checkpoint(cls, hf_config: dict, reader, *, dtype: torch.dtype, device: torch.device, **kwargs):
        from llmbus.workers.loader import native_builders

        text_config = dict(hf_config["text_config"])
        text_type = text_config.get("model_type", "llama")
        builder = native_builders().get(text_type)
        if builder is None or builder is cls:
            raise ValueError(f"a LLaVA checkpoint whose text model is {text_type!r}: llmbus runs LLaVA on its native "
                             f"decoders only")
        flat = reader.has(FLAT_TEXT_PREFIX + "embed_tokens.weight")
        text_reader = FlatLayoutReader(reader) if flat else PrefixedReader(reader, HUB_TEXT_PREFIX)
        if not text_reader.has("model.embed_tokens.weight"):
            raise ValueError("a LLaVA checkpoint without its text model's weights (language_model.model.*)")
        model = builder.from_checkpoint(text_config, text_reader, dtype=dtype, device=device, **kwargs)
        # the vision side computes in the decoder's dtype (bfloat16 weights are computed in float32 on CPU)
        model.vision = LlavaVision(hf_config, reader.model_dir, reader, dtype=model.dtype, device=device)
        return model
