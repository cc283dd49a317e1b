"""`train.attention`: one SDPA kernel in the trained module's attention layers (forward and a checkpointed
recompute), torch's pick elsewhere; refused where the device lacks the kernel."""

from __future__ import annotations

from typing import Any

import pytest
from helpers.cfg import make_cfg

from ds_trainer.config import checks, hardware

torch = pytest.importorskip("torch")


def _unet_step(kernel: str, checkpointing: bool = False) -> tuple[Any, dict[str, Any]]:
    """The tiny SDXL UNet's output and gradients for one fixed input, its attention held to `kernel`."""
    from ds_trainer.train import families
    from ds_trainer.train.families import attention

    cfg = make_cfg("model=sdxl_tiny", "precision=fp32")
    torch.manual_seed(0)
    unet = families.of(cfg).load_trained(cfg)
    layers = attention.restrict(unet, kernel)
    everyone = sum(1 for m in unet.modules() if hasattr(m, "set_processor"))
    assert layers == (0 if kernel == "sdpa" else everyone) and everyone > 0
    if checkpointing:
        unet.enable_gradient_checkpointing()
    gen = torch.Generator().manual_seed(1)
    out = unet(torch.randn(2, 4, 16, 16, generator=gen), torch.tensor([10, 500]),
               torch.randn(2, 77, 64, generator=gen),
               added_cond_kwargs={"text_embeds": torch.randn(2, 32, generator=gen),
                                  "time_ids": torch.randn(2, 6, generator=gen)}).sample
    out.square().mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in unet.named_parameters() if p.grad is not None}


def test_a_named_kernel_runs_the_trained_modules_attention_in_forward_and_recompute() -> None:
    """On the CPU torch has flash and math: each held alone computes the same UNet to float noise but not bit for
    bit (the kernel really changed), and a gradient-checkpointed recompute runs the same kernel as the forward."""
    flash, flash_grads = _unet_step("flash")
    math, math_grads = _unet_step("math")
    assert torch.allclose(flash, math, atol=1e-5) and not torch.equal(flash, math)
    assert all(torch.allclose(flash_grads[n], math_grads[n], atol=1e-5, rtol=1e-4) for n in flash_grads)
    recomputed, recomputed_grads = _unet_step("math", checkpointing=True)
    assert torch.equal(recomputed, math)
    assert all(torch.equal(recomputed_grads[n], math_grads[n]) for n in math_grads)
    picked, _ = _unet_step("sdpa")  # torch's own pick on the CPU: flash for these inputs
    assert torch.equal(picked, flash)


@pytest.mark.parametrize(("kernel", "info", "overrides", "fix"), [
    ("efficient", hardware.PlatformInfo("cpu", bf16=True, fp16=False), [], "train.attention=sdpa"),
    ("cudnn", hardware.PlatformInfo("cpu", bf16=True, fp16=False), [], "train.attention=sdpa"),
    ("flash", hardware.PlatformInfo("cuda", bf16=False, fp16=True, gpu_name="Tesla V100"), ["precision=fp16"],
     "train.attention=efficient"),
    ("flash", hardware.PlatformInfo("cuda", bf16=True, fp16=True, gpu_name="H100"), ["precision=fp32"],
     "precision=bf16"),
])
def test_a_kernel_the_device_lacks_is_refused_before_the_run(kernel: str, info: hardware.PlatformInfo,
                                                             overrides: list[str], fix: str) -> None:
    """(The CUDA platforms are described, not detected: no GPU here.)"""
    report = checks.check(make_cfg(f"train.attention={kernel}", *overrides), info)
    shown = report.render()
    assert not report.ok and f"train.attention={kernel}" in shown and fix in shown, shown
    for fine in ("sdpa", "math"):
        assert checks.check(make_cfg(f"train.attention={fine}", *overrides), info).ok
    assert checks.check(make_cfg("train.attention=efficient", "precision=fp32"),
                        hardware.PlatformInfo("cuda", bf16=True, fp16=True, gpu_name="H100")).ok
