"""Training data: records -> planned samples -> packed rows -> this rank's pixels.

Model-agnostic (no ``transformers`` import): a model's processor plugs in as the ``plan`` and
``decode`` callables (``cpvlm.hf.data.processor`` for Hugging Face checkpoints). Read in
this order: sources.py (where records come from; record.py, one record), sample.py (a planned
sample), media.py (image headers and decoding), order.py and packing.py (which sample when, rows,
DP split), balance.py (the deal by cost), rows.py (the global row stream), loader.py (this rank's
rows, decoding in DataLoader workers), exchange.py (planning split over DP), errors.py.
"""

from cpvlm.data.audio import AudioRef, load_audio
from cpvlm.data.balance import RowCost, deal_bound, dp_deal, plan_split
from cpvlm.data.errors import ERRORS_FILE, REASONS, DataError, ErrorLog
from cpvlm.data.exchange import DPExchange
from cpvlm.data.loader import (
    DECODE_MODES,
    LoaderConfig,
    LocalRow,
    RankLoader,
    RowJob,
    decode_row,
    patch_balanced,
)
from cpvlm.data.order import SampleOrder
from cpvlm.data.packing import dp_split, pack_window
from cpvlm.data.record import Record
from cpvlm.data.rows import PackedPlan, RowSlot, RowStream
from cpvlm.data.sample import (
    AudioItem,
    LazyPixels,
    SamplePlan,
    TokenIds,
    VisionItem,
    check_tokens,
    plan_tokenized,
)
from cpvlm.data.sources import open_source, parse_data_args, source_kind

__all__ = [
    "DECODE_MODES",
    "AudioItem",
    "AudioRef",
    "ERRORS_FILE",
    "REASONS",
    "DPExchange",
    "DataError",
    "ErrorLog",
    "LazyPixels",
    "LocalRow",
    "PackedPlan",
    "LoaderConfig",
    "RankLoader",
    "Record",
    "RowCost",
    "RowJob",
    "RowSlot",
    "RowStream",
    "SampleOrder",
    "SamplePlan",
    "TokenIds",
    "VisionItem",
    "check_tokens",
    "deal_bound",
    "decode_row",
    "dp_deal",
    "dp_split",
    "load_audio",
    "open_source",
    "pack_window",
    "parse_data_args",
    "patch_balanced",
    "plan_split",
    "plan_tokenized",
    "source_kind",
]
