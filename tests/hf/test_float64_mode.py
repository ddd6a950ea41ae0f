"""The float64 islands run transformers' own code with its float32 casts kept in float64
(``KeepFloat64``), so that what transformers 5.25 did to the copies they replaced (an attribute
renamed, ``Gemma4RMSNorm.eps`` -> ``variance_epsilon``; a function wrapped in a hub-kernel object,
which ``inspect.getsource`` rejects) cannot break a reference. Planted here on a copy of
transformers' Qwen3.5 module: every norm's epsilon attribute renamed, and the chunked delta rule
wrapped in an object without source.
"""

import importlib.util
import sys
import types
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from cpvlm.families.qwen3_5 import Qwen3_5Kit, tiny_qwen3_5_config
from cpvlm.hf.float64 import KeepFloat64
from cpvlm.hf.kit import with_float64_forward
from cpvlm.testing import rel_err

QWEN3_5 = "transformers.models.qwen3_5.modeling_qwen3_5"


def test_every_float32_cast_stays_float64():
    x = torch.randn(3, 4, dtype=torch.float64)
    casts = {
        "float()": lambda: x.float(),
        "to(dtype)": lambda: x.to(torch.float32),
        "to(device, dtype)": lambda: x.to("cpu", torch.float32),
        "to(dtype=)": lambda: x.to(dtype=torch.float32),
        "type(dtype)": lambda: x.type(torch.float32),
        "type(name)": lambda: x.type("torch.FloatTensor"),
        "factory dtype=": lambda: torch.zeros(2, dtype=torch.float32),
        "softmax dtype=": lambda: torch.softmax(x, -1, dtype=torch.float32),
        "sum dtype=": lambda: x.sum(dtype=torch.float32),
    }
    for name, cast in casts.items():
        assert cast().dtype == torch.float32, f"{name}: the case does not cast outside the mode"
        with KeepFloat64():
            assert cast().dtype == torch.float64, name
    with KeepFloat64():
        # A bit reinterpretation is not a cast; other dtypes are left as asked.
        assert x.view(torch.float32).shape == (3, 8)
        assert x.to(torch.bfloat16).dtype == torch.bfloat16
        assert torch.arange(3).dtype == torch.int64


class _Wrapped:
    """A function behind an object with no source (as transformers 5.25's hub-kernel ``Func``)."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


def _planted_copy():
    """A fresh copy of transformers' Qwen3.5 module with every ``self.eps`` and
    ``self.variance_epsilon`` renamed and ``torch_chunk_gated_delta_rule`` wrapped."""
    spec = importlib.util.find_spec(QWEN3_5)
    source = Path(spec.origin).read_text()
    planted = source.replace("self.variance_epsilon", "self.planted_variance_epsilon")
    planted = planted.replace("self.eps", "self.planted_eps")
    assert planted != source, "the attribute to rename is gone: plant another one"
    module = types.ModuleType(QWEN3_5 + "_planted")
    module.__package__ = spec.parent
    module.__file__ = spec.origin
    sys.modules[module.__name__] = module  # transformers' decorators look their module up
    exec(compile(planted, spec.origin, "exec"), module.__dict__)
    module.torch_chunk_gated_delta_rule = _Wrapped(module.torch_chunk_gated_delta_rule)
    return module


class _Float32Seen(TorchFunctionMode):
    """Records whether any torch call made a float32 tensor."""

    seen = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.dtype == torch.float32:
            self.seen = True
        return out


def _layers(hf):
    """A Gated DeltaNet and a zero-centred RMSNorm of the tiny config from module ``hf``, float64,
    the same weights for every ``hf`` (seeded), the decay in a range that keeps float32's
    round-off visible but small (docs/hf_internals.md)."""
    text = tiny_qwen3_5_config().text_config
    torch.manual_seed(0)
    net = hf.Qwen3_5GatedDeltaNet(text, layer_idx=0).double()
    norm = hf.Qwen3_5RMSNorm(text.hidden_size, eps=text.rms_norm_eps).double()
    with torch.no_grad():
        for p in [*net.parameters(), *norm.parameters()]:
            p.normal_(0.0, 0.3)
        net.A_log.uniform_(-3.0, 0.0)
    return torch.nn.ModuleDict({"net": net, "norm": norm})


def _run(layers, x):
    x = x.clone().requires_grad_(True)
    with _Float32Seen() as seen:
        out = layers["norm"](layers["net"](x))
    (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
    grads = {n: p.grad.clone() for n, p in layers.named_parameters()}
    layers.zero_grad()
    return seen.seen, out.detach(), x.grad, grads


def test_islands_survive_a_renamed_attribute_and_a_wrapped_function():
    hf = _planted_copy()
    real = importlib.import_module(QWEN3_5)
    text = tiny_qwen3_5_config().text_config
    x = torch.randn(2, 13, text.hidden_size, dtype=torch.float64, generator=torch.manual_seed(1))

    planted = _layers(hf)
    seen, unchanged, _, _ = _run(planted, x)
    assert seen, "the copy computes no float32 without the islands: the check below cannot fail"

    with_float64_forward(planted, Qwen3_5Kit.float32_islands)
    seen, out, dx, grads = _run(planted, x)
    assert not seen, "a float32 tensor inside the planted copy's islands"

    # The same layers from transformers' own module, islands on: the plants change nothing.
    reference = _layers(real)
    reference.load_state_dict(planted.state_dict())
    with_float64_forward(reference, Qwen3_5Kit.float32_islands)
    _, ref_out, ref_dx, ref_grads = _run(reference, x)
    assert rel_err(out, ref_out) <= 1e-14
    assert rel_err(dx, ref_dx) <= 1e-14
    for name, grad in grads.items():
        assert rel_err(grad, ref_grads[name]) <= 1e-14, name
    # ... and they are float64, not float32: the unchanged forward is float32 round-off away.
    assert rel_err(unchanged, out) > 1e-12


def test_the_zero_centred_norm_island_is_its_formula_in_float64():
    """An independent check of one island: ``Qwen3_5RMSNorm`` (planted copy, epsilon renamed)
    equals x / rms(x) * (1 + w) written here in float64, to float64 round-off."""
    hf = _planted_copy()
    norm = _layers(hf)["norm"]
    x = torch.randn(4, 7, norm.weight.numel(), dtype=torch.float64)
    with_float64_forward(norm, Qwen3_5Kit.float32_islands)
    eps = tiny_qwen3_5_config().text_config.rms_norm_eps
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + norm.weight)
    assert rel_err(norm(x), expected) <= 1e-15


@pytest.mark.parametrize("island", ["net", "norm"])
def test_a_cp_forward_keeps_its_own_precision(island):
    """A forward called with ``cpvlm_cp`` runs without the mode (a CP path must compute float64
    by itself, or a check must see it fail); the class's forward is looked up at each call (a
    class swapped after the islands, as ``install_context_parallel`` does, is the one that runs)."""
    layers = _layers(importlib.import_module(QWEN3_5))
    with_float64_forward(layers, Qwen3_5Kit.float32_islands)
    calls = []

    def forward(self, x, cpvlm_cp=None):
        calls.append((cpvlm_cp, x.float().dtype))  # float64 only under the mode

    module = layers[island]
    module.__class__ = type("Swapped", (type(module),), {"forward": forward})
    module(torch.zeros(1, dtype=torch.float64), cpvlm_cp="plan")
    module(torch.zeros(1, dtype=torch.float64))
    assert calls == [("plan", torch.float32), (None, torch.float64)]
