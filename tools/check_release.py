"""Check cpvlm against a release of transformers, trl, peft, accelerate, datasets or torch, and
widen the tested window when it passes.

    python tools/check_release.py --latest                 # the newest transformers on the index
    python tools/check_release.py --package peft==0.22.0   # any package (repeatable)
    python tools/check_release.py --package torch==2.14.1 --package torchvision==0.29.1
    python tools/check_release.py transformers==5.26.0     # a given release (any pip requirements)
    python tools/check_release.py --window oldest          # the window's floor (CI)
    python tools/check_release.py --window newest          # the newest pip resolves inside (CI)
    python tools/check_release.py --package peft==0.22.0 --widen   # ... and widen the window

It makes a venv that sees this interpreter's packages (torch, the test tools) behind its own,
installs the requirements there, and runs in it: ``cpvlm verify --model M --cp 2`` of every tiny
model, the float64 family tests (``-m float64_family tests/hf``), the families' own files
(``FAMILY_FILES``) and the files that exercise each package named (``PACKAGE_FILES``):

    transformers   the checks above (its model classes are what the families adapt)
    peft           tests/hf/test_trainer.py (LoRA under the Trainer), tests/train/test_train_lora.py
    trl            tests/hf/test_trainer.py (SFTTrainer runs)
    accelerate     tests/hf/test_trainer.py, tests/test_examples.py (the Trainer's and the library
                   example's torchrun worlds, where accelerate holds the process group)
    datasets       tests/data/test_data_loader.py, tests/train/test_train_realdata.py
    torch          tests/test_compat.py (the version-dependent collectives of
                   cpvlm/distributed/compat.py); the whole suite on a torch is the README's command

Every tiny model's verify runs in ONE python process of the check venv (``pooled_verify``): it
calls ``cpvlm.verify.command.main`` once per model, so all of them run on the same pooled gloo
ranks of ``cpvlm.verify.runner`` instead of importing transformers in a process each. Each model
is still checked and reported on its own, at verify's tolerance; a model whose verify returns
non-zero or raises, or one that never ran, fails the run.

It prints one row per tiny model (verify, and the tests that name it), one per package file, and
exits 1 if anything failed. ``--window newest`` first asks pip (``--dry-run --report``) which
release of each watched library it resolves inside the window; when those are exactly the versions
this interpreter has installed (the README's pins, which the main run just tested) it prints that
the newest end was skipped and exits 0.

``--widen`` (only when everything passed) moves the bound of each library outside the window to
the installed version, in every pyproject requirement that names it (torch's in
``dependencies``, given an upper bound if it has none), pins the new newest in constraints.txt
(one line each, the others left alone), and keeps that only if
``pip install --dry-run -c constraints.txt -e ".[test]"`` still resolves; otherwise it restores
both files and exits 1. Run it from the repository root of an installed checkout
(``pip install -e ".[test]"``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata as metadata
import json
import re
import site
import subprocess
import sys
import tempfile
import time
import traceback
import venv
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOOLS = Path(__file__).resolve().parent
PYPROJECT = ROOT / "pyproject.toml"
CONSTRAINTS = ROOT / "constraints.txt"
WATCHED = ("transformers", "trl", "peft", "accelerate", "datasets")
WIDENED = (*WATCHED, "torch")  # what --widen may move: the watched libraries and torch
FAMILY_FILES = (
    "tests/hf/test_gemma.py",
    "tests/hf/test_qwen3_5.py",
    "tests/linear/test_linear_exact.py",
    "tests/hf/test_float64_mode.py",
)
PACKAGE_FILES = {
    "transformers": (),
    "peft": ("tests/hf/test_trainer.py", "tests/train/test_train_lora.py"),
    "trl": ("tests/hf/test_trainer.py",),
    "accelerate": ("tests/hf/test_trainer.py", "tests/test_examples.py"),
    "datasets": ("tests/data/test_data_loader.py", "tests/train/test_train_realdata.py"),
    "torch": ("tests/test_compat.py",),
}
VERIFY_ARGS = ("--cp", "2")


# ---- pyproject and constraints text (pure) ----------------------------------------------------


def declared_in(text: str, name: str) -> list[str]:
    """The distinct requirement strings of ``name`` in pyproject ``text`` (every extra's, and
    ``dependencies``)."""
    return sorted(set(re.findall(rf'"({re.escape(name)}\s*[<>=!~][^"]*)"', text)))


def declared(name: str) -> list[str]:
    """pyproject's requirement strings for ``name`` (every extra's; they are kept equal)."""
    return declared_in(PYPROJECT.read_text(), name)


def bounds(req: str) -> tuple[str | None, str | None]:
    """(lower, upper) of a ``>=lower,<upper`` requirement; None for a side it does not bound."""
    lower = re.search(r">=\s*([\w.]+)", req)
    upper = re.search(r"<(?!=)\s*([\w.]+)", req)
    return (lower and lower.group(1)), (upper and upper.group(1))


def window_bounds(name: str) -> tuple[str, str]:
    """(lower, upper) of pyproject's ``>=lower,<upper`` for ``name``."""
    (req,) = declared(name)
    lower, upper = bounds(req)
    return lower, upper


