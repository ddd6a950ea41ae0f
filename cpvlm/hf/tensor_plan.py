"""A model's tensor-parallel plan under CP: where it comes from, the sizes TP must divide, and
applying it to the decoder layers (``cpvlm.parallelize.tensor_parallel`` does the splitting).

The plan is the family adapter's ``tp_plan`` when its class declares one itself (not inherited: a
subclass family, MoE or with linear-attention layers, has other layers), a ``base_model_tp_plan``
of cpvlm's own for a text config whose plan does not split its layers (transformers 5.25's
Qwen3-VL plans only its embedding); else the text config's ``base_model_tp_plan``.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from cpvlm.hf.registry import adapter_for
from cpvlm.parallelize.tensor_parallel import (
    check_tp_sizes,
    decoder_layer_plan,
    parallelize_decoder_layers,
)


def tp_plan(model_or_config) -> dict[str, str]:
    """The ``base_model_tp_plan`` TP follows: the family's own, else the text config's."""
    adapter = adapter_for(model_or_config)
    own = vars(type(adapter)).get("tp_plan")
    return dict(
        own if own is not None else adapter.config.get_text_config().base_model_tp_plan or {}
    )


def check_tp(tp: int, model_or_config, where: str = "tp") -> None:
    """``tp`` can split the model: its plan splits the decoder layers, and ``tp`` divides the
    attention heads, key-value heads and MLP width. Raises ``ValueError`` naming ``where``."""
    if tp == 1:
        return
    try:
        decoder_layer_plan(tp_plan(model_or_config))
    except ValueError as err:
        raise ValueError(f"{where} = {tp}: {err}") from None
    text = adapter_for(model_or_config).config.get_text_config()
    if any(getattr(text, k, None) for k in ("num_experts", "n_routed_experts")):
        raise ValueError(
            f"{where} = {tp}: tensor parallelism of MoE layers is not supported (their experts "
            "would stay whole and their plan is not checked under CP); use tp 1, and --ep for "
            "the experts"
        )
    check_tp_sizes(
        tp,
        where,
        num_attention_heads=text.num_attention_heads,
        num_key_value_heads=text.num_key_value_heads,
        intermediate_size=text.intermediate_size,
    )


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> list[nn.Module]:
    """Split ``model``'s decoder layers over ``tp_mesh`` by its plan (in place, before any data
    parallelism); returns the modules whose gradients ``sync_tp_gradients`` sums over TP."""
    check_tp(tp_mesh.size(), model)
    text = model.config.get_text_config()
    return parallelize_decoder_layers(
        adapter_for(model).decoder_layers(model),
        tp_plan(model),
        tp_mesh,
        num_heads=text.num_attention_heads,
        num_kv_heads=text.num_key_value_heads,
    )
