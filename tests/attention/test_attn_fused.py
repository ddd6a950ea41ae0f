"""The fused CUDA path without a GPU: lse layouts, GQA handling, and above all the packing of a
block's rectangles into one varlen call, run through compat's real calls of the aten CUDA ops,
on CPU kernels registered for those ops with the CUDA kernels' conventions and checks
(cpvlm.testing.EmulatedKernel), inside the real ring machinery (simulate_cp_attention).

Tolerance 1e-10 in float64 as in test_attn_exact: the emulated kernels do the same sums in a
different order; a wrong cu_seqlens offset, length or mapping back moves results by O(1).
"""

import warnings

import pytest
import torch
import torch.nn.functional as F
from attn_cases import case, inputs, reference, unshard

from cpvlm import ShardPlan
from cpvlm.attention import block, fused, head_split, ulysses
from cpvlm.attention.schedule import CAUSAL, MASKED, Segment, attention_schedule
from cpvlm.distributed import compat
from cpvlm.distributed.compat import cuda_kernels
from cpvlm.testing import EmulatedKernel, rel_err, simulate_cp_attention
from cpvlm.testing.attention_check import CP_TOLERANCES, cp_errors, random_inputs


def test_per_sequence_lse_and_packed_rows_convert_both_ways():
    # Three sequences of 2, 0 and 3 queries, two heads, padded to width 4 per sequence.
    cu = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    lse_NHW = torch.arange(3 * 2 * 4, dtype=torch.float32).view(3, 2, 4)
    rows = compat.lse_rows_from_sequences(lse_NHW, cu, 5)
    # Row t of the packed layout is query j of sequence i: t = 0, 1 -> (0, 0..1); 2..4 -> (2, 0..2).
    expected = torch.stack([lse_NHW[0, :, 0], lse_NHW[0, :, 1], *lse_NHW[2, :, :3].T], dim=1)
    assert torch.equal(rows, expected)
    back = compat.lse_sequences_from_rows(rows, cu, 4)
    assert torch.equal(back[0, :, :2], lse_NHW[0, :, :2]) and torch.equal(
        back[2, :, :3], lse_NHW[2, :, :3]
    )
    assert (
        back[0, :, 2:].abs().sum() == 0
        and back[1].abs().sum() == 0
        and back[2, :, 3].abs().sum() == 0
    )


@pytest.mark.parametrize("name", ["flash", "efficient"])
def test_the_kernels_lse_layouts_read_from_the_installed_torch(name):
    # torch 2.11 - 2.13: flash keeps [B, H, S] dense and [H, T] packed; the efficient kernel pads
    # each sequence's row to a multiple of 32, one row per sequence, dense and packed.
    dense = cuda_kernels._kernel_lse_shape(name, False, 40)
    packed = cuda_kernels._kernel_lse_shape(name, True, 40)
    if name == "flash":
        assert dense == (1, 1, 40) and packed == (1, 40)
    else:
        assert dense == (1, 1, 64) and packed == (1, 1, 64)
    # Whatever the layout, to-kernel then from-kernel gives the lse back.
    q = torch.empty(7, 3, 8)  # packed: 7 rows in sequences of 4 and 3, 3 heads
    packing = compat.Packing(torch.tensor([0, 4, 7], dtype=torch.int32), None, 4, 4)
    lse = torch.randn(3, 7)
    kernel_lse = cuda_kernels._lse_to_kernel(name, lse, q, packing)
    assert torch.equal(cuda_kernels._lse_from_kernel(kernel_lse, q, packing), lse)
    q = torch.empty(2, 5, 3, 8)  # dense
    lse = torch.randn(2, 3, 5)
    assert torch.equal(
        cuda_kernels._lse_from_kernel(cuda_kernels._lse_to_kernel(name, lse, q, None), q, None), lse
    )


