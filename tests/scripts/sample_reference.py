"""The image an exported pipeline makes with the sampler's settings, computed in a fresh process.

`python tests/scripts/sample_reference.py <pipeline> <prompt> <seed> <out.npy> [--bf16-unet] [--lora <folder>]
[--max-sequence-length N] [--reference <image>] [--frames N --size WxH]`: any family's pipeline (DiffusionPipeline
picks its class from the folder; helpers/pipelines.py reads Qwen-Image-Edit's processor); the bf16 flag casts its
UNet or transformer.

A fresh process, because the pytest process is not a clean one: its in-process ZeRO-3 engines
(test_deepspeed_engines, test_lora) replace `torch.nn.functional.linear` for good, which changes the
kernels a later pipeline runs. One thread, as the sampled runs get (the tests set OMP_NUM_THREADS=1).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import numpy as np
import torch

from ds_trainer.train.observe import sampling

sys.path.insert(0, str(Path(__file__).parents[1]))
from helpers import pipelines  # noqa: E402 - the tests' helpers, beside this folder


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("pipeline")
    parser.add_argument("prompt")
    parser.add_argument("seed", type=int)
    parser.add_argument("out")
    parser.add_argument("--bf16-unet", action="store_true")
    parser.add_argument("--lora")
    parser.add_argument("--max-sequence-length", type=int)
    parser.add_argument("--reference", help="an editing model's reference image (FluxKontextPipeline), an image to "
                        "video model's first frame")
    parser.add_argument("--frames", type=int, help="a video model's clip: its frames (its frames are saved)")
    parser.add_argument("--size", default="128x128", help="WIDTHxHEIGHT of the sample")
    args = parser.parse_args()
    torch.set_num_threads(1)
    pipe = pipelines.load(Path(args.pipeline))
    pipe.set_progress_bar_config(disable=True)
    model = pipe.unet if hasattr(pipe, "unet") else pipe.transformer
    context: contextlib.AbstractContextManager = contextlib.nullcontext()
    if args.bf16_unet:  # DeepSpeed trained (and sampled) the model in bf16; the export holds those values in fp32
        # DeepSpeed (0.19) casts the parameters alone and keeps float buffers in fp32 (SD3's position embedding):
        # so does this copy.
        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16)
        context = contextlib.ExitStack()
        context.enter_context(sampling.model_in_its_dtype(model))
        # FLUX.2's pipelines hand the VAE the transformer's dtype: the sampler casts to the VAE's
        context.enter_context(sampling._vae_decode_in_its_dtype(pipe.vae))  # noqa: SLF001
    if args.lora:
        pipe.load_lora_weights(args.lora)
    with context:
        extra = (("max_sequence_length", args.max_sequence_length),) if args.max_sequence_length else ()
        if args.reference and type(pipe).__name__ == "FluxKontextPipeline":  # the sampler's call of Kontext: the
            extra += (("max_area", 128 * 128), ("_auto_resize", False))  # reference fitted to the sample's size
        if args.frames:  # a video model's call (families/wan.py's call_kwargs): its frames, as pictures
            extra = tuple(sorted((*extra, ("num_frames", args.frames), ("output_type", "pil"))))
        width, height = (int(side) for side in args.size.split("x"))
        settings = sampling.Settings(2, 5.0, "", width, height, extra, (args.reference,) if args.reference else ())
        image = sampling.generate(pipe, args.prompt, args.seed, settings, sampling.reference(settings, 0))
    frames = image if isinstance(image, list) else [image]
    np.save(args.out, np.stack([np.asarray(frame) for frame in frames]) if args.frames else np.asarray(image))


if __name__ == "__main__":
    main()
