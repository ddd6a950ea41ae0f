"""The synthetic data source, and the check that a ``--seq-len`` fits its samples.

Samples become rows in ``cpvlm.data`` (the tokenized-sample layout is in
``cpvlm.data.sample``, packing in ``cpvlm.data.packing`` and ``cpvlm.data.rows``), whatever the
source: ``--data synthetic``, a data file or folder of conversations, or a
``pkg.module:function``.
"""

from __future__ import annotations


def load_source(spec: str, model_config, seed: int):
    """The synthetic source (``--data synthetic``)."""
    if spec != "synthetic":
        raise ValueError(f"load_source: only 'synthetic' is built here, got {spec!r}")
    from cpvlm.train.synthetic import SyntheticVLMData

    return SyntheticVLMData(model_config, seed=seed)


def check_data_fits(source, seq_len: int) -> None:
    """Reject a ``seq_len`` shorter than the source's longest sample, if the source knows it."""
    longest = getattr(source, "max_sample_len", None)
    if longest is not None and longest() > seq_len:
        raise ValueError(
            f"data.seq_len = {seq_len} (--seq-len): too short for the images: the data's longest "
            f"sample with images or videos has {longest()} tokens and cannot be split; use "
            f"--seq-len {longest()} or more"
        )