def test_gqa_expansion_for_the_efficient_kernel_is_undone_exactly_by_its_adjoint():
    k = torch.randn(5, 2, 8, dtype=torch.float64)
    g = torch.randn(5, 6, 8, dtype=torch.float64)
    expanded = cuda_kernels._expand_heads(k, 6)
    assert torch.equal(expanded[:, 3], k[:, 1])  # query head 3 uses key head 3 // 3 = 1
    # <expand(k), g> == <k, sum_heads(g)>: the dK of the expanded call summed per key head.
    lhs = (expanded * g).sum()
    rhs = (k * cuda_kernels._sum_heads(g, 2).double()).sum()
    assert torch.allclose(lhs, rhs, rtol=1e-6)
    assert cuda_kernels._sum_heads(g, 6) is g


def test_the_efficient_kernels_mask_is_broadcast_with_an_aligned_row_stride():
    bias = torch.randn(5, 21)
    q = torch.empty(2, 5, 3, 8)
    aligned = cuda_kernels._aligned_bias(bias, q, q)
    assert aligned.shape == (2, 3, 5, 21) and torch.equal(aligned[1, 2], bias)
    assert aligned.stride(-1) == 1 and aligned.stride(-2) % 16 == 0 and aligned.stride(0) == 0


def test_no_fused_kernel_off_cuda():
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        assert compat.cuda_fused_kernel(torch.empty(1, 2, 3, 64, dtype=dtype)) is None


@pytest.mark.parametrize(
    "capability, flash_built, want",
    [
        ((9, 0), True, {"bfloat16": "flash", "float16": "flash", "float32": "efficient"}),
        ((8, 0), False, {"bfloat16": "efficient", "float16": "efficient", "float32": "efficient"}),
        ((7, 5), True, {"bfloat16": None, "float16": "efficient", "float32": "efficient"}),
        ((7, 0), True, {"bfloat16": None, "float16": "efficient", "float32": "efficient"}),
    ],
)
def test_the_kernel_of_each_dtype_and_gpu_generation(monkeypatch, capability, flash_built, want):
    # cuda_fused_kernel on fake CUDA tensors (no GPU here) with a mocked device capability.
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.setattr(cuda_kernels, "_capability", lambda device: capability)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: flash_built)
    cuda_kernels._warn_bf16_before_sm80.cache_clear()
    with FakeTensorMode():
        q = torch.empty(1, 4, 8, 128, device="cuda")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = {}
            for name in want:
                for _ in range(2):  # the warning comes once, not on every call
                    kernel = compat.cuda_fused_kernel(q.to(getattr(torch, name)))
                got[name] = kernel and kernel.name
            assert compat.cuda_fused_kernel(q.double()) is None
            odd = torch.empty(1, 4, 8, 100, device="cuda", dtype=torch.bfloat16)
            assert compat.cuda_fused_kernel(odd) is None  # head dim not a multiple of 8
    assert got == want
    bf16_warnings = [w for w in caught if "bf16 attention" in str(w.message)]
    assert len(bf16_warnings) == (want["bfloat16"] is None)
    if bf16_warnings:
        assert f"capability {capability[0]}.{capability[1]}" in str(bf16_warnings[0].message)


