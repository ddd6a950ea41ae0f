"""The README's API example is examples/library_step.py's, it and the architecture page's API
examples import every name they use from where ``cpvlm`` exports it, and it ends by destroying
its process group.

Left to interpreter shutdown, a gloo process group can outlive the Python objects its worker
threads hold, and the process aborts at exit with "terminate called without an active
exception" (seen in 2 of 31 runs of the example; pytorch/pytorch#65513 found the same: the
group's destructor had not run). The abort is intermittent, so a run of the example cannot
show its absence; the example itself must end with ``dist.destroy_process_group()``, after its
last collective. cpvlm's own entry points (the launcher's ranks, torchrun ranks) destroy theirs:
tests/train/test_train_torchrun.py checks that no rank aborts at exit. tests/test_examples.py
runs the example.
"""

import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
EXAMPLE = ROOT / "examples" / "library_step.py"


def _python_blocks(path: Path, heading: str) -> list[str]:
    text = path.read_text()
    section = text[text.index(heading) :]
    section = section[: section.index("\n## ", 1)]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def _using_it_blocks() -> list[str]:
    return _python_blocks(README, "## Using it")


def _api_blocks() -> list[str]:
    """The README's library step, then the architecture page's further API examples."""
    return _using_it_blocks() + _python_blocks(ARCHITECTURE, "## Public API")


def test_the_api_example_is_the_library_step_example():
    example = EXAMPLE.read_text()
    start, end = "# ---- README: Using it ----\n", "# ---- end of the README block ----\n"
    assert _using_it_blocks()[0] == example[example.index(start) + len(start) : example.index(end)]


def test_the_api_examples_import_what_cpvlm_exports():
    import cpvlm

    imported = []
    for block in _api_blocks():
        for module, names in re.findall(r"^from (cpvlm[\w.]*) import (.+)$", block, re.M):
            imported += [(module, n.strip()) for n in names.split("#")[0].split(",")]
    assert ("cpvlm", "MaskSpec") in imported
    for module, name in imported:
        mod = importlib.import_module(module)
        assert name in getattr(mod, "__all__", ()), (module, name)
    # cpvlm exports the library's public names, not its internals
    assert "ensure_requires_grad_for_cp_collective" not in cpvlm.__all__
    assert all(hasattr(cpvlm, name) for name in cpvlm.__all__)


def test_the_api_example_destroys_its_process_group_last():
    example = _using_it_blocks()[0]
    lines = [line.split("#")[0].strip() for line in example.splitlines()]
    code = [line for line in lines if line]
    assert "dist.destroy_process_group()" in code, example
    after = code[code.index("dist.destroy_process_group()") + 1 :]
    assert not after, f"code after destroy_process_group: {after}"
    assert code.index("dist.destroy_process_group()") > max(
        i for i, line in enumerate(code) if "backward()" in line or "runner(" in line
    )
