"""The names of before ``cpvlm.encoders`` still import, and are the new objects (not copies)."""

import cpvlm
import cpvlm.encoders as encoders
import cpvlm.vision as old

RENAMED = {
    "VisionCost": "EncoderCost",
    "VisionUnits": "EncoderUnits",
    "VisionDataParallel": "EncoderDataParallel",
    "assign_vision_units": "assign_units",
    "gather_vision_embeddings": "gather_embeddings",
}
OLD_PACKAGE = (  # the old package's ``__all__``, other than the renamed names
    "KINDS", "RoutePlan", "SplitAssignment", "SplitAttention", "UnitOrder", "EncoderDataParallel",
    "contiguous_assignment", "route_plan", "route_to_owners", "split_assignment", "vision_units",
)  # fmt: skip
OLD_TOP_LEVEL = ("VisionCost", "assign_vision_units", "gather_vision_embeddings")


def test_old_package_names_are_the_new_objects():
    for old_name, new_name in RENAMED.items():
        assert getattr(old, old_name) is getattr(encoders, new_name), old_name
    for name in OLD_PACKAGE:
        assert getattr(old, name) is getattr(encoders, name), name
    assert set(RENAMED) | set(OLD_PACKAGE) <= set(old.__all__)


def test_old_top_level_names_are_the_new_objects():
    for name in OLD_TOP_LEVEL:
        assert getattr(cpvlm, name) is getattr(encoders, RENAMED[name]), name
    from cpvlm import gather_vision_embeddings

    assert gather_vision_embeddings is encoders.gather_embeddings
    assert not hasattr(cpvlm, "no_such_name")
