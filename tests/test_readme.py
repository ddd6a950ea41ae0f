"""The README's API example ends by destroying its process group.

Left to interpreter shutdown, a gloo process group can outlive the Python objects its worker
threads hold, and the process aborts at exit with "terminate called without an active
exception" (seen in 2 of 31 runs of the example; pytorch/pytorch#65513 found the same: the
group's destructor had not run). The abort is intermittent, so a run of the example cannot
show its absence; the example itself must end with ``dist.destroy_process_group()``, after its
last collective. cpvlm's own entry points (the launcher's ranks, torchrun ranks) destroy theirs:
tests/train/test_train_torchrun.py checks that no rank aborts at exit.
"""

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_the_api_example_destroys_its_process_group_last():
    text = README.read_text()
    section = text[text.index("## Using it") :]
    example = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    lines = [line.split("#")[0].strip() for line in example.splitlines()]
    code = [line for line in lines if line]
    assert "dist.destroy_process_group()" in code, example
    after = code[code.index("dist.destroy_process_group()") + 1 :]
    assert not after, f"code after destroy_process_group: {after}"
    assert code.index("dist.destroy_process_group()") > max(
        i for i, line in enumerate(code) if "backward()" in line or "runner(" in line
    )