def _minor(version: str) -> tuple[int, int]:
    """(major, minor) of a version string: "5.25.0" -> (5, 25), "3" -> (3, 0), "5.26.0rc1" too."""
    parts = [int(re.match(r"\d*", p).group() or 0) for p in version.split(".")[:2]]
    return (parts + [0])[0], (parts + [0, 0])[1]


def _name_pattern(name: str) -> str:
    """A regex of ``name`` in any of pip's spellings (case, ``-``/``_``/``.``)."""
    return "[-_.]+".join(re.escape(part) for part in re.split(r"[-_.]+", name))


def pinned(constraints: str, name: str) -> str | None:
    """The version constraints ``text`` pins ``name`` to, or None."""
    m = re.search(rf"(?im)^{_name_pattern(name)}\s*==\s*([^\s;#]+)", constraints)
    return m and m.group(1)


def pin(constraints: str, name: str, version: str) -> str:
    """``constraints`` with ``name==version``: its own line replaced (only that line), or one
    appended when it has none."""
    line = f"{name}=={version}"
    new, count = re.subn(rf"(?im)^{_name_pattern(name)}\s*==.*$", line, constraints, count=1)
    if count:
        return new
    return (
        constraints + ("" if not constraints or constraints.endswith("\n") else "\n") + line + "\n"
    )


def widen_requirement(req: str, version: str, newest: str | None = None) -> tuple[str, bool]:
    """``req`` widened to hold ``version``, and whether its upper bound moved to it (the version
    is then the newest passed, to pin). A requirement without an upper bound gets one above the
    newer of ``version`` and ``newest`` (constraints' pin: the newest CI passed)."""
    lower, upper = bounds(req)
    major, minor = _minor(version)
    if upper is None and (lower is None or (major, minor) >= _minor(lower)):
        top = version if newest is None or _minor(newest) <= (major, minor) else newest
        t_major, t_minor = _minor(top)
        return f"{req},<{t_major}.{t_minor + 1}", top == version
    if upper is not None and (major, minor) >= _minor(upper):
        return req.replace(f"<{upper}", f"<{major}.{minor + 1}"), True
    if lower is not None and (major, minor) < _minor(lower):
        return req.replace(f">={lower}", f">={major}.{minor}"), False
    return req, False


def widen_text(
    pyproject: str, constraints: str, versions: dict[str, str]
) -> tuple[str, str, list[str]]:
    """pyproject and constraints texts with each library's window widened to ``versions`` (every
    requirement that names it), the new newest pinned; and what changed."""
    changes = []
    for name, version in versions.items():
        moved = False
        for old in declared_in(pyproject, name):
            new, up = widen_requirement(old, version, pinned(constraints, name))
            if new != old:
                pyproject = pyproject.replace(f'"{old}"', f'"{new}"')
                changes.append(f"{old} -> {new}")
                moved = moved or up
        if moved and pinned(constraints, name) != version:
            constraints = pin(constraints, name, version)
            changes.append(f"constraints.txt: {name}=={version}")
    return pyproject, constraints, changes


# ---- what to check (pure) ---------------------------------------------------------------------


def package_requirement(text: str) -> str:
    """``--package``'s value: a pip requirement (``peft==0.22.0``, ``peft``: the newest)."""
    from packaging.requirements import InvalidRequirement, Requirement

    try:
        Requirement(text)
    except InvalidRequirement as err:
        raise argparse.ArgumentTypeError(f"not a requirement: {text!r} ({err})") from None
    return text


