"""LoRA in kohya's layout (sd-scripts' networks/lora.py, lora_sd3.py, lora_flux.py), which ComfyUI, Forge and kohya's
tools load: `<prefix><module with . as _>.lora_down.weight` [rank, in], `.lora_up.weight` [out, rank] and `.alpha`
(a 0-dim tensor; the weight moves by alpha / rank * up @ down). The module is the maker's: SDXL's UNet in Stability's
SGM names (`lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q`), SD3's MMDiT and Flux's transformer in
theirs (`lora_unet_joint_blocks_0_x_block_attn_qkv`, `lora_unet_double_blocks_0_img_attn_qkv`: the fused qkv,
block-diagonal over diffusers' to_q/to_k/to_v), the text encoders in transformers' names (`lora_te1_`: CLIP ViT-L,
`lora_te2_`: OpenCLIP bigG). Qwen-Image's transformer keeps diffusers' module names (musubi-tuner's layout,
`lora_unet_transformer_blocks_0_attn_to_q`)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ds_trainer.train.layouts import table

PREFIX = {"unet": "lora_unet_", "transformer": "lora_unet_", "text_encoder": "lora_te1_",
          "text_encoder_2": "lora_te2_"}
DOWN, UP, ALPHA = ".lora_down.weight", ".lora_up.weight", ".alpha"


def same_names(shapes: Mapping[str, tuple[int, ...]]) -> list[table.Part]:
    """A component whose makers keep diffusers' or transformers' module names (the text encoders, Qwen-Image's
    transformer in musubi-tuner's layout): each weight as it is."""
    return [table.Part(k, (k,)) for k in shapes]


def name(component: str, module: str) -> str:
    return PREFIX[component] + module.replace(".", "_")


def write(component: str, table_parts: list[table.Part],
          adapters: Mapping[str, tuple[torch.Tensor, torch.Tensor, float]],
          shapes: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """The kohya tensors of one component's LoRA ({diffusers module: (A, B, alpha)})."""
    out: dict[str, torch.Tensor] = {}
    for lora in table.lora(table_parts, adapters, {k: v[0] for k, v in shapes.items()}):
        key = name(component, lora.module)
        out[key + DOWN], out[key + UP] = lora.down, lora.up
        out[key + ALPHA] = torch.tensor(float(lora.alpha))
    return out


def read(component: str, table_parts: list[table.Part], state: Mapping[str, torch.Tensor],
         shapes: Mapping[str, tuple[int, ...]], adapted: set[str], rank: int,
         alpha: float) -> tuple[dict[str, torch.Tensor], list[str]]:
    """One component's LoRA of a kohya file as peft tensors (`<module>.lora_A.weight`, `.lora_B.weight`) of the
    `adapted` diffusers modules, for adapters of `rank` and `alpha`; and what of the file does not fit. The file's
    scale (its alpha over its rank) is folded into B. A fused module (qkv) splits exactly where its rank is `rank`
    for each adapted module, block-diagonal (as written here, or by sd-scripts' split_qkv), or `rank` in all (the
    down matrix shared); the rows of a module not adapted must be zero."""
    by_name = {name(component, p.module): p for p in table_parts}
    out: dict[str, torch.Tensor] = {}
    problems: list[str] = []
    heads = sorted({k[:-len(DOWN)] for k in state if k.startswith(PREFIX[component]) and k.endswith(DOWN)})
    for head in heads:
        part = by_name.get(head)
        if part is None or not part.key.endswith(".weight"):
            problems.append(f"{head}: this model has no such linear layer")
            continue
        down, up = state[head + DOWN].float(), state[head + UP].float()
        file_rank = down.shape[0]
        file_alpha = float(state[head + ALPHA]) if head + ALPHA in state else float(file_rank)
        if part.op == table.TRANSPOSE:
            down, up = up.T, down.T
        elif part.op == table.SWAP:
            up = table.apply(table.SWAP, up)  # its own inverse
        elif part.op == table.CONV:
            down, up = down.reshape(down.shape[:2]), up.reshape(up.shape[:2])
        modules = [s.removesuffix(".weight") for s in part.sources]
        rows = dict(zip(modules, torch.split(up, [shapes[s][0] for s in part.sources]), strict=True))
        mine = [m for m in modules if m in adapted]
        if not mine:
            problems.append(f"{head}: not adapted here (adapter.targets)")
            continue
        stray = [m for m in modules if m not in adapted and torch.count_nonzero(rows[m])]
        if stray:
            problems.append(f"{head}: moves {stray[0]}, which adapter.targets leaves out")
            continue
        if file_rank == rank * len(mine) and all(
                not torch.count_nonzero(rows[m][:, :i * rank]) and not torch.count_nonzero(rows[m][:, (i + 1) * rank:])
                for i, m in enumerate(mine)):
            pieces = {m: (down[i * rank:(i + 1) * rank], rows[m][:, i * rank:(i + 1) * rank])
                      for i, m in enumerate(mine)}
        elif file_rank == rank:
            pieces = {m: (down, rows[m]) for m in mine}
        else:
            problems.append(f"{head}: rank {file_rank}, this adapter's is {rank} (adapter.rank)")
            continue
        scale = (file_alpha / file_rank) / (alpha / rank)
        for m, (a, b) in pieces.items():
            out[f"{m}.lora_A.weight"] = a.contiguous()
            out[f"{m}.lora_B.weight"] = (b * scale).contiguous()
    return out, problems


def is_kohya(keys: object) -> bool:
    """Whether a LoRA file's tensor names are kohya's (or LyCORIS', `lycoris_` for a module a maker fuses)."""
    return any(str(k).startswith((*PREFIX.values(), "lycoris_")) for k in keys)  # type: ignore[attr-defined]