def test_one_call_per_block_and_kind_with_cu_seqlens_of_its_rectangles():
    plan = ShardPlan(3 * 12 + 33, 2, doc_lens=[3] * 12 + [33])
    schedule = attention_schedule(plan, True)
    segments = schedule.segments(1, 1)
    assert any(seg.kind == MASKED for seg in segments)  # the CPU grouping that is undone here
    rects = [p for seg in segments for p in (seg.parts or (seg,))]
    calls, masked = fused._calls(segments, 2, torch.device("cpu"))
    assert masked == () and len(calls) == len({r.kind for r in rects}) == 1
    call = calls[0]
    rects.sort(key=lambda r: r.q_start)
    q_lens = [r.q_stop - r.q_start for r in rects]
    k_lens = [r.k_stop - r.k_start for r in rects]
    # Batch row b's rectangle j is sequence b * R + j: the lengths twice over, B = 2.
    assert call.packing.cu_q.dtype == torch.int32
    assert call.packing.cu_q.diff().tolist() == q_lens * 2
    assert call.packing.cu_k.diff().tolist() == k_lens * 2
    assert (call.packing.max_q, call.packing.max_k) == (max(q_lens), max(k_lens))
    assert call.rows.tolist() == [i for r in rects for i in range(r.q_start, r.q_stop)]
    assert call.cols.tolist() == [i for r in rects for i in range(r.k_start, r.k_stop)]
    # One rectangle: a dense call on views, no packing.
    single = fused._calls(attention_schedule(ShardPlan(40, 2), True).segments(0, 0), 2, "cpu")
    assert single[0][0].packing is None and single[0][0].rows == slice(0, 20)


def test_causal_rectangles_that_are_not_square_are_refused():
    full = Segment(0, 4, 0, 4, CAUSAL, 10)
    wide = Segment(4, 6, 4, 9, CAUSAL, 3)
    with pytest.raises(ValueError, match="square"):
        fused._call(True, [(full, True), (wide, True)], 1, torch.device("cpu"))


def _doc_configs(cp):
    return {
        "single": [6 * cp + 1],
        "packed": [1, 2 * cp - 1, 40 * cp + 3, 24 * cp + 1],
        "tiny docs": [3] * 12 + [8 * cp],  # grouped into MASKED calls by the CPU schedule
        "pad-only rank": [max(2, cp - 1), 1],
    }


@pytest.fixture(autouse=True)
def _one_thread():
    # As in the gloo workers; these tiny calls only lose to thread hand-offs on a shared machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_emulated_varlen_kernels_inside_the_ring_match_the_float64_reference(cp):
    configs = [
        (causal, docs, (8, 2)) for causal in (True, False) for docs in _doc_configs(cp).items()
    ]
    configs += [
        (causal, ("packed", _doc_configs(cp)["packed"]), (4, 4)) for causal in (True, False)
    ]
    for i, (causal, (docs_name, docs), heads) in enumerate(configs):
        name = ("flash", "efficient")[i % 2]
        c = case(docs, "ring", causal, *heads, d=16, seed=i)
        plan, (q, k, v, g) = inputs(c, cp)
        emulated = EmulatedKernel(name)
        shards = [[plan.shard(t, r, seq_dim=2) for r in range(cp)] for t in (q, k, v, g)]
        got = simulate_cp_attention(*shards, plan=plan, causal=causal, kernel=emulated.kernel)
        _, expected = reference(c, cp)
        for j, what in enumerate(("out", "dq", "dk", "dv")):
            err = rel_err(unshard(plan, got[j]), expected[j])
            assert err <= 1e-10, f"{what} rel err {err:.2e}, {name} cp={cp} {docs_name} {c}"
        # One forward and one backward call per block (and kind: one per block here).
        schedule = attention_schedule(plan, causal)
        blocks = sum(bool(schedule.segments(r, s)) for r in range(cp) for s in range(cp))
        directions = [d for d, _, _ in emulated.calls]
        assert directions.count("forward") == directions.count("backward") == blocks
        packed = [n for _, layout, n in emulated.calls if layout == "packed"]
        if docs_name in ("packed", "tiny docs"):
            assert packed and max(packed) >= 2 * c["b"]  # several documents per call