def requirement_name(text: str) -> str | None:
    """The normalized project name of a pip requirement, None for an option (``--upgrade``)."""
    from packaging.requirements import InvalidRequirement, Requirement

    if text.startswith("-"):
        return None
    try:
        return re.sub(r"[-_.]+", "-", Requirement(text).name).lower()
    except InvalidRequirement:
        return None


def install_args(requirements: list[str], packages: list[str]) -> list[str]:
    """pip's arguments for the positional requirements and the ``--package`` ones (a bare name:
    the newest on the index, ``--upgrade``)."""
    out = list(requirements)
    for req in packages:
        out += [req] if re.search(r"[<>=!~@]", req) else ["--upgrade", req]
    return out


def files_for(names) -> list[str]:
    """The family files, then those that exercise each named package, once each."""
    files = list(FAMILY_FILES)
    for name in names:
        files += [f for f in PACKAGE_FILES.get(name, ()) if f not in files]
    return files


def newest_skip(resolved: dict[str, str], installed: dict[str, str]) -> str | None:
    """The line to print when the window's newest end (``resolved``: what pip would install of
    each watched library) is what this interpreter has installed, None when they differ."""
    if not resolved or any(installed.get(n) != v for n, v in resolved.items()):
        return None
    pins = ", ".join(f"{n} {v}" for n, v in resolved.items())
    return f"newest end equals the installed pins ({pins}): already tested by the main run, skipped"


def verify_outcomes(models, results: dict) -> dict[str, str]:
    """``{model: "ok" | "rc N" | "raised" | "not run"}`` from ``pooled_verify``'s results."""
    out = {}
    for model in models:
        rc = (results.get(model) or {}).get("rc", "not run")
        if rc == 0 and not isinstance(rc, bool):
            out[model] = "ok"
        elif isinstance(rc, int) and not isinstance(rc, bool):
            out[model] = f"rc {rc}"
        else:
            out[model] = str(rc)
    return out


def verify_failures(outcomes: dict[str, str], driver_rc: int) -> list[str]:
    """What failed in the pooled verify: each model not "ok", or the process itself."""
    failed = [f"verify {m}: {o}" for m, o in outcomes.items() if o != "ok"]
    if driver_rc and not failed:
        failed.append(f"the verify process exited {driver_rc}")
    return failed


# ---- in the check venv ------------------------------------------------------------------------


def pooled_verify(out: str, verify: bool = True, models=None, main=None) -> int:
    """Runs in the check venv: writes ``{"families": {model: family}, "verify": {model: {"rc",
    "s"}}}`` to ``out`` (after each model), running ``cpvlm verify --model M --cp 2`` of every
    tiny model in this process, on the same pooled gloo ranks. Exit code 1 if any failed."""
    report = {"families": {}, "verify": {}}
    if models is None:
        from cpvlm.hf import TINY_MODELS, build_model, model_family

        report["families"] = {m: model_family(build_model(m)) for m in TINY_MODELS}
        models = list(TINY_MODELS)
    else:
        report["families"] = {m: "" for m in models}
    Path(out).write_text(json.dumps(report))
    if not verify:
        return 0
    if main is None:
        from cpvlm.verify.command import main
    for model in models:
        argv = ["--model", model, *VERIFY_ARGS]
        print(f"+ cpvlm verify {' '.join(argv)}  (in process, pooled ranks)", flush=True)
        started = time.monotonic()
        try:
            rc = main(argv)
        except SystemExit as exc:  # argparse errors
            rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except Exception:
            traceback.print_exc()
            rc = "raised"
        sys.stdout.flush()
        report["verify"][model] = {"rc": rc, "s": round(time.monotonic() - started, 1)}
        Path(out).write_text(json.dumps(report))
    outcomes = verify_outcomes(models, report["verify"])
    return 0 if all(o == "ok" for o in outcomes.values()) else 1


# ---- driving it -------------------------------------------------------------------------------


def make_venv(folder: Path) -> Path:
    """A venv whose own site-packages come first and this interpreter's after (a ``.pth`` that
    adds them as site dirs, so their editable installs work too). Returns its python."""
    venv.create(folder, with_pip=True)
    python = folder / "bin" / "python"
    own = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    outer = [p for p in [*site.getsitepackages(), site.getusersitepackages()] if Path(p).is_dir()]
    lines = [f"import site; site.addsitedir({p!r})" for p in outer]
    (Path(own) / "_cpvlm_outer_site.pth").write_text("\n".join(lines) + "\n")
    return python


