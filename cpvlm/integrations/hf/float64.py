"""transformers' own functions with their float32 casts read as float64, for float64 references.

A float64 exactness test at 1e-10 needs a reference that does its sums in float64. Where
transformers casts to float32 inside a float64 model (docs/hf_internals.md), these give the same
code line for line in float64, so that a check still compares with transformers' algorithm and
not with a rewrite of it. Adapters' ``float64_islands`` use them (Qwen3.5's delta rule, decay and
RMSNorm); nothing in a training step does.
"""

from __future__ import annotations

import inspect
import sys
import textwrap

CASTS = {"torch.float32": "torch.float64", ".float()": ".double()"}
"""Source text of a float32 cast -> its float64 reading."""


def float64_twin(fn, **names):
    """``fn`` (a transformers function or method) with every float32 cast of its source
    (``CASTS``) read as float64, compiled in its own module's namespace, with ``names`` bound
    there in place of the module's (the module itself is untouched). Fails if there is no float32
    cast left to replace, or a name it does not use (the test then needs updating)."""
    fn = inspect.unwrap(fn)
    lines = textwrap.dedent(inspect.getsource(fn)).splitlines()
    while lines[0].startswith("@"):
        lines.pop(0)  # decorators: hub kernels, deprecated keywords, accelerate hooks
    source = "\n".join(lines)
    if not any(cast in source for cast in CASTS):
        raise AssertionError(f"{fn.__qualname__} has no float32 cast any more: update the test")
    missing = [n for n in names if n not in fn.__code__.co_names]
    if missing:
        raise AssertionError(f"{fn.__qualname__} does not call {missing} any more: update the test")
    for cast, wide in CASTS.items():
        source = source.replace(cast, wide)
    namespace = {**vars(sys.modules[fn.__module__]), **names}
    exec(source, namespace)
    return namespace[fn.__name__]
