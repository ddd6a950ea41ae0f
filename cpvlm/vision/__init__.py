"""Deprecated: the old name of ``cpvlm.encoders``, kept so that user code keeps working.

The package became ``cpvlm.encoders`` when audio clips joined images and video frames as units
of encoder data parallelism; its generic names lost "vision". The old names below are the new
objects (not copies); new code imports ``cpvlm.encoders``. The old submodules
(``cpvlm.vision.units`` and so on) are gone: import them from ``cpvlm.encoders``.
"""

from cpvlm.encoders import *  # noqa: F403 (the new names too, as the old package had them)
from cpvlm.encoders import __all__ as _new_names
from cpvlm.encoders.assign import assign_units as assign_vision_units
from cpvlm.encoders.cost import EncoderCost as VisionCost
from cpvlm.encoders.gather import gather_embeddings as gather_vision_embeddings
from cpvlm.encoders.parallel import EncoderDataParallel as VisionDataParallel
from cpvlm.encoders.units import EncoderUnits as VisionUnits

__all__ = [
    *_new_names,
    "VisionCost",
    "VisionDataParallel",
    "VisionUnits",
    "assign_vision_units",
    "gather_vision_embeddings",
]
