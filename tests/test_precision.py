"""What each `precision` means under each backend, where precision=bf16_pure exists, and what it saves.

The engines themselves: test_deepspeed_engines (DeepSpeed's bf16 masters and moments, their bytes) and test_fsdp
(FSDP2's bf16 shards, a run moved into bf16_pure and out again).
"""

from __future__ import annotations

import json

import pytest
from helpers.cfg import make_cfg

from ds_trainer.config import checks, ds_config
from ds_trainer.tools import plan

# (zero, precision) -> (masters, gradients, optimizer state, compute, reduce), as config.yaml records them.
MEANINGS = {
    ("stage2", "bf16"): ("fp32, sharded", "fp32", "fp32, sharded", "bf16", "bf16"),
    ("stage2", "bf16_pure"): ("bf16, sharded", "bf16", "bf16, sharded", "bf16", "bf16"),
    ("stage0", "fp32"): ("fp32", "fp32", "fp32", "fp32", "fp32"),
    ("ddp", "bf16"): ("fp32", "fp32", "fp32", "bf16", "fp32"),
    ("fsdp_full_shard", "bf16"): ("fp32, sharded", "fp32", "fp32, sharded", "bf16", "fp32"),
    ("fsdp_shard_grad_op", "bf16_pure"): ("bf16, sharded", "bf16", "bf16, sharded", "bf16", "fp32"),
}


@pytest.mark.parametrize(("zero", "precision"), list(MEANINGS))
def test_config_records_what_the_precision_means_under_the_backend(zero: str, precision: str) -> None:
    report = checks.check(make_cfg(f"zero={zero}", f"precision={precision}"))
    assert report.ok, report.render()
    meaning = report.cfg.resolved.precision
    assert (meaning.master_weights, meaning.gradients, meaning.optimizer_state, meaning.compute_dtype,
            meaning.reduce_dtype) == MEANINGS[zero, precision]


def test_bf16_pure_writes_deepspeeds_bf16_masters_and_optimizer_states() -> None:
    cfg = checks.check(make_cfg("zero=stage3", "offload=cpu", "precision=bf16_pure")).cfg
    written = json.loads(json.dumps(ds_config.build(cfg, 2)))
    assert written["bf16"] == {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    assert "bf16_master_weights_and_grads" not in ds_config.build(checks.check(make_cfg()).cfg, 1)["bf16"]


@pytest.mark.parametrize(("overrides", "key", "fix"), [
    (["zero=ddp"], "precision=bf16_pure", "zero=stage1"),
    (["zero=stage0"], "precision=bf16_pure", "precision=bf16"),
    (["zero=stage2", "offload=cpu", "optimizer=lion"], "optimizer.name=lion", "optimizer=adamw"),
    (["zero=stage3", "offload=nvme"], "offload=nvme", "offload=cpu"),
])
def test_bf16_pure_where_it_does_not_exist_gets_the_one_screen_message(overrides: list[str], key: str,
                                                                       fix: str) -> None:
    report = checks.check(make_cfg("precision=bf16_pure", *overrides))
    text = report.render()
    assert not report.ok and f"- {key}\n" in text and fix in text, text


def test_the_planner_counts_bf16_pure_model_states_at_their_bytes() -> None:
    p, layer, n = 1_000_000, 10_000, 4
    for zero in ("stage1", "stage2", "stage3"):
        _, grads, optimizer, _ = plan.model_states(zero, "none", p, layer, n, True, "bf16")
        _, pure_grads, pure_optimizer, _ = plan.model_states(zero, "none", p, layer, n, True, "bf16_pure")
        assert pure_optimizer * 2 == optimizer == 12 * p // n  # bf16 masters + moments: 6 bytes, not 12
        assert pure_grads < grads
    # ZeRO-2 on one rank: 2 (weights) + 2 (gradients) + 6 (masters, moments) = 10 bytes a parameter, not 20.
    assert sum(plan.model_states("stage2", "none", p, layer, 1, True, "bf16_pure")[:3]) == 10 * p
    # FSDP: bf16 shards are the masters: 2 + 2 + 4 = 8 bytes a parameter over the ranks, not 16.
    sharded = plan.model_states("fsdp_full_shard", "none", p, layer, n, True, "bf16_pure")
    full = plan.model_states("fsdp_full_shard", "none", p, layer, n, True, "bf16")
    gathered = 2 * 2 * layer
    assert sum(sharded[:3]) - gathered == 8 * p // n and sum(full[:3]) - gathered == 16 * p // n