def test_a_masked_segment_without_parts_takes_the_mask_on_the_efficient_kernel():
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 6, 9, 16, dtype=torch.float64, generator=g)
    k, v = (torch.randn(2, 2, 11, 16, dtype=torch.float64, generator=g) for _ in range(2))
    visible = torch.rand(9, 11, generator=g) < 0.4
    visible[0], visible[3] = True, False  # row 3 sees nothing
    seg = Segment(0, 9, 0, 11, MASKED, int(visible.sum()), overwrite=True, visible=visible)
    emulated = EmulatedKernel("efficient")
    out_acc = torch.zeros(2, 6, 9, 16, dtype=torch.float64)
    lse_acc = torch.full((2, 6, 9), float("-inf"), dtype=torch.float64)
    block.attend_block(q, k, v, (seg,), out_acc, lse_acc, 0.3, kernel=emulated.kernel)

    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(
        qr, kr.repeat_interleave(3, 1), vr.repeat_interleave(3, 1), attn_mask=visible, scale=0.3
    )
    ref = ref.nan_to_num(0.0)  # SDPA gives the row that sees nothing nan; cpvlm gives it 0
    dout = torch.randn_like(ref)
    ref.backward(dout)
    assert rel_err(out_acc, ref) <= 1e-12
    assert torch.all(out_acc[:, :, 3] == 0) and torch.all(lse_acc[:, :, 3] == float("-inf"))
    lse = lse_acc.masked_fill(lse_acc == float("-inf"), 0)
    dq = torch.zeros_like(q)
    dkv = torch.zeros(2, *k.shape, dtype=torch.float64)
    parts = block.attend_block_backward(
        dout, q, k, v, out_acc, lse, (seg,), dq, 0.3, kernel=emulated.kernel
    )
    block.add_key_grads(dkv, parts)
    for got, want in zip((dq, dkv[0], dkv[1]), (qr.grad, kr.grad, vr.grad)):
        assert rel_err(got, want.nan_to_num(0.0)) <= 1e-12
    assert [(d, layout) for d, layout, _ in emulated.calls] == [
        ("forward", "dense"),
        ("backward", "dense"),
    ]


def test_the_emulated_kernels_refuse_what_the_cuda_kernels_refuse_or_would_get_wrong():
    kernel = EmulatedKernel("flash").kernel
    q, k = torch.randn(6, 2, 8, dtype=torch.float64), torch.randn(6, 1, 8, dtype=torch.float64)

    def call(cu_q, cu_k, max_q=3, max_k=3, causal=False, q=q, k=k):
        packing = compat.Packing(cu_q, cu_k, max_q, max_k)
        return kernel.forward(q, k, k, causal=causal, scale=1.0, packing=packing)

    i32 = dict(dtype=torch.int32)
    ok = torch.tensor([0, 3, 6], **i32)
    call(ok, ok)
    with pytest.raises(RuntimeError, match="int32"):
        call(ok.long(), ok)
    with pytest.raises(RuntimeError, match="from 0 up to 6"):
        call(torch.tensor([0, 3, 5], **i32), ok)
    with pytest.raises(RuntimeError, match="miss a sequence"):
        call(ok, ok, max_q=2)
    with pytest.raises(RuntimeError, match="dtype torch.float32 not supported"):
        call(ok, ok, q=q.float(), k=k.float())  # flash takes fp16/bf16 only
    with pytest.raises(RuntimeError, match="contiguous last dimension"):
        call(ok, ok, q=q.transpose(0, 2).contiguous().transpose(0, 2))
    with pytest.raises(RuntimeError, match="multiple of 8"):
        call(ok, ok, q=q[..., :6], k=k[..., :6])
    # compat's own guards, before any kernel: what the flash kernel would align bottom-right.
    with pytest.raises(ValueError, match="square"):
        kernel.forward(q[None], k[None, :4], k[None, :4], causal=True, scale=1.0)
    with pytest.raises(ValueError, match="no additive mask"):
        kernel.forward(q[None], k[None], k[None], causal=False, scale=1.0, bias=torch.zeros(6, 6))

    # The efficient kernel: equal head counts (compat expands GQA for it), its lse layout.
    aten = torch.ops.aten
    q4, k4 = q[None], k[None]
    with pytest.raises(RuntimeError, match="equal head counts"):
        aten._efficient_attention_forward(q4, k4, k4, None, None, None, None, None, 0.0, 0, True)
    out, lse = aten._efficient_attention_forward(
        q4, q4, q4, None, None, None, None, None, 0.0, 0, True
    )[:2]
    assert lse.shape == (1, 2, 32) and torch.isnan(lse[..., 6:]).all()  # padding: never read
    seed, offset = cuda_kernels._unused_rng("efficient", q.device)

    def backward(lse, out=out):
        return aten._efficient_attention_backward(
            out, q4, q4, q4, None, out, None, None, 6, 6, lse, 0.0, seed, offset, 0, False
        )

    backward(lse)
    with pytest.raises(RuntimeError, match="logsumexp must be a contiguous"):
        backward(lse[..., :6])  # the [B, H, S] layout, not the kernel's padded one
    with pytest.raises(RuntimeError, match="logsumexp must be a contiguous"):
        backward(lse.transpose(1, 2).contiguous().transpose(1, 2))
    with pytest.raises(RuntimeError, match="row stride of a contiguous"):
        backward(lse, out=out.transpose(1, 2).contiguous().transpose(1, 2))
    with pytest.raises(RuntimeError, match="not correctly aligned"):
        bias = torch.zeros(1, 2, 6, 6, dtype=torch.float64)
        aten._efficient_attention_forward(q4, q4, q4, bias, None, None, None, None, 0.0, 0, True)