def installed_versions(python: Path | None = None) -> dict[str, str]:
    """The watched libraries' and torch's versions installed for ``python`` (None: this one)."""
    if python is None:
        out = {}
        for name in WIDENED:
            with contextlib.suppress(metadata.PackageNotFoundError):
                out[name] = metadata.version(name)
        return out
    code = (
        "import importlib.metadata as m, json\n"
        f"out = {{}}\nfor n in {list(WIDENED)!r}:\n"
        "    try: out[n] = m.version(n)\n    except m.PackageNotFoundError: pass\n"
        "print(json.dumps(out))"
    )
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(proc.stdout)


def resolve_newest(requirements: list[str]) -> dict[str, str]:
    """What pip would install for each requirement on its own (the newest release it allows on
    the index, whatever is installed): ``pip install --dry-run --ignore-installed --no-deps``."""
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-deps"]
    cmd += ["--quiet", "--report", "-", *requirements]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        sys.stderr.write(proc.stderr)
        raise SystemExit(f"pip could not resolve {' '.join(requirements)} (above)")
    report = json.loads(proc.stdout)
    found = {
        re.sub(r"[-_.]+", "-", i["metadata"]["name"]).lower(): i["metadata"]["version"]
        for i in report["install"]
    }
    return {requirement_name(r): found[requirement_name(r)] for r in requirements}


def pinned_env_resolves() -> tuple[bool, str]:
    """Whether ``pip install -c constraints.txt -e ".[test]"`` resolves (a dry run), and pip's
    output."""
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "-q", "-c", str(CONSTRAINTS)]
    proc = subprocess.run([*cmd, "-e", ".[test]"], cwd=ROOT, capture_output=True, text=True)
    return proc.returncode == 0, (proc.stdout + proc.stderr).strip()


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


