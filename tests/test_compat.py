"""cpvlm.distributed.compat: every feature-detected branch, on both ends of the torch window.

torch 2.11/2.12 have only all_gather_into_tensor / reduce_scatter_tensor; 2.13+ add the *_single
names. ``legacy_collectives()`` forces the older branch on the installed torch, so both are checked
on gloo whatever torch CI runs; the expected values are written out from the rank formula. The
other detections (the collective names, DCP's async save result, the process-group registry,
PR_SET_PDEATHSIG, the head-tail balancer, the flash probe, the kernels' lse layouts) run for real
on this torch and are simulated the other way (the feature patched away or in), so the suite on
the oldest torch (tools/torch_lane.sh) and on the newest covers both.
"""

import signal
import sys
import warnings

import pytest
import torch
import torch.distributed as dist

from cpvlm.distributed import compat, differentiable_all_gather_dim0
from cpvlm.distributed.collectives import all_gather_dim0, reduce_scatter_dim0
from cpvlm.testing import run_distributed


def _rank_rows(rank, dtype):
    return (torch.arange(6, dtype=torch.float64).view(3, 2) + 10 * rank).to(dtype)


def _collectives(rank, world_size, legacy, dtype):
    def run():
        gathered = all_gather_dim0(_rank_rows(rank, dtype), dist.group.WORLD)
        flags = all_gather_dim0(torch.tensor([rank % 2 == 0]), dist.group.WORLD)
        reduced = reduce_scatter_dim0(
            torch.arange(2.0 * world_size, dtype=torch.float64).view(world_size, 2) * (rank + 1),
            dist.group.WORLD,
        )
        x = _rank_rows(rank, torch.float64).requires_grad_()
        (differentiable_all_gather_dim0(x, dist.group.WORLD) * (rank + 1)).sum().backward()
        return gathered, flags, reduced, x.grad, compat.uses_single_collectives()

    if legacy:
        with compat.legacy_collectives():
            return run()
    return run()


