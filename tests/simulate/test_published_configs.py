"""The published configs ``cpvlm plan`` offers, built on the meta device against counts by hand
and the checkpoints' published totals (no weights, nothing downloaded)."""

import torch

from cpvlm.hf import adapter_for
from cpvlm.simulate.configs import load_config
from cpvlm.simulate.depth import meta_model


def test_qwen3_5_122b_a10b_against_its_published_dimensions():
    config = load_config("qwen3.5-122b-a10b")
    text = config.text_config
    assert adapter_for(config).family == "qwen3_5_moe"
    kinds = list(text.layer_types)
    assert len(kinds) == 48 and kinds[3::4] == ["full_attention"] * 12
    assert kinds.count("linear_attention") == 36
    assert config.vision_config.out_hidden_size == text.hidden_size == 3072

    model = meta_model(config, torch.float32)
    assert all(p.is_meta for p in model.parameters())
    params = {n: p.numel() for n, p in model.named_parameters()}
    experts = sum(v for n, v in params.items() if ".mlp.experts." in n)
    # 48 layers x 256 experts x (gate, up, down) of 3072 x 1024, by hand
    assert experts == 48 * 256 * 3 * 3072 * 1024
    language = sum(v for n, v in params.items() if "visual" not in n)
    active = language - experts + experts * text.num_experts_per_tok // text.num_experts
    # the model card's totals: 122 B parameters (the language model), 10 B active a token
    assert round(language / 1e9) == 122
    assert round(active / 1e9) == 10
