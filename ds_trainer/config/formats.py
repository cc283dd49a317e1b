"""The file formats a run writes, torch-free: one record each, for `adapter.formats` (the LoRA
files) and `export.formats` (a full fine-tune's model files). A record says who reads it and which
adapter methods it can hold; the config checks refuse a method a chosen format cannot write from the
record, and the run's end writes each chosen format through its writer (train/adapters/adapter.py's
`LORA_WRITERS`, train/export's `WRITERS`). Adding a format: a record here, a value of its enum in
config/schema.py, a writer, and `convert` if it can be made from an earlier run's export."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Format:
    name: str  # the value in the list
    readers: str  # who loads it (the refusals' fixes name them)
    methods: tuple[str, ...] = ()  # the adapter methods it holds (LoRA formats)
    # why it cannot hold a method, by method (a LoRA format); the fix names a format that can
    cannot: dict[str, str] = field(default_factory=dict)
    # A later run reads it back as a frozen part (a run in phases: the low-noise phase's other
    # expert, the high-noise phase's export): diffusers' from_pretrained, load_lora_adapter
    read_back: bool = False


LORA: dict[str, Format] = {
    f.name: f
    for f in (
        Format(
            "diffusers",
            "diffusers' load_lora_weights",
            methods=("lora", "dora"),
            read_back=True,
            cannot={
                m: (
                    f"diffusers' load_lora_weights loads LoRA and DoRA files only; a {m} file "
                    "is written in LyCORIS' layout (<run>/lora/kohya.safetensors), which "
                    "ComfyUI, Forge and kohya's tools load"
                )
                for m in ("lokr", "loha")
            },
        ),
        Format(
            "kohya",
            "ComfyUI, Forge, kohya's and musubi-tuner's tools",
            methods=("lora", "lokr", "loha"),
            cannot={
                "dora": (
                    "ComfyUI's and LyCORIS' DoRA (kohya's layout, dora_scale) scale each input "
                    "column of the weight, peft's each output row: no kohya-layout file makes the "
                    "weights this run trains"
                )
            },
        ),
    )
}

MODEL: dict[str, Format] = {
    f.name: f
    for f in (
        Format(
            "diffusers",
            "diffusers' from_pretrained",
            read_back=True,
        ),
        Format(
            "single_file",
            "ComfyUI, Forge, InvokeAI, diffusers' from_single_file",
        ),
    )
}


def names(values: object) -> list[str]:
    """A list of format values (enums or strings) as their names, in order, each once."""
    out: list[str] = []
    for v in values or ():  # type: ignore[attr-defined]
        name = str(getattr(v, "value", v))
        if name not in out:
            out.append(name)
    return out


def for_method(method: str) -> list[str]:
    """The LoRA formats that can hold `method`."""
    return [f.name for f in LORA.values() if method in f.methods]
