"""The documentation stays true: the site builds with ``mkdocs build --strict`` (a broken link, anchor,
include or API reference fails), every code block marked runnable runs, and the metric table names
exactly the keys the code logs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
RUNNABLE = "<!-- runnable -->"
"""Put on the line before a ```python fence: the block is run by this module (it does not render)."""


@dataclass(frozen=True)
class Block:
    where: str  # path:line of the fence
    code: str


def _fence(line: str) -> tuple[str, str] | None:
    """(backticks, info string) of a fence line, else None."""
    m = re.match(r"^(`{3,})\s*([^`]*)$", line.strip())
    return (m[1], m[2].strip()) if m else None


def runnable_blocks(text: str, name: str) -> list[Block]:
    """The ```python blocks of a Markdown text that follow a ``<!-- runnable -->`` line, outside other
    fences (a marker shown inside an example block is not one). A marker not followed by a python block
    is an error."""
    lines = text.splitlines()
    blocks, i, open_fence = [], 0, None
    while i < len(lines):
        fence = _fence(lines[i])
        if open_fence is not None:
            if fence and fence[0].startswith(open_fence) and not fence[1]:
                open_fence = None
        elif fence:
            open_fence = fence[0]
        elif lines[i].strip() == RUNNABLE:
            where = f"{name}:{i + 2}"
            nxt = _fence(lines[i + 1]) if i + 1 < len(lines) else None
            if not nxt or nxt[1].split()[:1] != ["python"]:
                raise ValueError(f"{where}: {RUNNABLE} must be followed directly by a ```python block")
            end = next(j for j in range(i + 2, len(lines)) if lines[j].strip() == nxt[0])
            blocks.append(Block(where, "\n".join(lines[i + 2 : end]) + "\n"))
            i = end
        i += 1
    return blocks


def _all_blocks() -> list[Block]:
    paths = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
    return [b for path in paths for b in runnable_blocks(path.read_text(), str(path.relative_to(ROOT)))]


BLOCKS = _all_blocks()


def test_the_runnable_blocks_are_found() -> None:
    where = {b.where.split(":")[0] for b in BLOCKS}
    assert "README.md" in where  # the README's "your own model" example
    assert len(where - {"README.md"}) >= 5, where
    # The parser sees through example fences: a marker shown inside a ````markdown block is not one.
    sample = "````markdown\n<!-- runnable -->\n```python\nraise SystemExit(1)\n```\n````\n<!-- runnable -->\n```python\nx = 1\n```\n"
    assert runnable_blocks(sample, "sample.md") == [Block("sample.md:8", "x = 1\n")]
    with pytest.raises(ValueError, match="must be followed directly by a ```python block"):
        runnable_blocks("<!-- runnable -->\n```bash\ntrue\n```\n", "sample.md")


def _several(block: Block) -> bool:
    """A block whose Trainer starts several processes (Lightning's launcher): ~20-50 s on 2 cores."""
    return bool("Trainer(" in block.code and re.search(r"\bdevices=([2-9]|\d\d)", block.code))


_RUN_ALL = """
import json, os, runpy, sys, traceback
results = {}
for where, script in json.loads(sys.argv[1]):
    os.chdir(os.path.dirname(script))
    try:
        runpy.run_path(script, run_name="__main__")
        results[where] = ""
    except BaseException:
        results[where] = traceback.format_exc()
print("RESULTS " + json.dumps(results))
"""


@pytest.fixture(scope="module")
def one_process_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The one-process blocks, each in its own empty directory, run one after the other in one fresh
    interpreter (a start-up of ~6 s each saved): what each block raised ('' when it ran)."""
    scripts = []
    for i, block in enumerate(b for b in BLOCKS if not _several(b)):
        script = tmp_path_factory.mktemp(f"block{i}") / "block.py"
        script.write_text(block.code)
        scripts.append((block.where, str(script)))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _RUN_ALL, json.dumps(scripts)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")), None)
    assert line is not None, f"the blocks' interpreter died:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(line.removeprefix("RESULTS "))


@pytest.mark.parametrize("block", [pytest.param(b, id=b.where) for b in BLOCKS if not _several(b)])
def test_runnable_block_runs(block: Block, one_process_results: dict[str, str]) -> None:
    """In an empty directory, as a reader copies it (the one-process blocks share an interpreter)."""
    assert one_process_results[block.where] == "", f"{block.where} failed:\n{one_process_results[block.where]}"


@pytest.mark.slow
@pytest.mark.parametrize("block", [pytest.param(b, id=b.where) for b in BLOCKS if _several(b)])
def test_runnable_block_with_several_processes_runs(block: Block, tmp_path: Path) -> None:
    """In a fresh process, in an empty directory: each block stands alone, as a reader copies it."""
    script = tmp_path / "block.py"
    script.write_text(block.code)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, f"{block.where} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's banner about MkDocs 2.0
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", str(site)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert "WARNING" not in proc.stderr, proc.stderr[-5000:]
    # The API reference comes from the docstrings; the examples page includes the scripts themselves.
    assert (
        'id="lightning_scale.strategies.HybridParallelStrategy"'
        in (site / "api" / "strategies" / "index.html").read_text()
    )
    assert (
        'id="lightning_scale.core.pipeline.spec.PipelineSpec"'
        in (site / "api" / "core-pipeline" / "index.html").read_text()
    )
    examples = (site / "examples" / "index.html").read_text()
    assert "tensor_parallel_plan" in examples and "lightning-scale-report" in examples
    assert "MyModel" in (site / "your-model" / "index.html").read_text()  # the README's example, included


def test_every_docs_page_is_in_the_navigation() -> None:
    # mkdocs only warns about a page left out of `nav` (validation.omitted_files, which --strict fails on);
    # this names it directly.
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert pages and not {p for p in pages if f": {p}" not in nav}, pages


# --- the metric table ------------------------------------------------------------------------------

_PREFIXES = "train|val|test|cost|energy|memory|pipeline|stragglers|health|checkpoint|precision|plan|goodput"


def _expand(name: str) -> list[str]:
    """``a/{x,y}`` -> ``a/x``, ``a/y``; a placeholder without commas (``stage{k}``) stays."""
    m = re.search(r"\{([^{}]*,[^{}]*)\}", name)
    if not m:
        return [name]
    return [n for alt in m[1].split(",") for n in _expand(name[: m.start()] + alt.strip() + name[m.end() :])]


def _pattern(name: str) -> re.Pattern[str]:
    """A name whose ``{...}`` placeholders match any one path segment part."""
    return re.compile(
        "".join("[^/]+" if part.startswith("{") else re.escape(part) for part in re.split(r"(\{[^{}]*\})", name))
    )


def _same(a: str, b: str) -> bool:
    return a == b or bool(_pattern(a).fullmatch(b)) or bool(_pattern(b).fullmatch(a))


def documented_metrics() -> set[str]:
    page = (DOCS / "telemetry.md").read_text()
    table = page[page.index("\n## Metrics") :]
    table = table[: table.index("\n## ", 1)]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    return {n for row in rows for name in re.findall(r"`([^`]+)`", row.split("|")[1]) for n in _expand(name)}


def logged_metrics() -> set[str]:
    """Every metric-like string literal in the package (f-string placeholders kept as ``{...}``)."""
    found = set()
    for path in (ROOT / "lightning_scale").rglob("*.py"):
        found |= set(re.findall(rf"[\"']((?:{_PREFIXES})/[A-Za-z0-9_/{{}}]*[A-Za-z0-9_}}])[\"']", path.read_text()))
    return found


def test_the_metric_table_names_exactly_what_the_code_logs() -> None:
    documented, logged = documented_metrics(), logged_metrics()
    assert len(documented) > 40 and len(logged) > 40, (documented, logged)
    undocumented = sorted(c for c in logged if not any(_same(c, d) for d in documented))
    assert not undocumented, f"logged but missing from docs/telemetry.md's metric table: {undocumented}"
    stale = sorted(d for d in documented if not any(_same(d, c) for c in logged))
    assert not stale, f"in docs/telemetry.md's metric table but logged nowhere: {stale}"


def test_the_metric_check_sees_a_difference() -> None:
    assert _expand("train/step_time/{data,comm}") == ["train/step_time/data", "train/step_time/comm"]
    assert _same("train/step_time/{p}", "train/step_time/data") and _same(
        "pipeline/stage{k}/idle", "pipeline/stage{k}/idle"
    )
    assert not _same("train/step_time/{p}", "train/tokens") and not _same("cost/usd", "cost/usd_per_1m_tokens")