def test_the_emulated_flash_kernel_aligns_causal_masks_bottom_right():
    # Packed sequences of 3 queries against 5 keys: query i sees keys 0 .. i + 2 (bottom-right);
    # compat never makes such calls (fused.py refuses non-square causal rectangles), so this
    # pins the emulation to the real kernel's convention, against SDPA with an explicit mask.
    EmulatedKernel("flash")
    g = torch.Generator().manual_seed(5)
    q = torch.randn(6, 4, 8, dtype=torch.float64, generator=g)
    k, v = (torch.randn(10, 2, 8, dtype=torch.float64, generator=g) for _ in range(2))
    cu_q, cu_k = (torch.tensor(c, dtype=torch.int32) for c in ([0, 3, 6], [0, 5, 10]))
    out, lse = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, 3, 5, 0.0, True, False, scale=0.5
    )[:2]
    assert lse.shape == (4, 6)  # [H, T]
    visible = torch.ones(3, 5, dtype=torch.bool).tril(2)
    for s in range(2):
        qs, ks, vs = (t[3 * s : 3 * s + 3] if t is q else t[5 * s : 5 * s + 5] for t in (q, k, v))
        ref = F.scaled_dot_product_attention(
            qs.transpose(0, 1), ks.transpose(0, 1).repeat_interleave(2, 0),
            vs.transpose(0, 1).repeat_interleave(2, 0), attn_mask=visible, scale=0.5,
        )  # fmt: skip
        assert rel_err(out[3 * s : 3 * s + 3].transpose(0, 1), ref) <= 1e-12


def test_the_emulated_kernels_lse_layouts_are_those_of_torchs_meta_kernels():
    # Two independent statements of the layouts: torch's meta kernels and the CPU emulation.
    EmulatedKernel("flash")
    aten = torch.ops.aten
    q = torch.randn(100, 4, 64, dtype=torch.float64)
    cu = torch.tensor([0, 40, 100], dtype=torch.int32)
    for device in ("cpu", "meta"):
        qd, cud = q.to(device).to(torch.float16 if device == "meta" else q.dtype), cu.to(device)
        flash_packed = aten._flash_attention_forward(
            qd, qd, qd, cud, cud, 60, 60, 0.0, False, False
        )
        flash_dense = aten._flash_attention_forward(
            qd[None], qd[None], qd[None], None, None, 100, 100, 0.0, False, False
        )
        eff_packed = aten._efficient_attention_forward(
            qd[None], qd[None], qd[None], None, cud, cud, 60, 60, 0.0, 0, True
        )
        eff_dense = aten._efficient_attention_forward(
            qd.view(2, 50, 4, 64), qd.view(2, 50, 4, 64), qd.view(2, 50, 4, 64), None, None, None,
            None, None, 0.0, 0, True,
        )  # fmt: skip
        shapes = [tuple(r[1].shape) for r in (flash_packed, flash_dense, eff_packed, eff_dense)]
        assert shapes == [(4, 100), (1, 4, 100), (2, 4, 64), (2, 4, 64)], device
        assert flash_packed[0].shape == q.shape and eff_packed[0].shape == (1, *q.shape)


