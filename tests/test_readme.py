"""The README's quickstart stays true (CI runs its test command), and the README stays an overview
whose links lead somewhere. Its example is run by tests/test_docs.py; examples/ by tests/test_examples.py."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _bash_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def test_quickstart_has_exactly_the_two_commands_and_ci_runs_the_test_one() -> None:
    quickstart = _bash_blocks()[:2]
    install_and_run, run_tests = (block.strip() for block in quickstart)
    assert "\n" not in install_and_run and install_and_run.endswith("lightning-scale-train")
    assert "\n" not in run_tests and run_tests.endswith("python -m pytest")
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert run_tests in ci, ".ci/run must run the README's test command verbatim"
    assert "constraints.txt" in install_and_run and "constraints.txt" in run_tests


def test_constraints_pin_the_cpu_torch_build() -> None:
    lines = [
        l.strip() for l in (ROOT / "constraints.txt").read_text().splitlines() if l.strip() and not l.startswith("#")
    ]
    assert lines == ["torch==2.13.0"]


def test_the_readme_stays_an_overview() -> None:
    # The reference lives in docs/ (a page per capability); the README says what the package is.
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines: move the detail into a docs/ page"


def _slug(heading: str) -> str:
    """The anchor Python-Markdown's toc extension (MkDocs) gives a heading."""
    text = unicodedata.normalize("NFKD", re.sub(r"`", "", heading)).encode("ascii", "ignore").decode()
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", text).strip().lower())


def test_every_readme_link_leads_to_a_file_and_heading_that_exist() -> None:
    # mkdocs checks the links between docs pages; the README is not one of them.
    readme = (ROOT / "README.md").read_text()
    links = [t for t in re.findall(r"\]\(([^)\s]+)\)", readme) if not re.match(r"[a-z]+://", t)]
    assert len(links) > 20, links
    for target in links:
        path, _, anchor = target.partition("#")
        assert (ROOT / path).exists(), f"README.md links to {target}, which does not exist"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", (ROOT / path).read_text(), flags=re.M)
            assert anchor in {_slug(h) for h in headings}, f"README.md links to {target}: no such heading in {path}"
    assert _slug('Which checkpoint is "latest"') == "which-checkpoint-is-latest"
