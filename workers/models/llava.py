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


import torch

from llmbus.workers.models.gemma3 import PrefixedReader
from llmbus.workers.vision import VisionEncoder

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


def load_tower_and_projector(reader, tower, projector, *, dtype: torch.dtype, device: torch.device) -> bool:
    """The checkpoint's weights into ``tower`` and ``projector`` (transformers modules), moved to ``device`` and
    ``dtype``; returns whether the checkpoint has transformers 5's flat layout (``model.vision_tower.*``). A CLIP or
    SigLIP tower's weights may sit under ``vision_model.`` (the published checkpoints, transformers 4's modules) or
    not (transformers 5's, which dropped that level)."""
    first = next(iter(tower.state_dict()))
    for flat, (tower_prefix, projector_prefix) in ((False, HUB_VISION_PREFIXES), (True, FLAT_VISION_PREFIXES)):
        for infix in ("", "vision_model."):
            if reader.has(tower_prefix + infix + first):
                break
        else:
            continue
        for module, prefix in ((tower, tower_prefix + infix), (projector, projector_prefix)):
            module.load_state_dict({name: reader.read(prefix + name) for name in module.state_dict()}, strict=True)
            module.to(device=device, dtype=dtype).eval()
        return flat
    raise ValueError(f"a vision-language checkpoint without its vision tower's weights ({HUB_VISION_PREFIXES[0]}*)")


class LlavaVision(VisionEncoder):
    """The image side of a LLaVA checkpoint: ``encode`` turns an image into its placeholders' embeddings."""

    def __init__(self, hf_config: dict, model_dir: str, reader, *, dtype: torch.dtype, device: torch.device):
        import transformers

        config = self._config(hf_config)
        self._read_options(config)
        self.tower = transformers.AutoModel.from_config(config.vision_config)
        self.projector = self._projector(config)
        self.flat = load_tower_and_projector(reader, self.tower, self.projector, dtype=dtype, device=device)
        self.processor = transformers.AutoImageProcessor.from_pretrained(model_dir)
        self.device, self.dtype = device, dtype

    def _read_options(self, config) -> None:
        self.feature_layer = config.vision_feature_layer
        self.strategy = config.vision_feature_select_strategy
        if self.strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy {self.strategy!r}: LLaVA knows 'default' and 'full'")

    @staticmethod
    def _config(hf_config: dict):
        import transformers

        return transformers.LlavaConfig(**hf_config)

    @staticmethod
    def _projector(config):
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

        return LlavaMultiModalProjector(config)

    @torch.inference_mode()
    def _features(self, picture) -> tuple[torch.Tensor, None]:
        return self._project(self.processor(images=[picture], return_tensors="pt")["pixel_values"])[0], None

    def _project(self, pixels: torch.Tensor) -> torch.Tensor:
        """``[tiles, rows, text hidden]``: the projected features of ``[tiles, 3, H, W]`` pixels."""
        hidden = self.tower(pixels.to(self.device, self.dtype), output_hidden_states=True).hidden_states
        layers = [self.feature_layer] if isinstance(self.feature_layer, int) else list(self.feature_layer)
        selected = [hidden[i][:, 1:] if self.strategy == "default" else hidden[i] for i in layers]
        return self.projector(torch.cat(selected, dim=-1))


class LlavaNextVision(LlavaVision):
    """LLaVA-NeXT's image side ("anyres", ``spatial_unpad``): the image is one base tile of the whole picture
    and the tiles of the grid resolution (``image_grid_pinpoints``) it fits best. Its embeddings are the base
    tile's rows, then the tiles' rows laid out as one feature map, cut back to the picture's aspect ratio,
    with ``image_newline`` after each row of it; what ``LlavaNextModel.get_image_features`` computes, in the
    order its placeholders stand."""

    def __init__(self, hf_config: dict, model_dir: str, reader, *, dtype: torch.dtype, device: torch.device):
        super().__init__(hf_config, model_dir, reader, dtype=dtype, device=device)
        config = self._config(hf_config)
        self.pinpoints = config.image_grid_pinpoints
        self.tile = config.vision_config.image_size
        self.tile_grid = self.tile // config.vision_config.patch_size
        name = ("model." if self.flat else "") + "image_newline"
        self.image_newline = reader.read(name).to(device=device, dtype=dtype)

    @staticmethod
    def _config(hf_config: dict):
        import transformers

        return transformers.LlavaNextConfig(**hf_config)

    @staticmethod
    def _projector(config):
        from transformers.models.llava_next.modeling_llava_next import LlavaNextMultiModalProjector

        return LlavaNextMultiModalProjector(config)

    @torch.inference_mode()
    def _features(self, picture) -> tuple[torch.Tensor, None]:
        from transformers.models.llava_next.modeling_llava_next import (get_anyres_image_grid_shape,
                                                                       image_size_to_num_patches, unpad_image)

        processed = self.processor(images=[picture], return_tensors="pt")
        size = processed["image_sizes"][0].tolist()  # (height, width) of the picture
        tiles = image_size_to_num_patches(size, self.pinpoints, self.tile)
        features = self._project(processed["pixel_values"][0, :tiles])
        rows, cols = get_anyres_image_grid_shape(size, self.pinpoints, self.tile)
        grid = features[1:].view(rows, cols, self.tile_grid, self.tile_grid, -1)
        grid = grid.permute(4, 0, 2, 1, 3).flatten(1, 2).flatten(2, 3)  # [hidden, rows * grid, cols * grid]
        grid = unpad_image(grid, size)
        grid = torch.cat((grid, self.image_newline[:, None, None].expand(*grid.shape[:-1], 1)), dim=-1)
        return torch.cat((features[0], grid.flatten(1, 2).transpose(0, 1))), None


