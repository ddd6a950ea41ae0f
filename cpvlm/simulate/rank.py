"""One rank of a (dp, cp) training step on fake tensors: cpvlm's own step, its bytes counted.

The model is built from its config on the meta device and made of fake tensors; the process
group is torch's fake one (every collective returns at once, its outputs as they were: every
size cpvlm communicates is computed on each rank from the replicated integers of the batch, so
the buffers have their real shapes); the batch's integers are real (``compat.HostIntegers``), so
positions, plans, schedules and vision assignments are those of the real step. Then the step
runs as ``cpvlm train`` runs it (``ContextParallelVLM``, ``parallelize`` with FSDP2 over the
dp x cp ranks, AdamW), and torch's ``MemTracker`` counts the bytes by category, with autograd's
``saved_tensors_hooks`` for the activations saved for backward.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from dataclasses import asdict, dataclass, field, replace

import torch
import torch.distributed as dist

from cpvlm.distributed import compat
from cpvlm.options import CPOptions
from cpvlm.simulate.batch import SequenceSpec, build_batch
from cpvlm.simulate.depth import meta_model, reduce_depth, shard_bytes, vision_blocks

GiB = 2**30


@dataclass(frozen=True)
class Setup:
    """How the simulated step is parallelised and computed."""

    dp: int = 1
    cp: int = 1
    attn: str = "ring"
    vision: str = "route"
    activation_checkpointing: bool = False
    loss_chunk: int | None = 1024
    data_parallel: str = "fsdp"  # or "none": no FSDP2 (what a one-process CPU run measures)
    master_dtype: torch.dtype = torch.float32  # parameters, gradients, optimizer state
    compute_dtype: torch.dtype | None = torch.bfloat16  # None: compute in master_dtype
    optimizer: bool = True  # AdamW's state counted (one optimizer step runs)
    rank: int = 0  # the CP rank simulated
    reduced_depth: bool = True  # simulate a few layers, add the rest (cpvlm.simulate.depth)
    # How the rest are added (cpvlm.simulate.depth): "add" (an upper bound on the peak) or
    # "affine" (exact on tiny configs, 12% low at Qwen3-VL-8B: the peak's phase moves, we believe)
    depth_fit: str = "add"

    def __post_init__(self):
        for name in ("dp", "cp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Setup: {name} must be an int >= 1, got {value!r}")
        if self.data_parallel not in ("fsdp", "none"):
            raise ValueError(
                f"Setup: data_parallel must be 'fsdp' or 'none', got {self.data_parallel!r}"
            )
        if self.data_parallel == "none" and self.dp > 1:
            raise ValueError("Setup: dp > 1 needs data_parallel='fsdp'")
        if self.depth_fit not in ("affine", "add"):
            raise ValueError(f"Setup: depth_fit must be 'affine' or 'add', got {self.depth_fit!r}")
        if not 0 <= self.rank < self.cp:
            raise ValueError(f"Setup: rank must be in 0..cp-1, got {self.rank} (cp={self.cp})")


@dataclass
class RankMemory:
    """Bytes of one rank's step, by category (``MemTracker``'s, and saved for backward)."""

    params: int  # this rank's parameters (FSDP2: its shard), buffers included
    grads: int  # its gradients after the backward (FSDP2: sharded)
    optimizer: int  # AdamW state
    saved: int  # bytes saved for backward when the forward ends, parameters' shards excluded
    loss_saved: int  # the part of ``saved`` the tracker attributes to the logits and loss
    saved_gathered: int  # the part that is full-size parameters FSDP2 gathered (lm_head's weight)
    peak: int  # the first step's peak of live bytes (forward, backward, optimizer step)
    peak_fwd_bwd: int  # the peak of forward + backward alone, before the optimizer state exists
    peak_opt: int = 0  # the optimizer step's peak: params, grads, state and its temporaries
    peak_by_category: dict[str, int] = field(default_factory=dict)  # live at ``peak_fwd_bwd``
    gathered: int = 0  # at ``peak_fwd_bwd``: full-size parameters FSDP2 gathered, its buffers
    loss: int = 0  # at ``peak_fwd_bwd``: the logits and loss (forward or backward)
    local_len: int = 0
    pixel_bytes: int = 0  # the batch's pixel rows (held before the step; the tower's input)
    seconds: float = 0.0  # simulation time

    @property
    def steady_peak(self) -> int:
        """The peak of a step after the first: forward + backward with the optimizer state
        already held (the first step's optimizer.step allocates it), or the optimizer step."""
        return max(self.peak_fwd_bwd + self.optimizer, self.peak_opt)

    @property
    def activations(self) -> int:
        """What the step needs beyond parameters, gradients and optimizer state."""
        return self.steady_peak - self.params - self.grads - self.optimizer

    @property
    def saved_activations(self) -> int:
        """The saved bytes less the logits/loss and gathered parameters: the model's activations
        saved for backward."""
        return self.saved - self.loss_saved - self.saved_gathered

    @property
    def peak_activations(self) -> int:
        """``activations`` less the gathered parameters and the logits/loss live at the peak
        (when the steady peak is the optimizer step's, nothing is subtracted)."""
        at_fwd_bwd = self.steady_peak == self.peak_fwd_bwd + self.optimizer
        return self.activations - (self.gathered + self.loss if at_fwd_bwd else 0)

    def as_dict(self) -> dict:
        derived = ("steady_peak", "activations", "saved_activations", "peak_activations")
        return {**asdict(self), **{name: getattr(self, name) for name in derived}}


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0):
    """A fake process group of ``world_size`` ranks, this process rank ``rank`` of it."""
    if dist.is_initialized():
        raise RuntimeError("cpvlm.simulate: a process group already exists in this process")
    compat.init_fake_process_group(world_size, rank)
    try:
        yield
    finally:
        dist.destroy_process_group()


