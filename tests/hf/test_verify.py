"""`cpvlm verify` passes on the tiny model of every family and names the module group of an
injected gradient bug."""

import io
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

from hf_families import FAMILIES, cached_model  # noqa: E402

from cpvlm.encoders import assign_units, gather_embeddings, vision_units  # noqa: E402
from cpvlm.hf import ContextParallelVLM  # noqa: E402
from cpvlm.hf.context_parallel import _local_row_order  # noqa: E402
from cpvlm.options import CPOptions  # noqa: E402
from cpvlm.verify import (  # noqa: E402
    group_of,
    main,
    module_groups,
    reference,
    run_verify,
    verify_batches,
)


@pytest.mark.parametrize("name", ["qwen3-vl-tiny", "qwen2.5-vl-tiny"])
def test_verify_passes_on_tiny_models_at_cp_2_and_4(name):
    out = io.StringIO()
    assert run_verify(name, [2, 4], ["ring", "allgather"], ["route"], ["scalable"], out=out)
    text = out.getvalue()
    assert "OK: the loss and every gradient are within tolerance (float64)" in text
    assert "FAIL" not in text
    for group in (
        "vision blocks",
        "vision merger",
        "token embeddings",
        "decoder layers",
        "lm head",
    ):
        assert group in text
    assert ("deepstack mergers" in text) == (name == "qwen3-vl-tiny")


def test_verify_checks_ulysses_and_hybrid():
    out = io.StringIO()
    assert run_verify("qwen3-vl-tiny", [2], ["ulysses", "hybrid"], ["route"], ["scalable"], out=out)
    text = out.getvalue()
    assert "OK: the loss and every gradient are within tolerance (float64)" in text
    assert "hybrid 2x1" in text and "ulysses" in text
    with pytest.raises(SystemExit):  # a Ulysses size that does not divide a CP size
        main(["--cp", "2,3", "--attn", "hybrid", "--ulysses-size", "2"])


@pytest.mark.parametrize(
    "name", [f for f in FAMILIES if f not in ("qwen3-vl-tiny", "qwen2.5-vl-tiny")]
)
def test_verify_passes_on_every_other_family(name):
    out = io.StringIO()
    # GLM-4V, the family furthest from Qwen's layout, also through Ulysses (hybrid 2 x 1).
    attns = ["ring", "allgather", *(["hybrid"] if name == "glm4v-tiny" else [])]
    assert run_verify(name, [2], attns, ["route"], ["scalable"], out=out)
    text = out.getvalue()
    assert ("hybrid 2x1" in text) == (name == "glm4v-tiny")
    assert "OK: the loss and every gradient are within tolerance (float64)" in text
    labels = [label for label, _ in module_groups(cached_model(name))]
    for label in labels:
        assert label in text
    if name in ("glm4v-tiny", "glm46v-tiny"):  # the position table at float32 round-off, marked
        assert "vision position table" in labels and "* checked at 1e-06" in text
    if name == "glm4v-moe-tiny":  # its float32 router: every value at float32 round-off
        assert "tol 1e-06: the model computes a part in float32" in text
    if "moe" in name:
        assert "router" in labels and "experts" in labels


@pytest.mark.parametrize("name", FAMILIES)
def test_every_module_group_has_a_nonzero_reference_gradient(name):
    """So that a zero error in the table means equal gradients, not two zeros. The model as
    ``cpvlm verify`` runs it: its float32 islands in float64 (Gemma 4's audio attention fails
    in a float64 model without)."""
    model = cached_model(name)
    groups = module_groups(model)
    for batch, doc_lens in verify_batches(model, torch.float64).values():
        _, grads = reference(model, batch, doc_lens)
        assert all(group_of(n, groups) != "other" for n in grads)
        for label, _ in groups:
            assert any(
                g.abs().max() > 0 for n, g in grads.items() if group_of(n, groups) == label
            ), label


class _LocalSliceGather(torch.autograd.Function):
    """The public bug: an all-gather of vision rows whose backward keeps only the local slice,
    dropping what the other ranks' losses say about this rank's rows."""

    @staticmethod
    def forward(ctx, x, counts, rank, group):
        ctx.start, ctx.stop = sum(counts[:rank]), sum(counts[: rank + 1])
        with torch.no_grad():
            return gather_embeddings(x, counts, group)

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.start : ctx.stop], None, None, None


class _BuggyVisionGatherVLM(ContextParallelVLM):
    def _vision_rows(self, prep, step=None):
        visual = self.adapter.vision_tower(self.model)
        units = vision_units(prep.grid_thw, self.adapter.merge_size)
        assignment = assign_units(units.pixel_counts, self.cp_size)
        mine = assignment[self.cp_rank]
        pixels = prep.pixel_values(visual.dtype)
        out = self.encode(pixels[units.pixel_index(mine)], units.grid_thw(mine))
        rows = [out[0], *out[1]] if isinstance(out, tuple) else [out]
        counts = [sum(units.row_counts[u] for u in a) for a in assignment]
        gathered = [_LocalSliceGather.apply(t, counts, self.cp_rank, self.cp_group) for t in rows]
        back = torch.argsort(torch.cat([units.row_index(a) for a in assignment]))
        local = _local_row_order(prep, self.cp_rank)
        return [t[back][local] for t in gathered], len(mine)


def buggy_factory(model, group, attn, vision, flow, **options):
    options = CPOptions(attn=attn, vision="allgather", flow=flow, **options)
    return _BuggyVisionGatherVLM(model, group, options=options)


def test_verify_fails_and_names_the_vision_groups_on_a_local_slice_gather_backward():
    assert dist.is_available()
    out = io.StringIO()
    ok = run_verify("qwen3-vl-tiny", [2], ["ring"], ["allgather"], factory=buggy_factory, out=out)
    text = out.getvalue()
    assert not ok
    assert "FAIL vision blocks: relative error" in text
    assert "FAIL vision merger: relative error" in text
    # The loss and the text side are still right: only the vision gradients are wrong.
    assert "FAIL loss" not in text and "FAIL decoder layers" not in text
    assert "FAIL lm head" not in text and "FAIL token embeddings" not in text


def test_verify_command_exit_codes():
    ok = subprocess.run(
        [
            sys.executable,
            "-m",
            "cpvlm.verify",
            "--model",
            "qwen2.5-vl-tiny",
            "--cp",
            "2",
            "--attn",
            "ring",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "OK: the loss and every gradient are within tolerance" in ok.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "cpvlm.verify", "--model", "does/not/exist", "--cp", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode != 0 and "does/not/exist" in bad.stderr
