"""Vision data parallelism over CP ranks: each unit encoded once, rows moved where needed.

Read in this order: units.py (images and frames), cost.py (what encoding a unit costs),
assign.py (who encodes what), gather.py (all-gather, backward reduce-scatter), route.py (rows to
position owners, backward transposed), parallel.py (VisionDataParallel, the wrapper that puts
them together).
"""

from cpvlm.vision.assign import assign_vision_units, contiguous_assignment
from cpvlm.vision.cost import VisionCost
from cpvlm.vision.gather import gather_vision_embeddings
from cpvlm.vision.parallel import VisionDataParallel
from cpvlm.vision.route import RoutePlan, route_plan, route_to_owners
from cpvlm.vision.units import VisionUnits, vision_units

__all__ = [
    "RoutePlan",
    "VisionCost",
    "VisionDataParallel",
    "VisionUnits",
    "assign_vision_units",
    "contiguous_assignment",
    "gather_vision_embeddings",
    "route_plan",
    "route_to_owners",
    "vision_units",
]