def test_the_gpu_checks_error_helper_agrees_on_cpu():
    # cpvlm.testing.attention_check is what the CUDA tests and benchmarks/gpu measure with; here
    # it runs on the CPU kernels (float32) and on the emulated varlen kernel (float64).
    docs = [1, 9, 40, 3, 30]
    plan = ShardPlan(sum(docs), 3, doc_lens=docs)
    tensors = random_inputs(plan, hq=4, hkv=2, d=16)
    errors = cp_errors(plan, *tensors, causal=True, kernel=EmulatedKernel("flash").kernel)
    assert max(errors.values()) <= 1e-10, errors
    tensors = random_inputs(plan, hq=4, hkv=2, d=16, dtype=torch.float32)
    errors = cp_errors(plan, *tensors, causal=False)
    assert max(errors.values()) <= CP_TOLERANCES[torch.float32], errors
    assert min(errors.values()) > 0  # float32 arithmetic, measured against float64


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_emulated_varlen_kernels_inside_ulysses_local_attention_match_the_float64_reference(cp):
    # After the all-to-all, member i of a Ulysses group of cp ranks holds its heads over the whole
    # padded sequence in ascending order: the full tensors, sliced by head_split. Its local
    # attention is one block with the merged plan's segments, run through the fused entry point.
    configs = [(causal, name) for causal in (True, False) for name in _doc_configs(cp)]
    for i, (causal, docs_name) in enumerate(configs):
        hq, hkv = ((6, 2), (7, 1), (12, 4))[i % 3]  # uneven head splits and split K/V heads
        docs = _doc_configs(cp)[docs_name]
        c = case(docs, "ulysses", causal, hq, hkv, d=16, seed=i, scale=0.25)
        plan, (q, k, v, g) = inputs(c, cp)
        segments = attention_schedule(plan.merge_ranks(cp), causal).segments(0, 0)
        heads = head_split(hq, hkv, cp)
        emulated = EmulatedKernel(("flash", "efficient")[i % 2])
        got = [torch.zeros_like(t) for t in (q, q, k, v)]  # out, dq, dk, dv
        for m in range(cp):
            (qa, qb), (ka, kb) = heads.q_range(m), heads.kv_range(m)
            args = (q[:, qa:qb], k[:, ka:kb], v[:, ka:kb])
            groups = heads.groups(m)
            out, lse = ulysses._local_forward(*args, segments, groups, 0.25, emulated.kernel)
            grads = ulysses._local_backward(
                g[:, qa:qb], *args, out, lse, segments, groups, 0.25, emulated.kernel
            )
            got[0][:, qa:qb], got[1][:, qa:qb] = out, grads[0]
            got[2][:, ka:kb] += grads[1]  # a K/V head split across members: both parts
            got[3][:, ka:kb] += grads[2]
        _, expected = reference(c, cp)
        for j, what in enumerate(("out", "dq", "dk", "dv")):
            err = rel_err(got[j], expected[j])
            assert err <= 1e-10, f"{what} rel err {err:.2e}, cp={cp} {docs_name} {c}"
        packed = [n for _, layout, n in emulated.calls if layout == "packed"]
        if docs_name in ("packed", "tiny docs"):
            assert packed and max(packed) >= 2 * c["b"]  # several documents per call
