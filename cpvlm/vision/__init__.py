"""Vision data parallelism over CP ranks: each unit encoded once, rows moved where needed.

Read in this order: units.py (images and frames), cost.py (what encoding a unit costs),
assign.py (who encodes what), gather.py (all-gather, backward reduce-scatter), route.py (rows to
position owners, backward transposed), parallel.py (EncoderDataParallel, the wrapper that puts
them together); for units larger than a rank's share, split_assign.py (which units are sharded,
where the cuts go) and split.py (the tower sequence-parallel on their patches).
"""

from cpvlm.vision.assign import assign_vision_units, contiguous_assignment
from cpvlm.vision.cost import VisionCost
from cpvlm.vision.gather import gather_vision_embeddings
from cpvlm.vision.parallel import EncoderDataParallel, VisionDataParallel
from cpvlm.vision.route import RoutePlan, route_plan, route_to_owners
from cpvlm.vision.split import SplitAttention, UnitOrder
from cpvlm.vision.split_assign import SplitAssignment, split_assignment
from cpvlm.vision.units import KINDS, VisionUnits, vision_units

__all__ = [
    "KINDS",
    "RoutePlan",
    "SplitAssignment",
    "SplitAttention",
    "UnitOrder",
    "VisionCost",
    "EncoderDataParallel",
    "VisionDataParallel",
    "VisionUnits",
    "assign_vision_units",
    "contiguous_assignment",
    "gather_vision_embeddings",
    "route_plan",
    "route_to_owners",
    "split_assignment",
    "vision_units",
]
