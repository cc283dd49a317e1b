"""SD3's joint attention under parallel.context: diffusers' JointAttnProcessor2_0 calls torch's SDPA
itself, so its class carries no context-parallel plan; this processor is the same computation
through diffusers' attention dispatch, which runs Ulysses' all-to-all around it, and `PLAN` splits
the image's and the caption's tokens at the first block and gathers the output at `proj_out`.

Each rank holds its part of the image's tokens and of the caption's, joined as the processor joins
them; the all-to-all gives every rank the whole joined sequence (the ranks' parts one after another)
for its share of the heads. Attention is the same for any order of its keys, and each query's output
comes back to the rank and place it came from, so the split and the joined parts agree with the
unsplit computation.
"""

from __future__ import annotations

from typing import Any

import torch


class JointAttention:
    """JointAttnProcessor2_0's computation (the image's and the caption's projections, their norms,
    the joined attention, the split and output projections) with the attention through diffusers'
    dispatch, so that parallel.context's Ulysses can run it."""

    _attention_backend = None
    _parallel_config = None

    def __call__(self, attn: Any, hidden_states: torch.Tensor,
                 encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None,  # noqa: ARG002 - diffusers' signature
                 *args: Any, **kwargs: Any) -> Any:  # noqa: ARG002
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        length = hidden_states.shape[1]
        query, key, value = (_heads(attn, layer(hidden_states))
                             for layer in (attn.to_q, attn.to_k, attn.to_v))
        query, key = _normed(attn.norm_q, query), _normed(attn.norm_k, key)
        if encoder_hidden_states is not None:
            joined = [_heads(attn, layer(encoder_hidden_states))
                      for layer in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)]
            joined[0] = _normed(attn.norm_added_q, joined[0])
            joined[1] = _normed(attn.norm_added_k, joined[1])
            query, key, value = (torch.cat([a, b], dim=1)
                                 for a, b in zip((query, key, value), joined, strict=True))
        out = dispatch_attention_fn(query, key, value, backend=self._attention_backend,
                                    parallel_config=self._parallel_config)
        out = out.flatten(2, 3).to(query.dtype)
        if encoder_hidden_states is None:
            return attn.to_out[1](attn.to_out[0](out))
        image, text = out[:, :length], out[:, length:]
        if not attn.context_pre_only:
            text = attn.to_add_out(text)
        return attn.to_out[1](attn.to_out[0](image)), text


def _heads(attn: Any, projected: torch.Tensor) -> torch.Tensor:
    """(B, S, heads x dim) as dispatch takes it: (B, S, heads, dim)."""
    return projected.unflatten(-1, (attn.heads, -1))


def _normed(norm: Any, x: torch.Tensor) -> torch.Tensor:
    """A per-head norm (SD3.5's qk norms) where the layer has one."""
    return x if norm is None else norm(x)


def plan() -> dict[str, Any]:
    """Where SD3's transformer is split (the first block's image and caption tokens) and gathered
    (`proj_out`'s output), in diffusers' plan format."""
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    split = ContextParallelInput(split_dim=1, expected_dims=3, split_output=False)
    return {"transformer_blocks.0": {"hidden_states": split, "encoder_hidden_states": split},
            "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3)}


def install(model: torch.nn.Module) -> int:
    """Each joint attention layer of `model` (its blocks' `attn`, SD3.5's self-attention `attn2`)
    with JointAttention; returns how many."""
    from diffusers.models.attention_processor import JointAttnProcessor2_0

    layers = [m for m in model.modules()
              if isinstance(getattr(m, "processor", None), JointAttnProcessor2_0)]
    for layer in layers:
        layer.set_processor(JointAttention())  # type: ignore[operator]
    return len(layers)
