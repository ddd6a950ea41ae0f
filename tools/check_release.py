"""Check cpvlm's model families against a release of transformers (or trl, peft, ...), and widen
the tested window when they pass.

    python tools/check_release.py --latest                 # the newest transformers on the index
    python tools/check_release.py transformers==5.26.0     # a given release (any pip requirements)
    python tools/check_release.py --window oldest          # the window's floor (CI)
    python tools/check_release.py --latest --widen         # ... and move pyproject's bound to it

It makes a venv that sees this interpreter's packages (torch, the test tools) behind its own,
installs the requirements there, and runs in it: ``cpvlm verify --model M --cp 2`` for every tiny
model, the float64 family tests (``-m float64_family tests/hf``) and the families' own files
(``FAMILY_FILES``). It prints one row per tiny model (verify, and the tests that name it) and
exits 1 if anything failed. ``--widen`` (only when everything passed) moves pyproject's bound of
each watched library outside the window to the installed version and pins it in constraints.txt.
Run it from the repository root of an installed checkout (``pip install -e ".[test]"``).
"""

from __future__ import annotations

import argparse
import json
import re
import site
import subprocess
import sys
import tempfile
import time
import venv
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = ROOT / "pyproject.toml"
CONSTRAINTS = ROOT / "constraints.txt"
WATCHED = ("transformers", "trl", "peft", "accelerate", "datasets")
FAMILY_FILES = (
    "tests/hf/test_gemma.py",
    "tests/hf/test_qwen3_5.py",
    "tests/linear/test_linear_exact.py",
    "tests/hf/test_float64_mode.py",
)


def declared(name: str) -> list[str]:
    """pyproject's requirement strings for ``name`` (every extra's; they are kept equal)."""
    return sorted(set(re.findall(rf'"({re.escape(name)}\s*[<>=!~][^"]*)"', PYPROJECT.read_text())))


def window_bounds(name: str) -> tuple[str, str]:
    """(lower, upper) of pyproject's ``>=lower,<upper`` for ``name``."""
    (req,) = declared(name)
    lower = re.search(r">=\s*([\w.]+)", req).group(1)
    upper = re.search(r"<\s*([\w.]+)", req).group(1)
    return lower, upper


def make_venv(folder: Path) -> Path:
    """A venv whose own site-packages come first and this interpreter's after (a ``.pth`` that
    adds them as site dirs, so their editable installs work too). Returns its python."""
    venv.create(folder, with_pip=True)
    python = folder / "bin" / "python"
    own = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    outer = [p for p in [*site.getsitepackages(), site.getusersitepackages()] if Path(p).is_dir()]
    lines = [f"import site; site.addsitedir({p!r})" for p in outer]
    (Path(own) / "_cpvlm_outer_site.pth").write_text("\n".join(lines) + "\n")
    return python


def installed_versions(python: Path) -> dict[str, str]:
    code = (
        "import importlib.metadata as m, json\n"
        f"out = {{}}\nfor n in {list(WATCHED)!r}:\n"
        "    try: out[n] = m.version(n)\n    except m.PackageNotFoundError: pass\n"
        "print(json.dumps(out))"
    )
    return json.loads(subprocess.run([python, "-c", code], capture_output=True, text=True,
                                     check=True).stdout)  # fmt: skip


def tiny_models(python: Path) -> dict[str, str]:
    code = (
        "import json; from cpvlm.hf import TINY_MODELS, build_model, model_family\n"
        "print(json.dumps({m: model_family(build_model(m)) for m in TINY_MODELS}))"
    )
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True, cwd=ROOT)
    if proc.returncode:
        sys.stderr.write(proc.stderr)
        raise SystemExit("cpvlm does not import with these versions (above)")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_pytest(python: Path, args: list[str], junit: Path, log) -> list[tuple[str, str]]:
    """(test id, outcome) of one pytest run."""
    cmd = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *args]
    log.write(f"+ {' '.join(map(str, cmd))}\n")
    log.flush()
    subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    if not junit.exists():
        return [(" ".join(args), "error")]
    out = []
    for case in ET.parse(junit).iter("testcase"):
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            if case.find(tag) is not None:
                outcome = "skipped" if tag == "skipped" else "failed"
        out.append((f"{case.get('classname')}::{case.get('name')}", outcome))
    return out


