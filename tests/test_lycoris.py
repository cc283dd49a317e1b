"""`adapter=dora|lokr|loha`: peft's DoRA, LoKr and LoHa on the frozen base, as LoRA is.

A two-rank ZeRO-3 LoKr run learns (the loss falls over-fitting one batch; each adapted layer holds its base weight
and factors whole from its forward through its backward) and resumes on one rank of ZeRO-2 (the portable state
carries the factors and their moments). The LyCORIS-layout file makes, under ComfyUI's rules for LoKr and LoHa, the
very weights peft's layers make, and reads back into the adapters (`adapter.init_from`); DoRA's diffusers file loads
into a pipeline that then computes what the trained module does. The layouts that cannot hold a method are refused
before the run. LoHa and DoRA under ZeRO-3 and FSDP2 on two ranks: `make test-long`.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers.cfg import make_cfg
from helpers.cli import run_cli, run_dirs
from helpers.ranks import torchrun

from ds_trainer.config import checks

torch = pytest.importorskip("torch")

# Over-fitting one batch of two images (as test_lora's and test_quantize's checks), fp32 for exact comparisons; the
# convolutions and feed-forward layers adapted too (LoKr on the attention alone moves the loss by 8% in 8 steps).
TARGETS = "[to_q,to_k,to_v,to_out.0,ff.net.0.proj,ff.net.2,proj_in,proj_out,conv1,conv2,conv_in,conv_out]"
OVERFIT = ["logger=none", "data.num_samples=2", "scheduler=constant", "optimizer.lr=3e-2", "train.max_steps=8",
           "train.checkpoint_every=4", "precision=fp32", f"adapter.targets={TARGETS}"]
LOKR = ("adapter=lokr", "adapter.rank=4", "adapter.alpha=16")


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _losses(run_dir: Path) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in _rows(run_dir) if "loss" in row}


def _two_ranks(cwd: Path, *overrides: str) -> tuple[Path, str]:
    cwd.mkdir(parents=True, exist_ok=True)
    result = subprocess.run([*torchrun(2), "-m", "ds_trainer", *OVERFIT, "train.micro_batch_size=1", *overrides],
                            cwd=cwd, capture_output=True, text=True, timeout=900,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = run_dirs(cwd)
    return run_dir, result.stderr


@pytest.fixture(scope="module")
def lokr_runs(module_tmp: Callable[[str], Path]) -> tuple[Path, str, Path, str]:
    """LoKr under ZeRO-3 on two ranks (rank 4: w2 whole in the attention's layers, a factored product in the
    convolutions'); then its step-4 checkpoint resumed on one rank of ZeRO-2 (micro batch 2: the same global batch)."""
    cwd = module_tmp("lokr")
    run_dir, stderr = _two_ranks(cwd, *LOKR, "zero=stage3")
    resumed = run_cli(*OVERFIT, *LOKR, "zero=stage2",
                      "train.micro_batch_size=2", f"resume={run_dir / 'checkpoints' / 'step_00000004'}", cwd=cwd)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    second = next(d for d in run_dirs(cwd) if d != run_dir)
    return run_dir, stderr, second, resumed.stderr


@pytest.mark.slow
@pytest.mark.multiproc
def test_lokr_learns_on_two_zero3_ranks_and_resumes_on_one_zero2_rank(lokr_runs: tuple[Path, str, Path, str]) -> None:
    from safetensors import safe_open

    run_dir, stderr, resumed, resumed_err = lokr_runs
    losses = _losses(run_dir)
    assert sorted(losses) == list(range(1, 9))
    first, last = sum(losses[s] for s in (1, 2, 3)) / 3, sum(losses[s] for s in (6, 7, 8)) / 3
    assert last < 0.7 * first, losses  # it learns
    log = (run_dir / "ds_trainer.log").read_text()
    assert "adapter=lokr: training" in log and "factor -1" in log
    assert "adapter=lokr under ZeRO-3: 148 adapted layers gather their base weight and adapters together" in log
    with safe_open(str(run_dir / "lora" / "kohya.safetensors"), "pt") as f:
        keys, header = list(f.keys()), f.metadata()
    assert not (run_dir / "lora" / "pytorch_lora_weights.safetensors").exists()  # diffusers has no LoKr reader
    assert {k.rpartition(".")[2] for k in keys} == {"lokr_w1", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "alpha"}
    assert all(k.startswith("lora_unet_") for k in keys)  # SDXL: kohya's (Stability's) module names
    assert header["ss_network_module"] == "lycoris.kohya" and json.loads(header["ss_network_args"])["algo"] == "lokr"
    # Resumed under another layout: the factors and their Adam moments carried, the same losses onwards.
    assert "under another configuration" in resumed_err and "Adam moments" in resumed_err, resumed_err[-2000:]
    got = _losses(resumed)
    assert sorted(got) == [5, 6, 7, 8]
    for step, loss in got.items():
        assert loss == pytest.approx(losses[step], rel=1e-4), step
    from safetensors.torch import load_file

    expected, carried = (load_file(d / "lora" / "kohya.safetensors") for d in (run_dir, resumed))
    assert expected.keys() == carried.keys()
    for key in expected:
        torch.testing.assert_close(carried[key], expected[key], rtol=1e-4, atol=1e-6)


def _adapted(method: str, *overrides: str) -> tuple[Any, Any]:
    """sdxl_tiny's UNet with `method`'s adapters set to random values (they start as the base: zero products)."""
    from ds_trainer.train import families
    from ds_trainer.train.adapters import adapter

    cfg = make_cfg(f"adapter={method}", *overrides)
    unet = families.of(cfg).load_trained(cfg)
    trained = adapter.build(cfg, unet)
    generator = torch.Generator().manual_seed(0)
    named = dict(unet.named_parameters())
    with torch.no_grad():
        for name in trained.names:
            named[name].copy_(torch.randn(named[name].shape, generator=generator) * 0.1)
    return unet, trained


def _comfyui_delta(kind: str, file: dict[str, Any], head: str) -> Any:
    """The weight difference ComfyUI's LoKr and LoHa adapters compute from a file's tensors (comfy/weight_adapter:
    a LoKr scaled by alpha over the rank of its factored matrix, by 1 where neither is factored; a LoHa by alpha over
    its rank)."""
    t = {k.rpartition(".")[2]: v.double() for k, v in file.items() if k.rpartition(".")[0] == head}
    alpha = float(t["alpha"])
    if kind == "loha":
        return (t["hada_w1_a"] @ t["hada_w1_b"]) * (t["hada_w2_a"] @ t["hada_w2_b"]) * alpha / t["hada_w1_b"].shape[0]
    w1 = t["lokr_w1"] if "lokr_w1" in t else t["lokr_w1_a"] @ t["lokr_w1_b"]
    w2 = t["lokr_w2"] if "lokr_w2" in t else t["lokr_w2_a"] @ t["lokr_w2_b"]
    scale = alpha / t["lokr_w2_b"].shape[0] if "lokr_w2_b" in t else 1.0
    return torch.kron(w1, w2) * scale


@pytest.mark.parametrize("method,overrides", [("lokr", ("adapter.rank=16",)), ("lokr", ("adapter.rank=2",)),
                                              ("loha", ())], ids=["lokr_full", "lokr_factored", "loha"])
def test_the_lycoris_file_makes_peft_s_weights_under_comfyuis_rules_and_reads_back(
        method: str, overrides: tuple[str, ...], tmp_path: Path) -> None:
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file

    from ds_trainer.train.adapters import kohya_file, lora_file

    unet, trained = _adapted(method, *overrides, "adapter.alpha=4")
    named = dict(unet.named_parameters())
    file = kohya_file.write(tmp_path, unet, {n: named[n].detach() for n in trained.names}, torch.float32, {})
    tensors = load_file(file)
    layer = unet.down_blocks[1].attentions[0].transformer_blocks[0].attn2.to_k
    head = "lora_unet_input_blocks_3_1_transformer_blocks_0_attn2_to_k"  # Stability's name (one layer per block)
    expected = layer.get_delta_weight("default").double()
    torch.testing.assert_close(_comfyui_delta(method, tensors, head), expected, rtol=1e-5, atol=1e-7)
    assert len({k.rpartition(".")[0] for k in tensors}) == 88  # every adapted layer
    # Read back (adapter.init_from): the same adapters.
    fresh, _ = _adapted(method, *overrides, "adapter.alpha=4")
    assert lora_file.mismatch(file, fresh) is None
    lora_file.load_into(file, fresh)
    got, want = get_peft_model_state_dict(fresh), get_peft_model_state_dict(unet)
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-7)
    # Another method's file, or another rank, does not fit: said with the module.
    other, _ = _adapted("loha" if method == "lokr" else "lokr", "adapter.alpha=4")
    unfit = lora_file.mismatch(file, other)
    assert unfit is not None and "this adapter is" in unfit.why, unfit


