"""The memory planner: its model-state part agrees with DeepSpeed's estimators; the command works."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import autograd
from helpers.cfg import make_cfg

from ds_trainer.tools import plan

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def base() -> plan.UNetStats:
    return plan.unet_stats(make_cfg("model=sdxl_base").model.architecture)


def test_parameter_count_of_the_full_sdxl_unet_from_the_meta_device(base: plan.UNetStats) -> None:
    assert base.params == 2_567_463_684  # SDXL 1.0's UNet, 2.57 B
    assert base.largest_layer > 10_000_000


@pytest.mark.parametrize("ranks", [1, 2, 8, 64])
def test_zero2_model_states_match_deepspeed(base: plan.UNetStats, ranks: int) -> None:
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    for offload in ("none", "cpu"):
        params, grads, optimizer, host = plan.model_states("stage2", offload, base.params, base.largest_layer,
                                                            ranks, True, "bf16")
        cpu, gpu = estimate_zero2_model_states_mem_needs(base.params, num_gpus_per_node=ranks,
                                                         cpu_offload=offload == "cpu")
        assert params + grads + optimizer == pytest.approx(gpu, abs=ranks)  # integer division per part
        if offload == "cpu":
            assert host == cpu


@pytest.mark.parametrize("ranks", [1, 2, 8, 64])
@pytest.mark.parametrize(("offload", "params_offload"), [("none", True), ("cpu", True), ("cpu", False)])
def test_zero3_model_states_match_deepspeed(base: plan.UNetStats, ranks: int, offload: str,
                                            params_offload: bool) -> None:
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    params, grads, optimizer, host = plan.model_states("stage3", offload, base.params, base.largest_layer, ranks,
                                                        params_offload, "bf16")
    cpu, gpu, _ = estimate_zero3_model_states_mem_needs(base.params, base.largest_layer, num_gpus_per_node=ranks,
                                                        cpu_offload=offload == "cpu",
                                                        cpu_offload_params=params_offload)
    assert params + grads + optimizer == pytest.approx(gpu, abs=ranks)
    if offload == "cpu":
        assert host == cpu


def test_activations_scale_with_batch_and_area_and_checkpointing_cuts_them() -> None:
    arch = make_cfg("model=sdxl_base").model.architecture
    one = plan.activation_bytes(arch, 1, 1024, 1024, 2, checkpointing=False)
    two = plan.activation_bytes(arch, 2, 1024, 1024, 2, checkpointing=False)
    small = plan.activation_bytes(arch, 1, 512, 512, 2, checkpointing=False)
    ckpt = plan.activation_bytes(arch, 1, 1024, 1024, 2, checkpointing=True)
    assert two == pytest.approx(2 * one, rel=0.1)
    assert 3.0 < one / small < 4.5  # attention is counted as memory-efficient kernels keep it: ~linear in area
    assert ckpt < one / 5
    assert 2 * 2**30 < one < 30 * 2**30  # SDXL at 1024 px, batch 1, bf16


def test_plan_command_prints_every_cell_and_recommends_the_cheapest_that_fits() -> None:
    result = subprocess.run([sys.executable, "-m", "ds_trainer.plan", "model=sdxl_base", "resolution=px1024",
                             "train.micro_batch_size=1", "train.gradient_checkpointing=true", "plan.vram_gib=24"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    cells = [line.split()[:2] for line in lines if line.startswith(("ddp", "stage"))]
    assert cells == [list(c) for c in plan.CELLS]
    fits = {tuple(line.split()[:2]): line.split()[-1] for line in lines if line.startswith(("ddp", "stage"))}
    assert fits[("ddp", "none")] == "no"  # 16 bytes per parameter: 38 GiB before activations
    assert fits[("stage3", "cpu")] == "yes"
    recommended = lines[-1]
    assert recommended.startswith("recommended for 24 GiB: zero=stage")
    zero, offload = recommended.split("zero=")[1].split()[0], recommended.split("offload=")[1].split()[0]
    first_fit = next(c for c in plan.CELLS if fits[c] == "yes")
    assert (zero, offload) == first_fit


def test_training_logs_the_plan(workdir) -> None:  # type: ignore[no-untyped-def]
    from helpers.cli import run_cli

    result = run_cli("logger=none", "train.max_steps=1", "data.num_samples=2", cwd=workdir)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "memory plan (python -m ds_trainer.plan): about" in result.stderr


def test_the_planner_counts_what_a_gpu_run_holds_beyond_the_model_states(base: plan.UNetStats) -> None:
    """The terms a GPU run adds, against hand-computed bytes: the GPU EMA's fp32 shadow (a slice per rank),
    the VAE and text encoders left on the GPU with data.cache=false, and DDP's 16-bit autocast copy of the
    weights (its bucketed gradient copy is gone: Accelerate gets gradient_as_bucket_view)."""
    from ds_trainer.tools.plan import samples as plan_samples

    p = base.params
    cell = ("model=sdxl_base", "zero=stage2")
    plain = plan.estimate(make_cfg(*cell), "stage2", "none", 4)
    ema = plan.estimate(make_cfg(*cell, "train.ema=true", "train.ema_device=gpu"), "stage2", "none", 4)
    assert ema.params - plain.params == 4 * p // 4  # 2.57 GB per rank of 4, not 10.3 GB on each
    host_ema = plan.estimate(make_cfg(*cell, "train.ema=true"), "stage2", "none", 4)
    assert host_ema.params == plain.params and host_ema.host - plain.host == 4 * base.params // 4  # its fp32 slice
    uncached = plan.estimate(make_cfg(*cell, "data.cache=false"), "stage2", "none", 4)
    frozen = plan_samples.frozen_bytes(str(make_cfg(*cell).model.architecture), "cuda", "bf16")
    assert uncached.params - plain.params == frozen and 1.5 * 2**30 < frozen < 2 * 2**30  # bf16 encoders, fp32 VAE
    # Tags shuffled: the latents stay cached, the text encoders stay to encode each batch's captions (not the VAE)
    tags = plan.estimate(make_cfg(*cell, "data=folder", "data.path=/data/photos", "data.tag_shuffle=true"), "stage2",
                         "none", 4)
    encoders = plan_samples.frozen_bytes(str(make_cfg(*cell).model.architecture), "cuda", "bf16", vae=False)
    assert tags.params - plain.params == encoders and 0.7 * frozen < encoders < frozen
    # ZeRO-3 with NVMe: a LoRA swaps Adam's state for its adapters, its frozen base the 16-bit weights only
    full, adapted = (plan.estimate(make_cfg("model=sdxl_base", "zero=stage3", "offload=nvme", *extra), "stage3",
                                   "nvme", 1) for extra in ([], ["adapter=lora"]))
    assert full.nvme == (16 + 2) * p and 2 * p < adapted.nvme < full.nvme / 8, (full.nvme, adapted.nvme)
    ddp = plan.estimate(make_cfg("model=sdxl_base", "zero=ddp"), "ddp", "none", 2)
    ddp32 = plan.estimate(make_cfg("model=sdxl_base", "zero=ddp", "precision=fp32"), "ddp", "none", 2)
    assert (ddp.params, ddp.grads, ddp.optimizer) == (6 * p, 4 * p, 8 * p)
    assert ddp32.params == 4 * p
    # DDP's module keeps fp32 weights and the sampler runs no autocast: its sampling activations are fp32's (seen
    # where the denoiser's, not the VAE decode's, are the peak: Flux's transformer at 1024 px)
    arch = str(make_cfg("model=flux_dev").model.architecture)
    sampled = {zero: plan_samples.peak(make_cfg("model=flux_dev", f"zero={zero}", "samples=on"), 0, p, arch)
               for zero in ("ddp", "stage2", "fsdp_full_shard")}
    assert sampled["ddp"] > sampled["stage2"] == sampled["fsdp_full_shard"], sampled


def test_a_checkpoint_and_the_export_are_sized_from_the_parameters(base: plan.UNetStats) -> None:
    """What the doctor compares with the free disk: 2 + 12 + 12 bytes a parameter with AdamW in bf16 (measured on
    the tiny model's files), 4 more with the EMA; the export is the fp32 UNet (and its EMA twin)."""
    p = base.params
    one, export = plan.checkpoint_bytes(make_cfg("model=sdxl_base"))
    assert (one, export) == (26 * p, 4 * p)
    one, export = plan.checkpoint_bytes(make_cfg("model=sdxl_base", "train.ema=true"))
    assert (one, export) == (30 * p, 8 * p)


def test_trained_text_encoders_add_their_model_states_and_activations(base: plan.UNetStats) -> None:
    """SDXL's encoders trained whole (CLIP-L 123.1M + OpenCLIP-bigG 694.7M parameters, CLIP-L's unused last layer
    and final norm frozen) add their fp32 weights, gradients and Adam state under DDP, and their activations: a bf16
    forward of 77 tokens keeps at least the inputs of each layer's Linears (q/k/v share one, out_proj, fc1, and
    fc2's 4x wider one: 7 x 77 x hidden x 2 bytes a layer; 12 layers of 768, 32 of 1280), about 54 MB an image."""
    from ds_trainer.tools.plan import lora as plan_lora

    cell = ("model=sdxl_base", "zero=ddp")
    frozen, full = (plan.estimate(make_cfg(*cell, *extra), "ddp", "none", 1)
                    for extra in ((), ("text_encoders=full",)))
    architecture = str(make_cfg(*cell).model.architecture)
    te_frozen, te_trained = plan_lora.encoders(make_cfg(*cell, "text_encoders=full"), architecture)
    assert 817e6 < te_frozen + te_trained < 818.5e6 and 0 < te_frozen < 8e6  # CLIP-L's last layer and norm
    assert full.grads - frozen.grads == 4 * te_trained and full.optimizer - frozen.optimizer == 8 * te_trained
    floor = 7 * 77 * 2 * (12 * 768 + 32 * 1280)
    added = full.activations - frozen.activations
    assert floor < added < 4 * floor, (added, floor)
    two = plan.estimate(make_cfg(*cell, "text_encoders=full", "train.micro_batch_size=2"), "ddp", "none", 1)
    frozen_two = plan.estimate(make_cfg(*cell, "train.micro_batch_size=2"), "ddp", "none", 1)
    assert abs((two.activations - frozen_two.activations) - 2 * added) < 0.01 * added  # per image
    lora = plan.estimate(make_cfg(*cell, "text_encoders=lora", "train.gradient_checkpointing=true"), "ddp", "none", 1)
    plain = plan.estimate(make_cfg(*cell, "train.gradient_checkpointing=true"), "ddp", "none", 1)
    assert 0 < lora.activations - plain.activations < added / 4  # one layer recomputed at a time


def test_a_diffusion_transformers_activations_scale_with_its_tokens_and_checkpointing_cuts_them() -> None:
    """SD3.5's transformer (MMDiT-X, joint blocks), counted like the UNet: memory-efficient attention keeps
    activations about linear in the image tokens (4096 at 1024 px against 1024 at 512, beside the caption's 333)."""
    arch = make_cfg("model=sd35_medium").model.architecture
    tokens = 77 + 256
    one = plan.activation_bytes(arch, 1, 1024, 1024, 2, False, tokens)
    small = plan.activation_bytes(arch, 1, 512, 512, 2, False, tokens)
    ckpt = plan.activation_bytes(arch, 1, 1024, 1024, 2, True, tokens)
    assert 2.5 < one / small < 4.0
    assert ckpt < one / 5
    assert 4 * 2**30 < one < 40 * 2**30  # SD3.5 Medium at 1024 px, batch 1, bf16
    assert plan.unet_stats(arch).params == 2_243_171_520


def test_the_readmes_table_of_full_size_models_is_the_planners_and_deepspeeds() -> None:
    """The README's per-GPU figures for every full-size model (the video models' at 480p and 720p, 81 frames) are what
    `python -m ds_trainer.tools.plan.table` prints now: DeepSpeed's estimator and the planner's model states agree in
    every cell, and the training peak adds what the estimator leaves out (activations, DeepSpeed's buffers)."""
    from pathlib import Path

    from ds_trainer.tools.plan import table as plan_table

    rows = plan_table.rows()
    assert plan_table.markdown(rows) in (Path(__file__).parents[1] / "README.md").read_text()
    assert sum("81 frames" in label for label, _, _ in rows) == 6
    for _, cells, _ in rows:
        for deepspeed, states, peak in cells:
            assert round(deepspeed, 1) == round(states, 1) and peak > states
    peaks = {label: cells[2][2] for label, cells, _ in rows}  # ZeRO-3 on 8 GPUs: 720p costs more than 480p
    wan = "Wan 2.1 T2V 14B (14.29 B), {}, 81 frames"
    assert peaks[wan.format("1280x720")] > peaks[wan.format("832x480")]
    # The rows ZeRO-3 on 8 x 80 GiB holds alone say 1; the 720p clips need their sequence split in two
    needs = {label: fits for label, _, fits in rows}
    assert needs[wan.format("1280x720")] == (2, pytest.approx(65.1, abs=0.05))
    assert all(fits == (1, peaks[label]) for label, fits in needs.items() if peaks[label] <= 80)


def test_the_header_of_a_quantized_plan_says_which_cells_it_left_out(capsys: pytest.CaptureFixture[str]) -> None:
    """nf4 trains under ZeRO-3 and FSDP2 (their cells are listed, and the header says so); int8 and fp8 do not
    (left out, as the header says)."""
    from ds_trainer.tools.plan import cli

    for kind, listed in (("nf4", True), ("int8", False), ("fp8", False)):
        assert cli.main(["model=sdxl_base", "adapter=lora", f"quantize={kind}", "plan.vram_gib=24"]) == 0
        out = capsys.readouterr().out
        rows = {tuple(line.split()[:2]) for line in out.splitlines() if line.startswith(("ddp", "stage", "fsdp"))}
        assert (("stage3", "cpu") in rows and ("fsdp_full_shard", "none") in rows) == listed, (kind, rows)
        header = next(line for line in out.splitlines() if line.startswith(f"quantize={kind}"))
        assert ("left out" in header) != listed, header


def _saved_by_a_real_forward(cfg: object) -> int:
    """Bytes autograd keeps in one forward of the run's trained module, built for real on the CPU with
    the run's attention kernel (each tensor once, parameters left out: as the planner counts)."""
    import torch

    from ds_trainer.tools.plan.unet import forward_of
    from ds_trainer.train import families
    from ds_trainer.train.families import attention

    model = families.of(cfg).load_trained(cfg).to(torch.bfloat16)
    attention.restrict(model, cfg.train.attention.value)  # type: ignore[attr-defined]
    return autograd.saved_bytes(forward_of(model, 1, 256, 256, torch.bfloat16, "cpu"), model.parameters())


def test_the_planner_counts_the_attention_probabilities_the_math_kernel_saves() -> None:
    """train.attention=math (allowed on CUDA too) saves each attention's softmax (B x heads x S x S, in fp32
    for bf16 inputs) for backward: the planner's activations are what a real forward under it saves,
    as they are under torch's own choice (the CPU's flash kernel, which keeps what a fused one keeps)."""
    overrides = ("model=sdxl_tiny", "precision=bf16", "resolution=px256", "train.gradient_checkpointing=false")
    planned, real = {}, {}
    for kernel in ("math", "sdpa"):
        cfg = make_cfg(*overrides, f"train.attention={kernel}")
        planned[kernel] = plan.estimate(cfg, "ddp", "none", 1).activations
        real[kernel] = _saved_by_a_real_forward(cfg)
    assert planned["math"] == pytest.approx(real["math"], rel=0.01)
    assert planned["sdpa"] == pytest.approx(real["sdpa"], rel=0.06)
    assert planned["math"] > 1.4 * planned["sdpa"]