@pytest.mark.parametrize("legacy", [False, True], ids=["single", "legacy"])
@pytest.mark.parametrize("world_size", [1, 3])
def test_both_collective_branches_give_the_rank_formula(world_size, legacy):
    w = world_size
    for dtype in (torch.float64, torch.bfloat16):
        results = run_distributed(_collectives, w, legacy, dtype, timeout=60)
        for rank, (gathered, flags, reduced, grad, single) in enumerate(results):
            expected = torch.cat([_rank_rows(r, dtype) for r in range(w)])
            assert gathered.dtype == dtype and torch.equal(gathered, expected)
            assert flags.dtype == torch.bool and flags.tolist() == [r % 2 == 0 for r in range(w)]
            # sum over ranks of (r+1) * row = w(w+1)/2 * row; this rank keeps row `rank`.
            row = torch.arange(2.0 * w, dtype=torch.float64).view(w, 2)[rank]
            assert torch.equal(reduced, row.view(1, 2) * (w * (w + 1) // 2))
            # every rank r weighs the gathered copy by r+1: the gradient is sum_r (r+1).
            assert torch.equal(grad, torch.full((3, 2), w * (w + 1) / 2, dtype=torch.float64))
            assert single == (not legacy and hasattr(dist, "all_gather_single"))


# ---- every feature-detected branch, both ends on whichever torch runs the suite -----------------
# The branch this torch takes runs for real; the other is simulated by taking the feature away
# (monkeypatch.delattr, an import that fails) or putting it in (a stand-in with the semantics of
# one rank), and the wrapper's behaviour is checked on both.


def _one_rank_gather(out, x, group=None):
    out.copy_(x)


@pytest.mark.parametrize("single", [True, False], ids=["single-present", "single-absent"])
def test_the_collective_names_are_chosen_by_what_dist_has(monkeypatch, single):
    calls = []

    def recorded(name):
        def fn(out, x, group=None):
            calls.append((name, group))
            warnings.warn(f"{name} is deprecated", FutureWarning, stacklevel=2)
            out.copy_(x[: out.shape[0]] if name.startswith("reduce") else x)

        return fn

    for new, old in compat.collectives._COLLECTIVES.values():
        monkeypatch.setattr(dist, old, recorded(old))
        if single:
            monkeypatch.setattr(dist, new, recorded(new), raising=False)
        else:
            monkeypatch.delattr(dist, new, raising=False)
    assert compat.uses_single_collectives() is single
    x = torch.arange(6.0).view(3, 2)
    out = torch.empty(3, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the old names' FutureWarning is swallowed, no other
        compat.all_gather_tensor(out, x, "group")
        assert torch.equal(out, x)
        compat.reduce_scatter_tensor(out[:1], x, "group")
        assert torch.equal(out[0], x[0])
        with compat.legacy_collectives():  # forces the old names where the new ones exist
            assert not compat.uses_single_collectives()
            compat.all_gather_tensor(out, x, "group")
        assert compat.uses_single_collectives() is single
    if single:
        want = ["all_gather_single", "reduce_scatter_single", "all_gather_into_tensor"]
    else:
        want = ["all_gather_into_tensor", "reduce_scatter_tensor", "all_gather_into_tensor"]
    assert calls == [(name, "group") for name in want]


def test_a_warning_other_than_the_deprecation_still_reaches_the_caller(monkeypatch):
    def noisy(out, x, group=None):
        warnings.warn("something else", UserWarning, stacklevel=2)
        _one_rank_gather(out, x)

    monkeypatch.delattr(dist, "all_gather_single", raising=False)
    monkeypatch.setattr(dist, "all_gather_into_tensor", noisy)
    with pytest.warns(UserWarning, match="something else"):
        compat.all_gather_tensor(torch.empty(2), torch.ones(2), None)


def test_async_save_waits_for_staging_and_returns_the_upload(monkeypatch, tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    # This torch's real async save (no process group: one process), whatever it returns.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is ... uninitialized"
        future = compat.async_save({"x": torch.arange(10.0)}, FileSystemWriter(tmp_path), None)
        future.result(timeout=60)
    assert compat.dcp_file_extents(tmp_path) == {
        name: (tmp_path / name).stat().st_size for name in compat.dcp_file_extents(tmp_path)
    }
    assert sum(compat.dcp_file_extents(tmp_path).values()) >= 10 * 4

    # A torch whose async_save returns an AsyncSaveResponse (a background stager): staging is
    # awaited before the call returns, the upload future is what the caller gets.
    from concurrent.futures import Future

    events = []

    class Staging(Future):
        def result(self, timeout=None):
            events.append("staged")
            return None

    upload = Future()
    response = type("AsyncSaveResponse", (), {"staging_completion": Staging(),
                                              "upload_completion": upload})()  # fmt: skip
    monkeypatch.setattr(dcp, "async_save", lambda *a, **k: events.append("save") or response)
    assert compat.async_save({}, None, None) is upload
    assert events == ["save", "staged"]
    # A torch whose async_save returns the Future itself: it is returned as it is.
    plain = Future()
    monkeypatch.setattr(dcp, "async_save", lambda *a, **k: plain)
    assert compat.async_save({}, None, None) is plain


def test_checkpoint_failures_name_the_first_rank_or_the_error_itself():
    from torch.distributed.checkpoint.api import CheckpointException

    assert CheckpointException in compat.checkpoint_error_types()
    err = CheckpointException("save failed", {2: (OSError("disk full"), None), 1: (
        ValueError("bad shard"), None)})  # fmt: skip
    assert isinstance(err, compat.checkpoint_error_types())
    assert compat.checkpoint_failure(err) == "rank 1: ValueError: bad shard"
    assert compat.checkpoint_failure(OSError("no space")) == "OSError: no space"


def test_the_process_group_count_or_none_without_the_private_registry(monkeypatch):
    from torch.distributed import distributed_c10d

    count = compat.process_group_count()
    assert count == len(distributed_c10d._world.pg_map)  # this torch has the registry
    fake_world = type("World", (), {"pg_map": {"a": 1, "b": 2}})()
    monkeypatch.setattr(distributed_c10d, "_world", fake_world)
    assert compat.process_group_count() == 2
    monkeypatch.delattr(type(fake_world), "pg_map")
    assert compat.process_group_count() is None
    monkeypatch.delattr(distributed_c10d, "_world")
    assert compat.process_group_count() is None


def _pdeathsig_in_a_child(set_it) -> int:
    """PR_GET_PDEATHSIG of a forked child after ``set_it()`` there (its exit status)."""
    import ctypes
    import os

    pid = os.fork()
    if pid == 0:  # the child: nothing but prctl, then out
        code = 255
        try:
            set_it()
            sig = ctypes.c_int(-1)
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(2, ctypes.byref(sig), 0, 0, 0) == 0:  # PR_GET_PDEATHSIG
                code = sig.value
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_die_with_parent_sets_sigkill_where_torch_has_the_helper(monkeypatch):
    import torch.multiprocessing as tmp

    assert _pdeathsig_in_a_child(lambda: None) == 0
    if hasattr(tmp, "_prctl_pr_set_pdeathsig"):  # this torch's helper, for real
        assert _pdeathsig_in_a_child(compat.die_with_parent) == signal.SIGKILL
    calls = []
    monkeypatch.setattr(tmp, "_prctl_pr_set_pdeathsig", calls.append, raising=False)
    compat.die_with_parent()
    assert calls == [signal.SIGKILL]
    monkeypatch.delattr(tmp, "_prctl_pr_set_pdeathsig")  # a torch without it: nothing happens
    assert compat.die_with_parent() is None
    assert _pdeathsig_in_a_child(compat.die_with_parent) == 0


def test_torch_head_tail_indices_or_none_without_the_balancer(monkeypatch):
    # Eight positions on two ranks, four chunks: rank 0 holds chunks 0 and 3, rank 1 chunks 1, 2.
    got = compat.torch_head_tail_indices(8, 2)
    assert got.tolist() == [[0, 1, 6, 7], [2, 3, 4, 5]]
    name = "torch.distributed.tensor.experimental._context_parallel._load_balancer"
    monkeypatch.setitem(sys.modules, name, None)  # the import fails: ImportError
    assert compat.torch_head_tail_indices(8, 2) is None


@pytest.mark.parametrize("has_probe", [True, False], ids=["probe-present", "probe-absent"])
def test_flash_is_assumed_built_where_torch_cannot_say(monkeypatch, has_probe):
    from torch._subclasses.fake_tensor import FakeTensorMode

    from cpvlm.distributed.compat import cuda_kernels

    monkeypatch.setattr(cuda_kernels, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    if has_probe:
        monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: False)
    else:
        monkeypatch.delattr(torch.backends.cuda, "is_flash_attention_available", raising=False)
    with FakeTensorMode():
        q = torch.empty(1, 4, 8, 128, device="cuda", dtype=torch.bfloat16)
        kernel = compat.cuda_fused_kernel(q)
    assert kernel is (compat.CUDA_EFFICIENT if has_probe else compat.CUDA_FLASH)


@pytest.mark.parametrize("name", ["flash", "efficient"])
@pytest.mark.parametrize(
    "layout", ["installed", "dense-padded", "packed-per-sequence", "unpadded-rows"]
)
def test_the_lse_conversions_follow_whatever_layout_the_meta_kernel_reports(
    monkeypatch, name, layout
):
    from cpvlm.distributed.compat import cuda_kernels

    real = cuda_kernels._kernel_lse_shape
    fakes = {  # layouts a torch could report (from its meta kernel) for one sequence of max_q
        "dense-padded": lambda n, packed, m: (1, 1, -(-m // 32) * 32) if not packed else real(
            n, packed, m),
        "packed-per-sequence": lambda n, packed, m: (1, 1, -(-m // 32) * 32) if packed else real(
            n, packed, m),
        "unpadded-rows": lambda n, packed, m: (1, m) if packed else (1, 1, m),
    }  # fmt: skip
    if layout != "installed":
        monkeypatch.setattr(cuda_kernels, "_kernel_lse_shape", fakes[layout])
    q = torch.empty(7, 3, 8)  # packed: sequences of 4 and 3 rows, 3 heads
    packing = compat.Packing(torch.tensor([0, 4, 7], dtype=torch.int32), None, 4, 4)
    lse = torch.randn(3, 7)
    kernel_lse = cuda_kernels._lse_to_kernel(name, lse, q, packing)
    width = cuda_kernels._kernel_lse_shape(name, True, 4)
    assert kernel_lse.shape == ((3, 7) if len(width) == 2 else (2, 3, width[-1]))
    assert torch.equal(cuda_kernels._lse_from_kernel(kernel_lse, q, packing), lse)
    q = torch.empty(2, 5, 3, 8)  # dense
    lse = torch.randn(2, 3, 5)
    kernel_lse = cuda_kernels._lse_to_kernel(name, lse, q, None)
    assert kernel_lse.shape == (2, 3, cuda_kernels._kernel_lse_shape(name, False, 5)[-1])
    assert torch.equal(kernel_lse[..., :5], lse) and not kernel_lse[..., 5:].any()
    assert torch.equal(cuda_kernels._lse_from_kernel(kernel_lse, q, None), lse)
