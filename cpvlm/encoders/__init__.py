"""Encoder data parallelism over CP ranks: each unit encoded once, rows moved where needed.

A unit is what an encoder encodes independently of the rest of the batch: an image, a video
frame, an audio clip. One ``EncoderDataParallel`` serves each encoder (the vision tower, an audio
tower); nothing here is written twice per modality.

Read in this order: units.py (images, frames and clips as units), cost.py (what encoding a unit
costs), assign.py (who encodes what), gather.py (all-gather, backward reduce-scatter), route.py
(rows to position owners, backward transposed), parallel.py (EncoderDataParallel, the wrapper
that puts them together); for units larger than a rank's share (vision towers), split_assign.py
(which units are sharded, where the cuts go) and split.py (the tower sequence-parallel on their
patches). ``cpvlm.vision`` is the old name of this package, kept for user code.
"""

from cpvlm.encoders.assign import assign_units, contiguous_assignment
from cpvlm.encoders.cost import EncoderCost
from cpvlm.encoders.gather import gather_embeddings
from cpvlm.encoders.parallel import EncoderDataParallel
from cpvlm.encoders.route import RoutePlan, route_plan, route_to_owners
from cpvlm.encoders.split import SplitAttention, UnitOrder
from cpvlm.encoders.split_assign import SplitAssignment, split_assignment
from cpvlm.encoders.units import KINDS, EncoderUnits, clip_grid, vision_units

__all__ = [
    "KINDS",
    "EncoderCost",
    "EncoderDataParallel",
    "EncoderUnits",
    "RoutePlan",
    "SplitAssignment",
    "SplitAttention",
    "UnitOrder",
    "assign_units",
    "clip_grid",
    "contiguous_assignment",
    "gather_embeddings",
    "route_plan",
    "route_to_owners",
    "split_assignment",
    "vision_units",
]