@pytest.mark.parametrize("model", ["flux_tiny", "sd3_tiny"])
def test_a_module_the_makers_file_fuses_is_named_for_comfyui_and_reads_back(model: str, tmp_path: Path) -> None:
    """Flux's and SD3's to_q/to_k/to_v are one qkv weight in their makers' layout: a LoKr of one of them is not a
    LoKr of the fused weight, so it is named `lycoris_<diffusers module>` (ComfyUI places it at its rows); the
    modules kept whole keep kohya's names."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file

    from ds_trainer.train.adapters import kohya_file, lora_file

    module, trained = _adapted("lokr", f"model={model}")
    named = dict(module.named_parameters())
    file = kohya_file.write(tmp_path, module, {n: named[n].detach() for n in trained.names}, torch.float32, {})
    heads = {k.rpartition(".")[0] for k in load_file(file)}
    assert any(h.startswith("lycoris_transformer_blocks_0_attn_to_q") for h in heads), sorted(heads)[:5]
    assert any(h.startswith("lora_unet_") for h in heads)  # the attention's output projection: the maker's name
    fresh, _ = _adapted("lokr", f"model={model}")
    assert lora_file.mismatch(file, fresh, "transformer") is None
    lora_file.load_into(file, fresh, "transformer")
    got, want = get_peft_model_state_dict(fresh), get_peft_model_state_dict(module)
    assert got.keys() == want.keys() and all(torch.allclose(got[k], want[k], atol=1e-7) for k in want)


def test_a_dora_file_loads_into_a_pipeline_that_then_computes_what_the_trained_unet_does(tmp_path: Path) -> None:
    from ds_trainer.train import families
    from ds_trainer.train.adapters import lora_file

    unet, trained = _adapted("dora", "precision=fp32")
    named = dict(unet.named_parameters())
    lora_file.write(tmp_path, unet, {n: named[n].detach() for n in trained.names}, torch.float32)
    cfg = make_cfg()
    family = families.of(cfg)
    pipe = family.pipeline(cfg, family.load_frozen(cfg), {})  # the untrained base
    inputs = {"sample": torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(1)),
              "timestep": torch.tensor([500]), "encoder_hidden_states": torch.randn(1, 77, 64),
              "added_cond_kwargs": {"text_embeds": torch.randn(1, 80 - 6 * 8), "time_ids": torch.randn(1, 6)}}
    with torch.no_grad():
        base = pipe.unet(**inputs).sample
        pipe.load_lora_weights(tmp_path)
        loaded = pipe.unet(**inputs).sample
        ours = unet(**inputs).sample
    assert (loaded - base).abs().max() > 1e-3, "the DoRA changed nothing"
    torch.testing.assert_close(loaded, ours, rtol=1e-4, atol=1e-5)
    magnitudes = [k for k in pipe.unet.state_dict() if "lora_magnitude_vector" in k]
    assert len(magnitudes) == 88


@pytest.mark.parametrize("overrides,key,says", [
    (("adapter=lokr", "adapter.formats=[diffusers,kohya]"), "adapter.formats", "loads LoRA and DoRA files only"),
    (("adapter=loha", "adapter.formats=[diffusers]"), "adapter.formats", "LyCORIS' layout"),
    (("adapter=dora", "adapter.formats=[kohya]"), "adapter.formats", "each input column"),
    (("adapter=lokr", "adapter.dropout=0.1"), "adapter.dropout", "no dropout on their input"),
    (("adapter=loha", "quantize=nf4", "zero=stage2"), "adapter", "no bitsandbytes version"),
    (("adapter=dora", "quantize=int8", "zero=ddp"), "adapter", "drops LLM.int8's row scales"),  # on the CPU
    (("adapter=lokr", "adapter.factor=0"), "adapter.factor", "smaller Kronecker matrix"),
])
def test_what_a_method_cannot_do_is_refused_before_the_run(overrides: tuple[str, ...], key: str, says: str) -> None:
    report = checks.check(make_cfg(*overrides))
    problems = [p for p in report.problems if p.key == key]
    assert problems and says in problems[0].why, report.problems


def test_the_planner_counts_each_methods_parameters() -> None:
    from ds_trainer.tools.plan import lora

    counts = {}
    for method in ("lora", "dora", "lokr", "loha"):
        cfg = make_cfg(f"adapter={method}", "adapter.rank=8")
        unet, trained = _adapted(method, "adapter.rank=8")
        counts[method] = lora.trainable(cfg, str(cfg.model.architecture))
        assert counts[method] == trained.count(), method  # the meta model's count is the run's
    assert counts["lokr"] < counts["lora"] < counts["dora"] < counts["loha"]


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.long  # CI budget: LoKr's ZeRO-3 run and its carry run by default; these are the other methods
@pytest.mark.parametrize("method,zero", [("loha", "stage3"), ("dora", "stage3"), ("loha", "fsdp_full_shard"),
                                         ("dora", "fsdp_full_shard"), ("lokr", "fsdp_full_shard")])
def test_each_method_learns_on_two_ranks(method: str, zero: str, tmp_path: Path) -> None:
    run_dir, _ = _two_ranks(tmp_path, f"adapter={method}", f"zero={zero}", "train.checkpoint_every=0")
    losses = _losses(run_dir)
    first, last = sum(losses[s] for s in (1, 2, 3)) / 3, sum(losses[s] for s in (6, 7, 8)) / 3
    assert last < 0.7 * first, losses
    out = run_dir / "lora" / ("pytorch_lora_weights.safetensors" if method == "dora" else "kohya.safetensors")
    assert out.is_file()


@pytest.mark.parametrize("method,says", [("dora", "no kohya-layout form"), ("lokr", "nothing to convert")])
def test_convert_to_kohya_says_why_a_method_has_no_such_file_to_write(method: str, says: str, tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """`python -m ds_trainer.convert <run> --to kohya` turns a LoRA run's diffusers file into kohya's layout; a DoRA
    file would lose its magnitudes there (kohya's DoRA is another normalisation), a LoKr run wrote its file already."""
    from omegaconf import OmegaConf

    from ds_trainer.tools import convert

    OmegaConf.save(make_cfg(f"adapter={method}"), tmp_path / "config.yaml")
    assert convert.main([str(tmp_path), "--to", "kohya"]) == 2
    assert says in capsys.readouterr().err


@pytest.mark.parametrize("method", ["loha", "lokr", "dora"])
def test_convert_unet_merges_each_method_into_the_base_as_it_trained(method: str) -> None:
    """`convert <checkpoint> --unet` of an adapter run merges the adapters (diffusers' fuse_lora, then
    unload_lora): for LyCORIS and DoRA too, the merged UNet gives the adapted UNet's output and holds no
    adapter tensor (test_lora checks LoRA's through the command and the pipeline's image)."""
    unet, _ = _adapted(method, "precision=fp32")  # convert writes fp32
    generator = torch.Generator().manual_seed(1)
    config = unet.config
    text = config.projection_class_embeddings_input_dim - 6 * config.addition_time_embed_dim
    inputs = (torch.randn(1, 4, 16, 16, generator=generator), torch.tensor([10]),
              torch.randn(1, 8, config.cross_attention_dim, generator=generator))
    extra = {"added_cond_kwargs": {"text_embeds": torch.randn(1, text, generator=generator),
                                   "time_ids": torch.randn(1, 6, generator=generator)}}
    with torch.no_grad():
        adapted = unet(*inputs, **extra).sample
        unet.fuse_lora()
        unet.unload_lora()
        merged = unet(*inputs, **extra).sample
    assert not [k for k in unet.state_dict() if any(m in k for m in ("lora", "hada", "lokr"))]
    assert (adapted - merged).abs().max() < 1e-4 and adapted.abs().max() > 1e-3