def run_pooled_verify(python: Path, out: Path, verify: bool, log) -> tuple[dict, dict, int]:
    """(families, per-model results, exit code) of ``pooled_verify`` in the check venv. It runs
    from the repository root (``sys.path[0]``), so the checkout's cpvlm is the one imported."""
    code = (
        f"import sys; sys.path.append({str(TOOLS)!r}); import check_release; "
        f"sys.exit(check_release.pooled_verify({str(out)!r}, verify={verify!r}))"
    )
    log.write(f"+ {python} -c {code!r}\n")
    log.flush()
    proc = subprocess.run([python, "-c", code], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    report = json.loads(out.read_text()) if out.exists() else {}
    return report.get("families") or {}, report.get("verify") or {}, proc.returncode


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("requirements", nargs="*", help="pip requirements to install, e.g. "
                   "transformers==5.26.0")  # fmt: skip
    p.add_argument("--package", action="append", default=[], type=package_requirement,
                   metavar="REQ", help="a release of any package to check, e.g. peft==0.22.0 or "
                   "torch==2.14.1 (a bare name: the newest on the index); repeatable")  # fmt: skip
    p.add_argument("--window", choices=["oldest", "newest"],
                   help="transformers at the window's floor, or the newest release of each watched "
                   "library that pip resolves inside it (skipped when that is what is installed)")  # fmt: skip
    p.add_argument("--latest", action="store_true",
                   help="the newest transformers on the index, whatever the window")  # fmt: skip
    p.add_argument("--no-verify", action="store_true", help="only the tests, no cpvlm verify")
    p.add_argument("--widen", action="store_true", help="if everything passed, widen the window")
    p.add_argument("--json", type=Path, help="also write the report here")
    args = p.parse_args(argv)
    if not (args.requirements or args.package or args.window or args.latest):
        p.error("name requirements, --package, --window or --latest")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    reqs = install_args(args.requirements, args.package)
    names = [n for n in map(requirement_name, reqs) if n]
    if args.window == "oldest":
        reqs.append(f"transformers=={window_bounds('transformers')[0]}.0")
    elif args.window == "newest":
        text = PYPROJECT.read_text()
        window = [r for n in WATCHED for r in declared_in(text, n)]
        resolved = resolve_newest(window)
        installed = installed_versions()
        skip = newest_skip(resolved, installed)
        if skip and not reqs:  # nothing else asked for: the main run has tested all of it
            print(skip)
            if args.json:
                args.json.write_text(json.dumps({"versions": resolved, "ok": True,
                                                 "skipped": skip}, indent=1))  # fmt: skip
            return 0
        reqs += [f"{n}=={v}" for n, v in resolved.items()]
        names += [n for n, v in resolved.items() if installed.get(n) != v]
    if args.latest:
        reqs += ["--upgrade", "transformers"]
    if args.window or args.latest:
        names.append("transformers")
    files = files_for(dict.fromkeys(names))

    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="cpvlm-release-") as tmp:
        tmp = Path(tmp)
        python = make_venv(tmp / "venv")
        subprocess.run([python, "-m", "pip", "install", "-q", *reqs], check=True)
        versions = installed_versions(python)
        print("installed: " + ", ".join(f"{n} {v}" for n, v in versions.items()), flush=True)
        with open(tmp / "log.txt", "w") as log:
            models, results, driver_rc = run_pooled_verify(
                python, tmp / "verify.json", not args.no_verify, log
            )
            if not models:
                sys.stderr.write((tmp / "log.txt").read_text()[-20000:])
                raise SystemExit("cpvlm does not import with these versions (above)")
            tests = run_pytest(python, ["-m", "float64_family", "tests/hf"], tmp / "a.xml", log)
            tests += run_pytest(python, files, tmp / "b.xml", log)
        verify = verify_outcomes(models, results) if not args.no_verify else {}
        failed = [t for t, outcome in tests if outcome in ("failed", "error")]
        failed += verify_failures(verify, driver_rc)
        if failed:
            sys.stdout.write((tmp / "log.txt").read_text()[-20000:])

    rows, claimed = [], set()
    for model, family in models.items():
        mine = [(t, o) for t, o in tests if f"[{model}" in t or f"-{model}" in t]
        claimed.update(t for t, _ in mine)
        seconds = (results.get(model) or {}).get("s")
        rows.append((model, family, verify.get(model, "-"), seconds, mine))
    for f in files[len(FAMILY_FILES) :]:
        prefix = f.removesuffix(".py").replace("/", ".")
        mine = [(t, o) for t, o in tests if t.startswith(prefix) and t not in claimed]
        claimed.update(t for t, _ in mine)
        rows.append((f"({Path(f).name})", "", "-", None, mine))
    rows.append(("(not per model)", "", "-", None, [(t, o) for t, o in tests if t not in claimed]))
    print(f"\n{'model':<26} {'family':<16} {'verify':<8} {'s':>5}  tests passed / failed")
    for model, family, ver, seconds, mine in rows:
        passed = sum(o == "passed" for _, o in mine)
        bad = sum(o in ("failed", "error") for _, o in mine)
        s = "-" if seconds is None else f"{seconds:.0f}"
        print(f"{model:<26} {family:<16} {ver:<8} {s:>5}  {passed} / {bad}")
    for t in failed:
        print(f"FAILED {t}")
    ok = not failed
    with_ = ", ".join(f"{n} {v}" for n, v in versions.items())
    print(
        f"\n{'all passed' if ok else 'FAILED'} with {with_} in {time.monotonic() - started:.0f} s"
    )
    if args.json:
        args.json.write_text(json.dumps({"versions": versions, "ok": ok, "verify": verify,
                                         "tests": dict(tests)}, indent=1))  # fmt: skip
    if ok and args.widen:
        return widen(versions)
    return 0 if ok else 1


def widen(versions: dict[str, str]) -> int:
    """Widen pyproject and constraints.txt to ``versions``; keep it only if the pinned env still
    resolves. Exit code."""
    old_py, old_pins = PYPROJECT.read_text(), CONSTRAINTS.read_text()
    text, pins, changes = widen_text(old_py, old_pins, versions)
    if not changes:
        print("widened: nothing, the window already holds these versions")
        return 0
    PYPROJECT.write_text(text)
    CONSTRAINTS.write_text(pins)
    resolves, output = pinned_env_resolves()
    if not resolves:
        PYPROJECT.write_text(old_py)
        CONSTRAINTS.write_text(old_pins)
        print(output[-4000:])
        print('not widened: pip install -c constraints.txt -e ".[test]" does not resolve with '
              f"{'; '.join(changes)} (above); pyproject.toml and constraints.txt restored")  # fmt: skip
        return 1
    for change in changes:
        print(f"widened: {change}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
