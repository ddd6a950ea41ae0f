"""Module paths as data: ``module_at``, the accessors over a family's ``ModulePaths``, and the
guard against adapters that define an accessor or a removed hook (no model is built)."""

from types import SimpleNamespace

import pytest
from torch import nn

pytest.importorskip("transformers")

from cpvlm.hf.adapter import ModulePaths, VLMAdapter, module_at  # noqa: E402
from cpvlm.hf.registration import ADAPTERS  # noqa: E402
from cpvlm.hf.registry import adapter_of_family  # noqa: E402

CONFIG = SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=2))


def _tree(vision: str) -> nn.Module:
    """A model of the layout ``model.{language_model.layers, <vision>.encoder.layers,
    multi_modal_projector}``, ``lm_head``."""
    tower = nn.Module()
    tower.encoder = nn.Module()
    tower.encoder.layers = nn.ModuleList([nn.Linear(2, 2) for _ in range(3)])
    tower.merger = nn.Linear(2, 2)
    inner = nn.Module()
    inner.language_model = nn.Module()
    inner.language_model.layers = nn.ModuleList([nn.Linear(2, 2) for _ in range(2)])
    setattr(inner, vision, tower)
    inner.multi_modal_projector = nn.Linear(2, 2)
    model = nn.Module()
    model.model = inner
    model.lm_head = nn.Linear(2, 3)
    return model


def _adapter(modules: ModulePaths) -> VLMAdapter:
    return type("Paths", (VLMAdapter,), {"modules": modules})(CONFIG)


def test_module_at_follows_dotted_paths():
    model = _tree("visual")
    assert module_at(model, "") is model
    assert module_at(model, "model.language_model.layers.1") is model.model.language_model.layers[1]
    assert module_at(model, "model.get_rope_index", default=None) is None
    with pytest.raises(AttributeError, match=r"'model\.vision_tower'.*ModulePaths"):
        module_at(model, "model.vision_tower")


def test_base_layout_accessors():
    model = _tree("visual")
    adapter = _adapter(ModulePaths())
    inner = model.model
    assert adapter.text_model(model) is inner.language_model
    assert adapter.decoder_layers(model) == list(inner.language_model.layers)
    assert adapter.lm_head(model) is model.lm_head
    assert adapter.vision_tower(model) is inner.visual
    assert adapter.fsdp_units(model) == [*inner.language_model.layers, inner.visual]


def test_units_inside_and_beside_the_tower():
    """LLaVA-OneVision's units: each decoder layer, each tower layer, the projector beside it."""
    model = _tree("vision_tower")
    adapter = _adapter(adapter_of_family("llava_onevision").modules)
    inner = model.model
    assert adapter.fsdp_units(model) == [
        *inner.language_model.layers,
        *inner.vision_tower.encoder.layers,
        inner.multi_modal_projector,
    ]


@pytest.mark.parametrize("name", ["vision_tower", "fsdp_units", "rope_index", "extra_losses"])
def test_an_adapter_defining_an_accessor_or_removed_hook_is_rejected(name):
    with pytest.raises(TypeError, match=f"defines {name}.*ModulePaths"):
        type("Stale", (VLMAdapter,), {name: lambda self, model: None})


def test_every_family_declares_paths_not_methods():
    for a in ADAPTERS:
        assert isinstance(a.modules, ModulePaths), a.family
