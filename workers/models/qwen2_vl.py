"""Qwen2-VL and Qwen2.5-VL (``model_type`` qwen2_vl, qwen2_5_vl): a vision transformer whose merged patches
are the placeholders' embeddings, in front of Qwen2's decoder with M-RoPE.

The decoder is ``llama.py``'s Qwen2 over the checkpoint's text weights, tensor-parallel as ever; its rotary
embedding takes M-RoPE's sections (``rotary.py``) and the runner hands it each row's [3] positions
(``mrope.py``) from the images' grids. The vision side is transformers' own tower
(``Qwen2VisionTransformerPretrainedModel`` / ``Qwen2_5_VisionTransformerPretrainedModel``, whose merger
projects into the decoder's width) with the checkpoint's weights, held whole by every rank like LLaVA's
(``llava.py``), and the checkpoint's image processor: what ``get_image_features`` computes.
"""

from __future__ import annotations


import torch

from llmbus.workers.models.llava import FLAT_TEXT_PREFIX, FlatLayoutReader
from llmbus.workers.vision import VisionEncoder

# Where a checkpoint keeps the vision tower: the hub's layout, and transformers 5's in-memory one
HUB_VISION_PREFIX, FLAT_VISION_PREFIX = "visual.", "model.visual."
TOWERS = {"qwen2_vl": ("Qwen2VLConfig", "transformers.models.qwen2_vl.modeling_qwen2_vl",
                       "Qwen2VisionTransformerPretrainedModel"),
          "qwen2_5_vl": ("Qwen2_5_VLConfig", "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl",
                         "Qwen2_5_VisionTransformerPretrainedModel")}


class Qwen2VLVision(VisionEncoder):
    """The image side of a Qwen2-VL checkpoint: ``encode`` turns an image into its placeholders' embeddings,
    in the order of its grid's rows."""

    def __init__(self, hf_config: dict, model_dir: str, reader, *, dtype: torch.dtype, device: torch.device):
        import importlib

        import transformers

        config_class, module, tower_class = TOWERS[hf_config["model_type"]]
        config = getattr(transformers, config_class)(**hf_config)
        self.tower = getattr(importlib.import_module(module), tower_class)._from_config(config.vision_config)
        self.merge = config.vision_config.spatial_merge_size
        prefix = FLAT_VISION_PREFIX if reader.has(FLAT_VISION_PREFIX + "merger.mlp.0.weight") else HUB_VISION_PREFIX
        self.tower.load_state_dict({name: reader.read(prefix + name) for name in self.tower.state_dict()},
                                   strict=True)
        self.tower.to(device=device, dtype=dtype).eval()
        self.processor = transformers.AutoImageProcessor.from_pretrained(model_dir)
        self.device, self.dtype = device, dtype

    @torch.inference_mode()
    def _features(self, picture) -> tuple[torch.Tensor, list[int]]:
        processed = self.processor(images=[picture], return_tensors="pt")
        grid_thw = processed["image_grid_thw"]
        out = self.tower(processed["pixel_values"].to(self.device, self.dtype), grid_thw=grid_thw.to(self.device))
        _, rows, cols = (int(x) for x in grid_thw[0])
        return out.pooler_output, [rows // self.merge, cols // self.merge]


class Qwen2VLForConditionalGeneration:
    """Builds a Qwen2-VL (or Qwen2.5-VL) checkpoint's model: Qwen2's decoder with M-RoPE, with a ``vision``
    (``Qwen2VLVision``)."""

    @classmethod
    def from_checkpoint(cls, hf_config: dict, reader, *, dtype: torch.dtype, device: torch.device, **kwargs):
        from llmbus.workers.models.llama import LlamaForCausalLM

        # transformers 5 nests the text model's config; the hub's older configs keep it at the top level
        text_config = dict(hf_config.get("text_config") or
                           {k: v for k, v in hf_config.items() if k not in ("vision_config", "text_config")})
        text_config["model_type"] = "qwen2"  # its layers are Qwen2's (q/k/v biases, the same windows)
        rope = text_config.get("rope_parameters") or text_config.get("rope_scaling") or {}
        if "mrope_section" not in rope:
            raise ValueError("a Qwen2-VL checkpoint whose text config has no mrope_section")
        flat = reader.has(FLAT_TEXT_PREFIX + "embed_tokens.weight")
        model = LlamaForCausalLM.from_checkpoint(text_config, FlatLayoutReader(reader) if flat else reader,
                                                 dtype=dtype, device=device, **kwargs)
        model.vision = Qwen2VLVision(hf_config, reader.model_dir, reader, dtype=model.dtype, device=device)
        return model
