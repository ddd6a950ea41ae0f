"""One options object: the library, ``cpvlm train`` and ``cpvlm verify`` reject the same invalid
CP options with the same message (``cpvlm.options.CPOptions``'), and share every default."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from cpvlm.options import DEFAULTS, AttentionOptions, CPOptions, problem
from cpvlm.train.command import build_parser as train_parser
from cpvlm.train.command import main as train_main
from cpvlm.train.config import ParallelConfig
from cpvlm.verify import main as verify_main

# (options, the same as flags, a fragment the message must hold), all at cp 2.
INVALID = [
    (dict(flow="compat", vision="route"), "vision='route' (--vision): flow='compat' builds"),
    (dict(flow="compat", vision="split"), "use vision='allgather' or 'replicate' with it"),
    (dict(attn="hybrid", ulysses_size=3), "pass a divisor of the CP size 2: one of [1, 2]"),
    (dict(attn="ring", ulysses_size=2), "ulysses_size=2 (--ulysses-size): applies to attn="),
    (dict(attn="zigzag"), "attn='zigzag' (--attn): must be one of ring, allgather, ulysses,"),
    (dict(layout="zigzag"), "layout='zigzag' (--layout): must be one of head_tail, balanced"),
    (dict(vision="scatter"), "vision='scatter' (--vision): must be one of route, allgather,"),
]


def _argv(fields: dict) -> list[str]:
    argv = ["--cp", "2"]
    for name, value in fields.items():
        argv += ["--" + name.replace("_", "-"), str(value)]
    return argv


def _exit(main, argv) -> int:
    try:
        return main(argv)
    except SystemExit as stop:
        return stop.code


pytestmark = pytest.mark.usefixtures("no_training_process")


def _library_messages(rank, world_size, cases):
    from cpvlm.encoders import EncoderDataParallel
    from cpvlm.hf import ContextParallelVLM, build_model

    model = build_model("qwen3-vl-tiny", seed=0)
    messages = []
    for fields in cases:
        options = None
        try:  # the options checked when built, then at the group's size by the library
            options = CPOptions(**fields)
            ContextParallelVLM(model, dist.group.WORLD, options=options)
            messages.append(None)
        except ValueError as err:
            messages.append(str(err) if options is None else f"library: {err}")
    # The split tower's cp_attention (its own impl / ulysses_size keywords): the same rules.
    tower = SimpleNamespace(unit_order=None, encode_local=None)  # the split protocol's names
    split = []
    for attn, u in ((f["attn"], f["ulysses_size"]) for f in cases if "ulysses_size" in f):
        try:
            EncoderDataParallel(tower, None, mode="split", attention=AttentionOptions(attn, u))
            split.append(None)
        except ValueError as err:
            split.append(str(err))
    return messages, split, ContextParallelVLM(model, dist.group.WORLD).options


@pytest.mark.parametrize("fields, fragment", INVALID)
def test_train_and_verify_refuse_with_the_options_message(capsys, fields, fragment):
    message = problem(cp_size=2, **fields)
    assert message is not None and fragment in message
    with pytest.raises(ValueError) as err:
        CPOptions(cp_size=2, **fields)
    assert str(err.value) == message
    argv = _argv(fields)
    assert _exit(train_main, argv) == 2
    assert message in capsys.readouterr().err
    assert _exit(verify_main, argv) == 2
    assert message in capsys.readouterr().err


def test_the_library_refuses_with_the_same_messages():
    pytest.importorskip("transformers")
    from cpvlm.testing import run_distributed

    cases = [fields for fields, _ in INVALID]
    ulysses = [f for f in cases if "ulysses_size" in f]
    assert len(ulysses) == 2
    for messages, split, defaults in run_distributed(_library_messages, 2, cases, timeout=300):
        for fields, got in zip(cases, messages, strict=True):
            # CPOptions refuses them when built, or, valid at an unknown CP size (a hybrid
            # ulysses_size), the library at its group's: the same message either way.
            where = "library: ContextParallelVLM: " if problem(**fields) is None else ""
            assert got == where + problem(cp_size=2, **fields), (fields, got)
        for fields, got in zip(ulysses, split, strict=True):
            assert got == f"EncoderDataParallel: {problem(cp_size=2, **fields)}", (fields, got)
        assert defaults == dataclasses.replace(DEFAULTS, cp_size=2)


def test_a_cp_size_below_one_gets_one_message():
    message = problem(cp_size=0)
    assert message == "cp_size=0 (--cp): must be an integer >= 1 (the ranks of the CP group)"
    with pytest.raises(ValueError, match=r"cp_size=0 \(--cp\)"):
        ParallelConfig(cp=0)


def test_every_entry_point_has_the_same_defaults():
    parallel = ParallelConfig()
    assert parallel.options == dataclasses.replace(DEFAULTS, cp_size=parallel.cp)
    train = train_parser().parse_args([])
    for name in ("attn", "vision", "flow", "layout", "ulysses_size"):
        assert getattr(train, name) == getattr(DEFAULTS, name), name
    import argparse

    import cpvlm.verify as verify

    parser = argparse.ArgumentParser()
    verify.add_arguments(parser)
    checked = parser.parse_args([])
    for name in ("vision", "flow", "layout"):  # verify checks lists; attn: every checked impl
        assert getattr(checked, name) == [getattr(DEFAULTS, name)], name
    assert checked.ulysses_size is None and DEFAULTS.ulysses_size is None
    assert checked.attn == list(verify.CHECKED_IMPLS)
    assert DEFAULTS.layout == "head_tail"  # ShardPlan's too, and the only one every family runs


def test_the_default_layout_runs_linear_attention_and_whole_documents_are_refused():
    """Why the layout default is head_tail: Qwen3.5's linear-attention layers need every document
    split head-tail; a balanced plan that keeps them split is the same plan and runs."""
    from cpvlm.attention.linear.layout import local_chunks
    from cpvlm.distributed.shard_plan import ShardPlan

    short = [9, 3, 7, 12, 5, 6, 4, 8, 10]
    whole = ShardPlan(sum(short), 2, doc_lens=short, layout="balanced")
    assert any(r >= 0 for r in whole.whole_on)
    with pytest.raises(ValueError, match=r"places documents whole .* use layout='head_tail'"):
        local_chunks(whole, 0)
    default = ShardPlan(sum(short), 2, doc_lens=short, layout=DEFAULTS.layout)
    assert len(local_chunks(default, 1)) == 2 * len(short)
    split = [37, 3, 24]
    kept = ShardPlan(sum(split), 2, doc_lens=split, layout="balanced")
    assert kept.whole_on == (-1, -1, -1)
    assert local_chunks(kept, 1) == local_chunks(ShardPlan(sum(split), 2, doc_lens=split), 1)