class _Saved:
    """Bytes saved for backward, once per storage, parameters excluded; by region (the layer
    that saved it) and by the tracker's category of its storage."""

    def __init__(self, exclude: set[int], category_of):
        self.exclude = exclude
        self.category_of = category_of
        self.region = "model"
        self.storages: dict[int, tuple[weakref.ref, object, str | None]] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.layout == torch.strided:
            storage = t.untyped_storage()
            key = id(storage)
            if key not in self.exclude and key not in self.storages:
                self.storages[key] = (weakref.ref(storage), self.region, self.category_of(t))
        return t

    def bytes(self, region=None, category=None, not_category=None) -> int:
        total = 0
        for ref, where, cat in self.storages.values():
            storage = ref()
            if storage is None or region not in (None, where) or category not in (None, cat):
                continue
            if not_category is None or cat != not_category:
                total += storage.nbytes()
        return total

    def label(self, modules, name: str) -> None:
        """Saved tensors packed from the start of ``modules[i]`` on are labelled ``(name, i)``."""
        for i, module in enumerate(modules):
            module.register_forward_pre_hook(lambda *_, key=(name, i): setattr(self, "region", key))


def _rank_of(setup: Setup) -> int:
    # The mesh is (dp_replicate=1, dp_shard=dp, cp): global rank = dp_index * cp + cp_rank.
    return setup.rank