def widen(versions: dict[str, str]) -> list[str]:
    """Move pyproject's bound of each library outside its window to ``versions``; pin the new
    newest in constraints.txt. Returns what changed."""
    text, pins, changes = PYPROJECT.read_text(), CONSTRAINTS.read_text(), []
    for name, version in versions.items():
        if not declared(name):
            continue
        lower, upper = window_bounds(name)
        release = tuple(int(x) for x in version.split(".")[:2])
        (old,) = declared(name)
        if release >= tuple(int(x) for x in upper.split(".")[:2]):
            new = old.replace(f"<{upper}", f"<{release[0]}.{release[1] + 1}")
            pins = re.sub(rf"(?m)^{re.escape(name)}==.*$", f"{name}=={version}", pins)
        elif release < tuple(int(x) for x in lower.split(".")[:2]):
            new = old.replace(f">={lower}", f">={release[0]}.{release[1]}")
        else:
            continue
        text = text.replace(f'"{old}"', f'"{new}"')
        changes.append(f"{old} -> {new}")
    PYPROJECT.write_text(text)
    CONSTRAINTS.write_text(pins)
    return changes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("requirements", nargs="*", help="pip requirements to install, e.g. "
                   "transformers==5.26.0")  # fmt: skip
    p.add_argument("--window", choices=["oldest", "newest"],
                   help="transformers at the window's floor, or the newest pip resolves inside it")  # fmt: skip
    p.add_argument("--latest", action="store_true",
                   help="the newest transformers on the index, whatever the window")  # fmt: skip
    p.add_argument("--no-verify", action="store_true", help="only the tests, no cpvlm verify")
    p.add_argument("--widen", action="store_true", help="if everything passed, widen the window")
    p.add_argument("--json", type=Path, help="also write the report here")
    args = p.parse_args(argv)

    reqs = list(args.requirements)
    if args.window == "oldest":
        reqs.append(f"transformers=={window_bounds('transformers')[0]}.0")
    elif args.window == "newest":
        reqs += declared("transformers")
    if args.latest:
        reqs += ["--upgrade", "transformers"]
    if not reqs:
        p.error("name requirements, --window or --latest")

    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="cpvlm-release-") as tmp:
        tmp = Path(tmp)
        python = make_venv(tmp / "venv")
        subprocess.run([python, "-m", "pip", "install", "-q", *reqs], check=True)
        versions = installed_versions(python)
        print("installed: " + ", ".join(f"{n} {v}" for n, v in versions.items()), flush=True)
        models = tiny_models(python)
        with open(tmp / "log.txt", "w") as log:
            tests = run_pytest(python, ["-m", "float64_family", "tests/hf"], tmp / "a.xml", log)
            tests += run_pytest(python, list(FAMILY_FILES), tmp / "b.xml", log)
            verify = {}
            if not args.no_verify:
                for model in models:
                    cmd = [python, "-m", "cpvlm.cli", "verify", "--model", model, "--cp", "2"]
                    log.write(f"+ {' '.join(map(str, cmd))}\n")
                    log.flush()
                    rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
                    verify[model] = "ok" if rc.returncode == 0 else f"rc {rc.returncode}"
        failed = [t for t, outcome in tests if outcome in ("failed", "error")]
        if failed or any(v != "ok" for v in verify.values()):
            sys.stdout.write((tmp / "log.txt").read_text()[-20000:])

    rows = []
    claimed = set()
    for model, family in models.items():
        mine = [(t, o) for t, o in tests if f"[{model}" in t or f"-{model}" in t]
        claimed.update(t for t, _ in mine)
        rows.append((model, family, verify.get(model, "-"), mine))
    rows.append(("(not per model)", "", "-", [(t, o) for t, o in tests if t not in claimed]))
    print(f"\n{'model':<22} {'family':<16} {'verify':<7} tests passed / failed")
    for model, family, ver, mine in rows:
        passed = sum(o == "passed" for _, o in mine)
        bad = sum(o in ("failed", "error") for _, o in mine)
        print(f"{model:<22} {family:<16} {ver:<7} {passed} / {bad}")
    for t in failed:
        print(f"FAILED {t}")
    ok = not failed and all(v == "ok" for v in verify.values())
    print(f"\n{'all passed' if ok else 'FAILED'} with {', '.join(f'{n} {v}' for n, v in versions.items())}"
          f" in {time.monotonic() - started:.0f} s")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"versions": versions, "ok": ok, "verify": verify,
                                         "tests": dict(tests)}, indent=1))  # fmt: skip
    if ok and args.widen:
        for change in widen(versions) or ["the window already holds these versions"]:
            print(f"widened: {change}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
