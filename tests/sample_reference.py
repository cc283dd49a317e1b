"""The image an exported pipeline makes with the sampler's settings, computed in a fresh process.

`python tests/sample_reference.py <pipeline> <prompt> <seed> <out.npy> [--bf16-unet] [--lora <folder>]`

A fresh process, because the pytest process is not a clean one: its in-process ZeRO-3 engines
(test_deepspeed_engines, test_lora) replace `torch.nn.functional.linear` for good, which changes the
kernels a later pipeline runs. One thread, as the sampled runs get (the tests set OMP_NUM_THREADS=1).
"""

from __future__ import annotations

import argparse
import contextlib

import numpy as np
import torch
from diffusers import StableDiffusionXLPipeline

from ds_trainer.train import sampling


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("pipeline")
    parser.add_argument("prompt")
    parser.add_argument("seed", type=int)
    parser.add_argument("out")
    parser.add_argument("--bf16-unet", action="store_true")
    parser.add_argument("--lora")
    args = parser.parse_args()
    torch.set_num_threads(1)
    pipe = StableDiffusionXLPipeline.from_pretrained(args.pipeline)
    pipe.set_progress_bar_config(disable=True)
    context: contextlib.AbstractContextManager = contextlib.nullcontext()
    if args.bf16_unet:  # DeepSpeed trained (and sampled) the UNet in bf16; the export holds those values in fp32
        pipe.unet.to(torch.bfloat16)
        context = sampling.unet_in_its_dtype(pipe.unet)
    if args.lora:
        pipe.load_lora_weights(args.lora)
    with context:
        image = sampling.generate(pipe, args.prompt, args.seed, sampling.Settings(2, 5.0, "", 128, 128))
    np.save(args.out, np.asarray(image))


if __name__ == "__main__":
    main()