def _build(meta_model, setup: Setup):
    """The model as fake tensors on the CPU (under the fake mode): no bytes, no init."""
    model = meta_model.to_empty(device="cpu").train()
    for module in model.modules():  # LayerDrop (a published Parakeet encoder's default 0.1)
        if getattr(module, "layerdrop", 0):  # skips layers at random: a plan sizes every layer
            module.layerdrop = 0.0
    if setup.activation_checkpointing:  # as cpvlm train enables it
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable({"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable({"use_reentrant": False})
    return model


def simulate_step(
    config, spec: SequenceSpec, setup: Setup = Setup(), cache: dict | None = None
) -> RankMemory:
    """One training step of ``config``'s model on ``spec`` for one rank of ``setup``, on fake
    tensors; its bytes (see ``RankMemory``). Raises ValueError for a config or setup cpvlm cannot
    build, with the reason.

    ``cache`` (a dict the caller keeps, one per config) holds what does not depend on the
    sequence: the optimizer step's bytes (simulated once per mesh and dtype; they depend only on
    the parameter shards) and the full model's shard sizes. Several calls then cost a forward and
    backward each (two or three under ``depth_fit="affine"``: cpvlm.simulate.depth)."""
    t0 = time.perf_counter()
    cache = {} if cache is None else cache
    has_vision = bool(spec.images or spec.videos)  # (audio runs its whole encoder: not reduced)
    if not setup.reduced_depth:
        memory, _, _ = _simulate(config, config, None, spec, setup, cache)
    else:
        run_config, depth = reduce_depth(config, has_vision)
        memory, by_layer, meta = _simulate(config, run_config, depth, spec, setup, cache)
        if setup.depth_fit == "affine":
            extra = [("text", i, n) for i, n in depth.text_extra.items()]
            extra += [("vision", i, n) for i, n in depth.vision_extra.items()]
            one_more = replace(setup, optimizer=False)
            points = []
            for tower, i, n in extra:
                plus_config, _ = reduce_depth(config, has_vision, plus=(tower, i))
                plus, _, _ = _simulate(config, plus_config, depth, spec, one_more, cache)
                points.append((n, plus))
            _fit_affine(memory, points)
            by_layer = {}  # the saved bytes of the layers left out are in the fit
        _add_left_out(memory, by_layer, depth, config, meta, setup, cache)
    memory.seconds = time.perf_counter() - t0
    return memory


_FITTED = ("saved", "loss_saved", "saved_gathered", "peak_fwd_bwd", "gathered", "loss")


def _fit_affine(memory: RankMemory, points: list) -> None:
    """Extrapolate the forward + backward's figures from the reduced model (``memory``) along
    the line through each ``(layers left out, reduced model with one more of them)``."""
    base = {name: getattr(memory, name) for name in _FITTED}
    base_cats = dict(memory.peak_by_category)
    for n, plus in points:
        for name in _FITTED:
            setattr(memory, name, getattr(memory, name) + n * (getattr(plus, name) - base[name]))
        for key in set(base_cats) | set(plus.peak_by_category):
            step = plus.peak_by_category.get(key, 0) - base_cats.get(key, 0)
            memory.peak_by_category[key] = memory.peak_by_category.get(key, 0) + n * step


def _simulate(config, run_config, depth, spec: SequenceSpec, setup: Setup, cache: dict):
    """``(RankMemory, saved bytes by layer, meta model)`` of ``run_config``'s model (``config``
    builds the batch)."""
    from cpvlm.hf import ContextParallelVLM, adapter_for
    from cpvlm.parallelize import build_mesh, mesh_groups, parallelize

    world = setup.dp * setup.cp
    compute = setup.compute_dtype if setup.compute_dtype != setup.master_dtype else None
    meta = meta_model(run_config, setup.master_dtype)
    layers = None if depth is None else (depth.text_layers, depth.vision_blocks)
    opt_key = ("optimizer", setup.dp, setup.cp, setup.data_parallel, setup.master_dtype, layers)
    run_optimizer = setup.optimizer and opt_key not in cache
    with fake_world(world, _rank_of(setup)), compat.fake_tensor_mode(), compat.HostIntegers():
        model = _build(meta, setup)
        adapter = adapter_for(model)
        mesh = build_mesh(dp_replicate=1, dp_shard=setup.dp, cp=setup.cp, device_type="cpu")
        groups = mesh_groups(mesh)
        cp_model = ContextParallelVLM(
            model,
            groups.cp_group,
            options=CPOptions(attn=setup.attn, vision=setup.vision),
            loss_chunk=setup.loss_chunk,
        )
        if setup.data_parallel == "fsdp":
            runner = parallelize(
                cp_model,
                mesh,
                data_parallel="fsdp",
                groups=groups,
                fsdp_units=adapter.fsdp_units(model),
                compute_dtype=compute,
            )
        else:
            runner = cp_model
            if compute is not None:
                raise ValueError("Setup: compute_dtype needs data_parallel='fsdp' in a simulation")
        batch, doc_lens = build_batch(config, spec)
        params = [p for p in cp_model.parameters() if p.requires_grad]
        exclude = {id(t.untyped_storage()) for t in (*model.parameters(), *model.buffers())}
        tracker = compat.memory_tracker()
        tracker.track_external(runner)
        saved = _Saved(exclude, tracker.category_of)
        saved.label(adapter.decoder_layers(model), "text")
        saved.label(vision_blocks(adapter.vision_tower(model)), "vision")
        adapter.text_model(model).register_forward_hook(
            lambda _m, _a, output: _after_decoder(saved, tracker, output)
        )
        with tracker:
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
                out = runner(**batch, doc_lens=doc_lens)
            saved_bytes = saved.bytes()
            loss_saved = saved.bytes(category=compat.LOSS)
            saved_gathered = saved.bytes(category=compat.GATHERED)
            by_layer = {  # what each layer saved, less any gathered parameter it holds
                key: saved.bytes(key, not_category=compat.GATHERED)
                for key in {w for _, w, _ in saved.storages.values()}
            }
            # The backward starts in the loss, until its gradient reaches the decoder's output
            # (``_after_decoder``'s hook pops it).
            tracker.push(compat.LOSS)
            out.loss.backward()
            fwd_bwd = _peak(tracker)
            by_category = _categories(tracker, "peak")
            now = _categories(tracker, "current")
            if run_optimizer:
                tracker.reset_peak()
                optimizer = _optimizer_step(params)
                # The step's bytes beyond the parameters and gradients: the same for every
                # sequence on this mesh (nothing else is live after the backward).
                cache[opt_key] = (
                    _peak(tracker) - now["Total"],
                    _categories(tracker, "current").get("Optstate", 0),
                )
                del optimizer  # its state is counted while it lives
        opt_peak, opt_state = cache.get(opt_key, (0, 0))
        params = now.get("Parameter", 0) + now.get("Buffer", 0)
        grads = now.get("Gradient", 0)
        memory = RankMemory(
            params=params,
            grads=grads,
            optimizer=opt_state,
            saved=saved_bytes,
            loss_saved=loss_saved,
            saved_gathered=saved_gathered,
            peak=max(fwd_bwd, now["Total"] + opt_peak),
            peak_fwd_bwd=fwd_bwd,
            peak_opt=now["Total"] + opt_peak if setup.optimizer else 0,
            peak_by_category=by_category,
            gathered=by_category.get(compat.GATHERED, 0),
            loss=by_category.get(compat.LOSS, 0),
            local_len=out_local_len(batch, setup),
            pixel_bytes=sum(
                v.numel() * v.element_size() for k, v in batch.items() if k.startswith("pixel")
            ),
        )
    return memory, by_layer, meta


def _optimizer_step(params) -> torch.optim.Optimizer:
    """One foreach AdamW step, on each parameter's local shard and its gradient's: the same local
    ops (and bytes) DTensor runs for a sharded parameter, without DTensor's sharding propagation
    of every foreach op (half a simulation's time at 8B)."""
    from torch.distributed.tensor import DTensor

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    with torch.no_grad():
        shards = [local(p) if isinstance(p, DTensor) else p for p in params]
    for shard, p in zip(shards, params):
        if shard is not p:
            shard.grad = local(p.grad)
    optimizer = torch.optim.AdamW(shards, lr=1e-4, foreach=True)
    optimizer.step()
    return optimizer


def _after_decoder(saved: _Saved, tracker, output) -> None:
    """The decoder's forward ended: what is saved from here on is the head's and the loss's; in
    the backward, the loss phase ends when the gradient of the decoder's output is made."""
    saved.region = "loss"
    hidden = output.last_hidden_state
    if hidden.requires_grad:
        hidden.register_hook(lambda grad: tracker.pop(compat.LOSS))


def out_local_len(batch, setup: Setup) -> int:
    from cpvlm import ShardPlan

    return ShardPlan(batch["input_ids"].shape[1], setup.cp).local_len


def _add_left_out(
    memory: RankMemory, by_layer: dict, depth, config, meta, setup: Setup, cache: dict
) -> None:
    """The layers the reduced model left out: their saved bytes (those of the simulated layer of
    their kind; none under the affine fit, which has them) and their shards of parameters,
    gradients and optimizer state."""
    acts = sum(n * by_layer.get(("text", i), 0) for i, n in depth.text_extra.items())
    acts += sum(n * by_layer.get(("vision", i), 0) for i, n in depth.vision_extra.items())
    world, fsdp = setup.dp * setup.cp, setup.data_parallel == "fsdp"
    key = ("shards", world, fsdp, setup.master_dtype)
    if key not in cache:
        cache[key] = shard_bytes(meta_model(config, setup.master_dtype), world, fsdp)
    full_bytes, full_elems, full_tensors = cache[key]
    red_bytes, red_elems, red_tensors = shard_bytes(meta, world, fsdp)
    elem = torch.empty((), dtype=setup.master_dtype).element_size()
    d_params, d_grads = full_bytes - red_bytes, (full_elems - red_elems) * elem
    # AdamW: exp_avg, exp_avg_sq, and a float32 step count per parameter
    d_opt = 2 * d_grads + 4 * (full_tensors - red_tensors) if setup.optimizer else 0
    memory.params += d_params
    memory.grads += d_grads
    memory.optimizer += d_opt
    if setup.depth_fit == "add":
        memory.saved += acts
        # At the forward + backward peak every saved activation is alive; the gradients are
        # counted whole (an upper bound: the peak may come before the last of them lands).
        memory.peak_fwd_bwd += acts + d_params + d_grads
    if setup.optimizer:  # foreach AdamW's one temporary: sqrt(exp_avg_sq), the grads' size
        memory.peak_opt += d_params + d_grads + d_opt + d_grads
    memory.peak = max(memory.peak_opt, memory.peak_fwd_bwd)


def _categories(tracker, kind: str) -> dict[str, int]:
    snap = tracker.get_tracker_snapshot(kind)
    out: dict[str, int] = {}
    for per_device in snap.values():
        for name, nbytes in per_device.items():
            key = str(getattr(name, "value", name)).capitalize()
            out[key] = out.get(key, 0) + int(nbytes)
    return out


def _peak(tracker) -> int:
    return _categories(tracker, "peak").get("Total", 0)
