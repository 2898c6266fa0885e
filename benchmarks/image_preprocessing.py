"""What an image costs a rank before its vision tower runs: the file's decode and the checkpoint's image
processor (what ``workers/models/llava.py`` runs in the step that first reaches the image), per image size,
against the decode alone in the same run; with ``--tower``, also llava-1.5's vision side (CLIP ViT-L/14 at
336 pixels and the projector, random weights) on this machine's CPU.

    python benchmarks/image_preprocessing.py [--sizes 640x480,1024x768,4032x3024] [--tower]

Each figure is the fastest of ``--repeats`` runs on one thread (the step's host work is one thread's).
"""

from __future__ import annotations

import argparse
import io
import os

from _timing import fastest_s

os.environ.setdefault("OMP_NUM_THREADS", "1")



def jpeg(width: int, height: int) -> bytes:
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=90)
    return out.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="640x480,1024x768,4032x3024", help="width x height, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tower", action="store_true", help="also time llava-1.5's vision side (random weights)")
    args = parser.parse_args()

    import torch
    import transformers
    from PIL import Image

    torch.set_num_threads(1)
    processor = transformers.CLIPImageProcessor(size={"shortest_edge": 336},
                                                crop_size={"height": 336, "width": 336})
    print(f"image processor: {type(processor).__name__}, one thread")
    print("| image | file | decode | decode + processor | (decode + processor) / decode |")
    print("|---|---|---|---|---|")
    for size in args.sizes.split(","):
        width, height = (int(v) for v in size.split("x"))
        data = jpeg(width, height)

        def decode(data=data):
            with Image.open(io.BytesIO(data)) as image:
                image.load()

        def process(data=data):
            with Image.open(io.BytesIO(data)) as image:
                processor(images=[image], return_tensors="pt")

        decode_ms, process_ms = fastest_s(decode, args.repeats) * 1000, fastest_s(process, args.repeats) * 1000
        print(f"| {width}x{height} JPEG | {len(data) / 1e6:.2f} MB | {decode_ms:.1f} ms | {process_ms:.1f} ms | "
              f"{process_ms / decode_ms:.2f}x |")
    if args.tower:
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

        config = transformers.LlavaConfig(
            vision_config=transformers.CLIPVisionConfig(hidden_size=1024, intermediate_size=4096,
                                                        num_hidden_layers=24, num_attention_heads=16,
                                                        image_size=336, patch_size=14),
            text_config=transformers.LlamaConfig(hidden_size=4096))
        tower = transformers.AutoModel.from_config(config.vision_config).eval()
        projector = LlavaMultiModalProjector(config).eval()
        pixels = torch.randn(1, 3, 336, 336)

        @torch.inference_mode()
        def encode():
            hidden = tower(pixels, output_hidden_states=True).hidden_states[-2][:, 1:]
            projector(hidden)

        threads = len(os.sched_getaffinity(0))
        torch.set_num_threads(threads)
        print(f"llava-1.5 vision side (CLIP ViT-L/14-336 + projector), float32, {threads} threads: "
              f"{fastest_s(encode, max(args.repeats // 2, 1)) * 1000:.0f} ms an image")


if __name__ == "__main__":
    main()