class LlavaForConditionalGeneration:
    """Builds a LLaVA checkpoint's model: its text family's decoder, with a ``vision`` (``LlavaVision``)."""

    vision_class = LlavaVision

    @classmethod
    def from_checkpoint(cls, hf_config: dict, reader, *, dtype: torch.dtype, device: torch.device, **kwargs):
        from llmbus.workers.loader import native_builders

        text_config = dict(hf_config["text_config"])
        text_type = text_config.get("model_type", "llama")
        builder = native_builders().get(text_type)
        if builder is None or issubclass(builder, LlavaForConditionalGeneration):
            raise ValueError(f"a LLaVA checkpoint whose text model is {text_type!r}: llmbus runs LLaVA on its native "
                             f"decoders only")
        flat = reader.has(FLAT_TEXT_PREFIX + "embed_tokens.weight")
        text_reader = FlatLayoutReader(reader) if flat else PrefixedReader(reader, HUB_TEXT_PREFIX)
        if not text_reader.has("model.embed_tokens.weight"):
            raise ValueError("a LLaVA checkpoint without its text model's weights (language_model.model.*)")
        model = builder.from_checkpoint(text_config, text_reader, dtype=dtype, device=device, **kwargs)
        # the vision side computes in the decoder's dtype (bfloat16 weights are computed in float32 on CPU)
        model.vision = cls.vision_class(hf_config, reader.model_dir, reader, dtype=model.dtype, device=device)
        return model


class LlavaNextForConditionalGeneration(LlavaForConditionalGeneration):
    """Builds a LLaVA-NeXT checkpoint's model: LLaVA's, with LLaVA-NeXT's tiles (``LlavaNextVision``)."""

    vision_class = LlavaNextVision


class Gemma3Vision(LlavaVision):
    """Gemma 3's image side: a SigLIP tower whose last hidden state is average-pooled, normalised and projected
    into ``mm_tokens_per_image`` rows (``Gemma3MultiModalProjector``), one image size for every picture; what
    ``Gemma3Model.get_image_features`` computes. Its placeholders attend each other both ways
    (``Gemma3ForCausalLM.images_attend_both_ways``)."""

    def __init__(self, hf_config: dict, model_dir: str, reader, *, dtype: torch.dtype, device: torch.device):
        super().__init__(hf_config, model_dir, reader, dtype=dtype, device=device)
        if getattr(self.processor, "do_pan_and_scan", False):  # its crops are images the frontend does not lay out
            raise ValueError("Gemma 3's pan-and-scan crops are not served (do_pan_and_scan in "
                             "preprocessor_config.json)")

    def _read_options(self, config) -> None:
        self.tokens_per_image = config.mm_tokens_per_image  # (the tower's last hidden state, every patch, pooled)

    @staticmethod
    def _config(hf_config: dict):
        import transformers

        return transformers.Gemma3Config(**hf_config)

    @staticmethod
    def _projector(config):
        from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

        return Gemma3MultiModalProjector(config)

    @torch.inference_mode()
    def _features(self, picture) -> tuple[torch.Tensor, None]:
        pixels = self.processor(images=[picture], return_tensors="pt")["pixel_values"]
        return self.projector(self.tower(pixel_values=pixels.to(self.device, self.dtype)).last_hidden_state)[0], None
