"""cpvlm's shared constants, defined once: the label that is not learned and the mode names.

Plain values (the library, the trainer's flags and ``cpvlm verify`` share them), so that flag
parsing and config validation name the choices without building anything.
"""

IGNORE_INDEX = -100
"""Label value that takes no part in the loss (padding, prompt and image tokens, document ends)."""

ATTN_IMPLS = ("ring", "allgather", "ulysses", "hybrid", "auto")
"""CP attention implementations (``cp_attention(impl=...)``, ``--attn``); "hybrid" also takes a
Ulysses size, "auto" picks one of the others by a cost model (``cpvlm.attention.cost``)."""

LAYOUTS = ("head_tail", "balanced")
"""How ``ShardPlan`` places documents on the CP ranks (``ShardPlan(layout=...)``, ``--layout``):
head-tail chunks of every document, or long documents head-tail and short ones whole, balanced."""

VISION_MODES = ("route", "allgather", "split", "replicate")
"""How the CP ranks of a replica share the vision tower (``CPOptions(vision=...)``,
``--vision``); the first three are ``EncoderDataParallel`` modes, "replicate" encodes everything on
every rank (the baseline)."""

VISION_DP_MODES = ("route", "allgather", "split")
"""``EncoderDataParallel(mode=...)``: each unit encoded once, rows routed to owners or all-gathered;
or, "split", units too large for a rank's share sharded across ranks, rows routed."""

FLOWS = ("scalable", "compat")
"""``CPOptions(flow=...)``: no full-length tensor on any rank, or the full
``inputs_embeds`` built and then sharded (the compatibility flow)."""

DTYPES = ("float32", "float64", "bfloat16")
"""Model and compute dtypes of the commands (``--dtype``), as ``torch`` names them."""

DATA_PARALLEL = ("fsdp", "hsdp", "ddp", "none")
"""``parallelize(data_parallel=...)``: how gradients are synchronised over the DP (x CP) ranks;
``cpvlm train --data-parallel`` offers all but "hsdp" (its mesh has no replicate dimension)."""

TRAIN_ON = ("assistant", "all")
"""Which text of a conversation carries labels (``--train-on``): the assistant turns, or all."""

DECODE_MODES = ("local", "all")
"""Which images and frames a rank decodes (``--decode``): only the units it encodes, or all."""

DP_BALANCE = ("tokens", "cost")
"""How a step's rows are dealt to DP ranks (``--dp-balance``): by tokens, or by modelled cost."""
