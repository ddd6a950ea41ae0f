"""The suite-wide pytest option ``--durations-json PATH``, here at the repository root so that
pytest reads it before it parses the command line (an option of ``tests/conftest.py`` is not
known when pytest collects ``testpaths`` from the root)."""

import json
import os
import platform
import time
from pathlib import Path

import torch


def pytest_addoption(parser):
    parser.addoption(
        "--durations-json",
        metavar="PATH",
        help="write every test's time (setup + call + teardown), outcome and lane to PATH, with "
        "the machine and its load (benchmarks/results/test_durations.json: the README's test "
        "command; docs/testing.md's tables are generated from it)",
    )


class _Durations:
    """What ``--durations-json`` writes: each test's seconds and outcome, the run's wall time,
    the machine and its 1-minute load at the start and the end."""

    def __init__(self, path: Path):
        self.path, self.tests = path, {}
        self.start, self.load = time.monotonic(), [os.getloadavg()[0]]

    def pytest_runtest_logreport(self, report):
        entry = self.tests.setdefault(report.nodeid, {"seconds": 0.0, "outcome": "passed"})
        entry["seconds"] += report.duration
        if report.failed:
            entry["outcome"] = "failed" if report.when == "call" else "error"
        elif report.skipped and entry["outcome"] == "passed":
            entry["outcome"] = "skipped"

    def pytest_sessionfinish(self, session):
        import transformers

        self.load.append(os.getloadavg()[0])
        slow = {item.nodeid for item in session.items if item.get_closest_marker("slow")}
        outcomes = [t["outcome"] for t in self.tests.values()]
        payload = {
            "command": " ".join(["python -m pytest", *session.config.invocation_params.args]),
            "date": time.strftime("%Y-%m-%d"),
            "wall_s": round(time.monotonic() - self.start, 1),
            "counts": {o: outcomes.count(o) for o in sorted(set(outcomes))},
            "machine": {
                "cores": len(os.sched_getaffinity(0)),
                "cpu": _cpu_model(),
                "load_1min": [round(x, 2) for x in self.load],
                "python": platform.python_version(),
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            },
            "tests": {
                nodeid: {
                    "seconds": round(t["seconds"], 2),
                    "outcome": t["outcome"],
                    "lane": "slow" if nodeid in slow else "fast",
                }
                for nodeid, t in sorted(self.tests.items())
            },
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(payload, indent=1) + "\n")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def pytest_configure(config):
    path = config.getoption("--durations-json")
    if path and not hasattr(config, "workerinput"):
        config.pluginmanager.register(_Durations(Path(path)), "cpvlm-durations-json")
