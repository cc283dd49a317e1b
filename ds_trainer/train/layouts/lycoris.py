"""LoKr and LoHa in LyCORIS' layout, which ComfyUI, Forge and kohya's tools load: per adapted module
`<prefix><module>.lokr_w1`, `.lokr_w2` (or the factored `.lokr_w2_a`, `.lokr_w2_b`) and `.alpha`; or `.hada_w1_a`,
`.hada_w1_b`, `.hada_w2_a`, `.hada_w2_b` and `.alpha`. The module is named as kohya's LoRA names it where the maker's
module is the diffusers one renamed (SDXL's UNet, the text encoders); a module fused in the maker's layout (SD3's and
Flux's qkv) is named `lycoris_<diffusers module>`, which ComfyUI places at its rows of the fused weight.

The scales: LyCORIS (and ComfyUI) scale a LoHa's product by alpha / rank, and a LoKr's by alpha / rank only where a
factor is itself a low-rank product (else by 1); peft scales both by alpha / rank always. A LoKr of two full factors
is written with peft's scale folded into w1, and read back the other way."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ds_trainer.train.layouts import kohya, table

LOKR = ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2")
LOHA = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2")
KEYS = {"lokr": LOKR, "loha": LOHA}
ALPHA = ".alpha"


def names(component: str, table_parts: list[table.Part], modules: set[str]) -> dict[str, str]:
    """{diffusers module: its name in the file} for `modules` of `component`."""
    plain = {p.sources[0].removesuffix(".weight"): p.module for p in table_parts
             if len(p.sources) == 1 and p.op == table.RENAME and p.key.endswith(".weight")}
    return {m: kohya.name(component, plain[m]) if m in plain else "lycoris_" + m.replace(".", "_") for m in modules}


def _scale(kind: str, tensors: Mapping[str, torch.Tensor], alpha: float) -> float:
    """The factor LyCORIS' loaders put on the product of these tensors with this alpha."""
    if kind == "loha":
        return alpha / tensors["hada_w1_b"].shape[0]
    if "lokr_w2_b" in tensors:
        return alpha / tensors["lokr_w2_b"].shape[0]
    if "lokr_w1_b" in tensors:
        return alpha / tensors["lokr_w1_b"].shape[0]
    return 1.0


def _first(kind: str, tensors: Mapping[str, torch.Tensor]) -> str:
    """The tensor a scale is folded into (the product is linear in it)."""
    if kind == "loha":
        return "hada_w1_a"
    return "lokr_w1" if "lokr_w1" in tensors else "lokr_w1_a"


def write(component: str, table_parts: list[table.Part], kind: str, state: Mapping[str, torch.Tensor],
          rank: int, alpha: float) -> dict[str, torch.Tensor]:
    """One component's LoKr or LoHa (`state`: peft's tensors, `<module>.lokr_w1`, ...) as LyCORIS' tensors."""
    by_module: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        module, _, what = key.rpartition(".")
        by_module.setdefault(module, {})[what] = value
    out: dict[str, torch.Tensor] = {}
    for module, head in names(component, table_parts, set(by_module)).items():
        tensors = dict(by_module[module])
        fold = (alpha / rank) / _scale(kind, tensors, alpha)
        first = _first(kind, tensors)
        tensors[first] = tensors[first] * fold
        out.update({f"{head}.{k}": v.contiguous() for k, v in tensors.items()})
        out[head + ALPHA] = torch.tensor(float(alpha))
    return out


def read(component: str, table_parts: list[table.Part], kind: str, file: Mapping[str, torch.Tensor],
         adapted: set[str], rank: int, alpha: float) -> tuple[dict[str, torch.Tensor], list[str]]:
    """One component's LoKr or LoHa of a LyCORIS-layout file as peft's tensors for the `adapted` modules, scaled for
    adapters of `rank` and `alpha`; and what of the file does not fit them."""
    heads = {head: module for module, head in names(component, table_parts, adapted).items()}
    ours = KEYS[kind]
    found: dict[str, dict[str, torch.Tensor]] = {}
    problems: list[str] = []
    for key, value in file.items():
        head, _, what = key.rpartition(".")
        if what not in ours:  # alpha is read with its module's tensors below
            if what in (*LOKR, *LOHA):
                problems.append(f"{head}: a {what.split('_')[0]} tensor, this adapter is {kind} (adapter=)")
            continue
        if head not in heads:
            problems.append(f"{head}: not adapted here (adapter.targets)")
            continue
        found.setdefault(head, {})[what] = value.float()
    out: dict[str, torch.Tensor] = {}
    for head, tensors in found.items():
        file_alpha = float(file[head + ALPHA]) if head + ALPHA in file else alpha
        unfold = _scale(kind, tensors, file_alpha) / (alpha / rank)
        first = _first(kind, tensors)
        tensors[first] = tensors[first] * unfold
        out.update({f"{heads[head]}.{k}": v.contiguous() for k, v in tensors.items()})
    return out, sorted(set(problems))
