"""The documentation says what the code does: the families tables are the registry's, every block
marked runnable runs, every relative link resolves, the generated benchmark tables equal their
JSON, and no committed file cites a file outside the repository.

The site itself is built by ``mkdocs build --strict`` in the README's test command.
"""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))
FAMILY_TABLES = [README, ROOT / "docs" / "adding_a_family.md"]
RUNNABLE = "<!-- runnable -->"


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _families_table(path: Path) -> list[tuple[list[str], list[str]]]:
    """``(tiny names, model classes)`` of each row of the page's families table."""
    text = path.read_text()
    start = text.index("| family (tiny name) | transformers class |")
    rows = []
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        family, classes = line.split("|")[1:3]
        rows.append((re.findall(r"`([^`]+)`", family), re.findall(r"`([^`]+)`", classes)))
    return rows


@pytest.mark.parametrize("path", FAMILY_TABLES, ids=_rel)
def test_the_families_table_is_the_registry(path):
    from cpvlm.hf import registry
    from cpvlm.hf.registration import ADAPTERS

    adapter_of_class = {c: a for a in ADAPTERS for c in a.model_classes}
    adapter_of_tiny = registry.tiny_adapters()
    rows = _families_table(path)
    names = [n for tiny, _ in rows for n in tiny]
    classes = [c for _, cs in rows for c in cs]
    assert sorted(names) == sorted(registry.tiny_models()), "a family without a row, or a stale one"
    assert sorted(classes) == registry.supported(), "a model class without a row, or a stale one"
    for tiny, cs in rows:  # a row's tiny models and classes are the same families'
        assert {adapter_of_tiny[n] for n in tiny} == {adapter_of_class[c] for c in cs}, (tiny, cs)


def _runnable_blocks() -> list[tuple[str, str, str]]:
    """``(where, language, code)`` of every fenced block right after the runnable marker."""
    blocks = []
    for path in [README, *PAGES]:
        pattern = re.escape(RUNNABLE) + r"\n```(\w+)\n(.*?)```"
        for m in re.finditer(pattern, path.read_text(), re.S):
            line = path.read_text()[: m.start()].count("\n") + 1
            blocks.append((f"{_rel(path)}:{line}", m.group(1), m.group(2)))
    return blocks


def test_the_docs_mark_runnable_blocks():
    where = [w for w, _, _ in _runnable_blocks()]
    assert any(w.startswith("README.md") for w in where), where
    assert len(where) >= 2, where


@pytest.mark.parametrize("block", _runnable_blocks(), ids=lambda b: b[0])
def test_a_runnable_block_runs(block):
    where, language, code = block
    assert language in ("bash", "python"), f"{where}: runnable {language} block"
    cmd = ["bash", "-euo", "pipefail", "-c", code] if language == "bash" else [sys.executable]
    # This checkout's cpvlm, also for the `cpvlm` command of an installation elsewhere.
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    if language == "bash":
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    done = subprocess.run(
        cmd,
        input=code if language == "python" else None,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, f"{where} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"


def _slug(heading: str) -> str:
    """The anchor MkDocs (and GitHub) give a heading."""
    text = re.sub(r"[^\w\s-]", "", heading.strip().lower())
    return re.sub(r"[\s]+", "-", text)


@pytest.mark.parametrize("path", [README, *PAGES], ids=_rel)
def test_every_relative_link_resolves(path):
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # links in code are not links
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        assert dest.exists(), f"{_rel(path)}: {target} does not exist"
        if anchor and dest.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", dest.read_text(), re.M)
            assert anchor in {_slug(h) for h in headings}, f"{_rel(path)}: no heading #{anchor}"


def _gen():
    spec = importlib.util.spec_from_file_location("gen", ROOT / "docs" / "gen_benchmarks.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    return gen


def test_every_page_with_generated_tables_is_rendered():
    gen = _gen()
    marked = {p for p in [README, *PAGES] if "<!-- gen:" in p.read_text()}
    assert marked <= set(gen.PAGES), "add the page to PAGES in docs/gen_benchmarks.py"
    blocks = [m.group(2) for p in gen.PAGES for m in gen.BLOCK.finditer(p.read_text())]
    assert len(blocks) >= 28, blocks
    assert sorted(blocks) == sorted(gen.TABLES), "a table without a block, or a block twice"


@pytest.mark.parametrize("path", _gen().PAGES, ids=_rel)
def test_the_generated_benchmark_tables_equal_their_json(path):
    page = path.read_text()
    assert "<!-- gen:" in page
    assert _gen().render(page) == page, "run python docs/gen_benchmarks.py"


def _committed_files() -> list[Path]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [ROOT / name for name in out.split("\0") if name]


def test_no_committed_file_cites_a_file_outside_the_repository():
    # The design notes this project started from lived outside it; their content is
    # docs/architecture.md. The names are built from pieces so that this file does not match.
    design, style = "DES" + "IGN", "STY" + "LE"
    cited = [f"{design}.md", f"{design} section", f"{style}.md", "../" + "shared"]
    outside = re.compile("|".join(map(re.escape, cited)))
    found = []
    for path in _committed_files():
        if path.is_symlink() or not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue  # a binary file
        found += [f"{_rel(path)}: {m.group(0)}" for m in outside.finditer(text)]
    assert not found, found


def test_the_readme_stays_short_and_its_test_command_builds_the_docs():
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, "the README links to docs/ pages; put the detail there"
    command = lines[lines.index("<!-- test-command -->") + 2]
    assert "mkdocs build --strict" in command, command
