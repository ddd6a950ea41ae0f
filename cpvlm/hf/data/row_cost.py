"""The modelled cost of a packed row for a transformers VLM: decoder, attention and vision.

The decoder part is read from the text config (the same fields for every family): per token,
the attention projections (q and o: Hq * hd * D each; k and v: Hkv * hd * D each), the MLP (three
matrices of D x I, gated; for a mixture of experts the experts a token runs, and a shared one),
over every layer, and the LM head (D x vocab); per attended pair, 2 * Hq * hd (q.k and the
weighted sum of v) over the layers that attend over the sequence (linear-attention layers do
not). Sliding-window layers are counted as full ones (an over-estimate for documents longer
than the window). The vision part is the family's ``EncoderCost`` (its adapter's).
"""

from __future__ import annotations

from cpvlm.data.balance import RowCost
from cpvlm.hf.vision_cost import vision_cost


def _field(config, name: str, default=None):
    try:  # some configs refuse a global value of a per-layer field
        value = getattr(config, name, default)
    except Exception:
        return default
    return default if value is None else value


def row_cost(model_config) -> RowCost:
    """``RowCost`` of a transformers VLM config (see the module docstring)."""
    text = _field(model_config, "text_config", model_config)
    d, layers = int(text.hidden_size), int(text.num_hidden_layers)
    heads = int(text.num_attention_heads)
    kv = int(_field(text, "num_key_value_heads", heads))
    hd = int(_field(text, "head_dim", d // heads))
    mlp = int(_field(text, "intermediate_size", 0))
    experts = int(_field(text, "num_experts_per_tok", 0))
    if experts:
        mlp = experts * int(_field(text, "moe_intermediate_size", mlp))
        mlp += int(_field(text, "shared_expert_intermediate_size", 0))
    types = list(_field(text, "layer_types", []) or [])
    attending = sum(t != "linear_attention" for t in types) if types else layers
    token = layers * ((2 * heads + 2 * kv) * hd * d + 3 * d * mlp)
    token += d * int(_field(text, "vocab_size", 0))
    return RowCost(token=token, pair=attending * 2 * heads * hd, vision=vision_cost(model_config))
