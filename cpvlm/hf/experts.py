"""How many experts a model's MoE layers have, from its config: what ``--ep`` must divide
(``cpvlm.parallelize.expert_parallel.check_experts``), checked by ``cpvlm train``, ``cpvlm
verify`` and the Trainer route before any rank builds a model."""

from __future__ import annotations


def num_experts(model_or_config) -> int | None:
    """The experts of each MoE layer of a model or its config (None: not a MoE model)."""
    text = getattr(model_or_config, "config", model_or_config).get_text_config()
    for key in ("num_experts", "n_routed_experts"):  # Qwen MoE; GLM-4.5V (DeepSeek's name)
        value = getattr(text, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None
