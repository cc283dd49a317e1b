"""The frozen VAE and text encoders: their dtype per precision, and what a batch encoded now holds against
the cache (the contract the GPU path depends on: CPU float32 tensors either way)."""

from __future__ import annotations

from pathlib import Path

import torch
from helpers.cfg import make_cfg

from ds_trainer.config import checks
from ds_trainer.train import data, families
from ds_trainer.train.families import common, sdxl


def test_frozen_encoders_follow_the_precision_and_the_cache_key_records_it() -> None:
    """The encoders' dtype per precision as a GPU run decides it (platform=cuda, no GPU needed), float32 on
    the CPU whatever the precision; caches built in other dtypes do not share a folder."""
    from ds_trainer.config import checks
    from ds_trainer.train import data, families

    dtypes, folders = {}, set()
    for precision in ("bf16", "fp16", "fp32"):
        cfg = checks.check(make_cfg(f"precision={precision}", "platform=cuda")).cfg
        dtypes[precision] = common.frozen_dtype_name(cfg, cfg.resolved.platform)
        folders.add(data.LatentCache(cfg, data.SyntheticImages(cfg), families.of(cfg), "cuda").dir)
        cpu = checks.check(make_cfg(f"precision={precision}", "platform=cpu")).cfg
        assert common.frozen_dtype_name(cpu, cpu.resolved.platform) == "float32"
        # Planned for a GPU, run where torch sees none: the encoders run in float32 there, and so says the key
        on_cpu = data.LatentCache(cfg, data.SyntheticImages(cfg), families.of(cfg), "cpu").dir
        assert on_cpu == data.LatentCache(cpu, data.SyntheticImages(cpu), families.of(cpu), "cpu").dir
    assert dtypes == {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
    assert len(folders) == 3 and on_cpu in folders  # fp32 planned for a GPU: float32, the same key


def test_a_batch_encoded_now_is_what_the_cache_returns_on_the_cpu_in_float32(tmp_path: Path) -> None:
    """data.cache=false encodes each batch: the step draws its noise on the CPU, so what the encoders return
    must be there, in float32, as the cache's tensors are (on a GPU they were CUDA tensors and the first step
    failed in add_noise). The same samples give the same tensors either way."""
    cfg = checks.check(make_cfg("data.num_samples=3", f"data.cache_dir={tmp_path}")).cfg
    frozen = sdxl.load_frozen(cfg)
    images = data.SyntheticImages(cfg)
    cache = data.LatentCache(cfg, images, families.of(cfg), "cpu")
    assert cache.build(images, frozen, 0, 1, torch.device("cpu")) == 3
    cache.finish()
    cached, now = cache.load([2, 0]), data.encode_batch(images, frozen, [2, 0], torch.device("cpu"))
    assert cached.keys() == now.keys()
    for key in cached:
        assert now[key].device.type == cached[key].device.type == "cpu", key
        assert now[key].dtype == cached[key].dtype, key
        assert torch.equal(now[key], cached[key]), key
    assert now["latents"].dtype == torch.float32 and now["latents"].shape[0] == 2
