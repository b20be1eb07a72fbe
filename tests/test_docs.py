"""Every fenced code block of README.md and docs/*.md runs, so a doc cannot go stale.

A page's blocks run in order in one temporary folder (a later block may read what an earlier one
wrote, as a reader following the page would): ```bash blocks with ``bash -euo pipefail`` and the
venv's ``bin`` first on PATH, ```python blocks with the venv's python. A block that must not run
(a GPU, torchrun on several machines, a reader's own file, minutes of time) has the line
``<!-- not-run: REASON -->`` right before its opening fence; ```text blocks (output samples) never
run. Any other fence, or a not-run marker without a reason, fails the page. Blocks that need the
bundled example get it with ``python -m gradgraph.examples``.

A block whose reason is ``runs in docs/PAGE.md`` must appear, character for character, as a block
that runs on that page (the README's short examples that a topic page runs too). The pages run
concurrently, one per core: the whole takes about the CPU time of its longest pages.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN_TAGS = ("bash", "python")
NOT_RUN = re.compile(r"^<!--\s*not-run:(?P<reason>.*?)-->\s*$")
FENCE = re.compile(r"^(?P<indent>\s*)```(?P<tag>[^`\s]*)\s*$")
BLOCK_TIMEOUT_S = 120  # a block is meant to finish in ~30 s on a loaded 2-core machine
README_MAX_LINES = 250

# Running every page takes about 200 s of CPU (torch exports, data-parallel ranks, a Python
# start per command): the page runs are marked slow (CI runs them; `-m "not slow"` skips them).


@dataclasses.dataclass(frozen=True)
class Block:
    page: str
    line: int  # of the opening fence, 1-based
    tag: str
    code: str
    skip_reason: str | None  # the not-run marker's reason


class DocFormatError(ValueError):
    pass


def parse_blocks(text: str, page: str) -> list[Block]:
    """The fenced blocks of a Markdown page; an untagged fence (or one of another language) or a
    not-run marker without a reason raises :class:`DocFormatError` naming the line."""
    blocks: list[Block] = []
    lines = text.splitlines()
    k = 0
    while k < len(lines):
        match = FENCE.match(lines[k])
        if not match:
            k += 1
            continue
        tag, indent = match["tag"], match["indent"]
        if tag not in (*RUN_TAGS, "text"):
            raise DocFormatError(f"{page}:{k + 1}: a fence tagged {tag or 'nothing'!r}; tag it "
                                 "```bash or ```python (run by this test) or ```text (never run)")
        end = next((j for j in range(k + 1, len(lines)) if lines[j].strip() == "```"), None)
        if end is None:
            raise DocFormatError(f"{page}:{k + 1}: the fence is never closed")
        marker = NOT_RUN.match(lines[k - 1].strip()) if k else None
        reason = None
        if marker:
            reason = marker["reason"].strip()
            if not reason:
                raise DocFormatError(f"{page}:{k}: a not-run marker needs a reason: "
                                     "<!-- not-run: needs a GPU -->")
        elif k and "not-run" in lines[k - 1]:
            raise DocFormatError(f"{page}:{k}: malformed not-run marker {lines[k - 1].strip()!r}")
        code = "\n".join(line[len(indent):] if line.startswith(indent) else line
                         for line in lines[k + 1:end])
        if tag != "text":
            blocks.append(Block(page, k + 1, tag, code + "\n", reason))
        k = end + 1
    return blocks


def run_block(block: Block, cwd: Path) -> subprocess.CompletedProcess[str]:
    venv_bin = str(Path(sys.executable).parent)
    env = dict(os.environ, PATH=venv_bin + os.pathsep + os.environ.get("PATH", ""),
               MPLBACKEND="Agg", PYTHONWARNINGS="ignore::DeprecationWarning")
    env.pop("PYTHONPATH", None)  # as a reader's shell: the installed gradgraph
    script = cwd / f".block_{block.line}.{'sh' if block.tag == 'bash' else 'py'}"
    script.write_text(block.code)
    command = (["bash", "-euo", "pipefail", str(script)] if block.tag == "bash"
               else [sys.executable, str(script)])
    try:
        return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=BLOCK_TIMEOUT_S)
    finally:
        script.unlink(missing_ok=True)


RUNS_IN = re.compile(r"^runs in (?P<page>(?:docs/)?[\w.-]+\.md)$")


@dataclasses.dataclass(frozen=True)
class PageResult:
    failure: str | None  # the first failing block, its output
    seconds: float


def run_page(page: Path, cwd: Path) -> PageResult:
    """Run the page's blocks in order in ``cwd``; stop at the first that fails."""
    start = time.perf_counter()
    for block in parse_blocks(page.read_text(), page.name):
        if block.skip_reason is not None:
            continue
        began = time.perf_counter()
        proc = run_block(block, cwd)
        if proc.returncode != 0:
            return PageResult(
                f"{page.name}:{block.line}: the ```{block.tag} block exited {proc.returncode} "
                f"after {time.perf_counter() - began:.1f} s\n--- block ---\n{block.code}"
                f"--- stdout ---\n{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-3000:]}",
                time.perf_counter() - start)
    return PageResult(None, time.perf_counter() - start)


def _page_params() -> list[object]:
    return [pytest.param(page, id=page.name, marks=[pytest.mark.slow]) for page in PAGES]


@pytest.fixture(scope="module")
def page_results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[Path, PageResult]:
    """Every selected page run, the pages concurrently (a page's blocks in order)."""
    pages = [item.callspec.params["page"] for item in request.session.items
             if getattr(item, "originalname", "") == "test_every_block_of_the_page_runs"
             and item.module is sys.modules[__name__]]
    workers = max(1, min(len(pages), os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {page: pool.submit(run_page, page, tmp_path_factory.mktemp(page.stem))
                   for page in pages}
        return {page: future.result() for page, future in futures.items()}


@pytest.mark.parametrize("page", _page_params())
def test_every_block_of_the_page_runs(page: Path, page_results: dict[Path, PageResult]) -> None:
    result = page_results[page]
    assert result.failure is None, result.failure


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_fence_is_tagged_and_every_marker_has_a_reason(page: Path) -> None:
    parse_blocks(page.read_text(), page.name)  # raises DocFormatError naming the line (fast)


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_a_block_run_elsewhere_is_there_as_it_is(page: Path) -> None:
    for block in parse_blocks(page.read_text(), page.name):
        match = RUNS_IN.match(block.skip_reason or "")
        if not match:
            continue
        other = ROOT / match["page"] if match["page"].startswith("docs/") else page.parent / match["page"]
        runs = [b.code for b in parse_blocks(other.read_text(), other.name) if b.skip_reason is None]
        assert block.code in runs, (f"{page.name}:{block.line}: marked 'runs in {match['page']}', "
                                    "which runs no block with this text")


def test_readme_is_a_front_page_linking_every_docs_page() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    missing = [p.name for p in PAGES[1:] if f"docs/{p.name}" not in text]
    assert not missing, f"README.md links no {missing}"
    assert "bash tools/demo.sh" in text and "bash tools/test.sh" in text
    ci = (ROOT / ".ci" / "run").read_text()
    assert "bash tools/test.sh" in ci  # the test command README gives is the one CI runs


def test_links_between_pages_resolve() -> None:
    link = re.compile(r"\]\((?!https?://|#)(?P<target>[^)#\s]+)")
    broken = []
    for page in PAGES:
        for match in link.finditer(page.read_text()):
            if not (page.parent / match["target"]).exists():
                broken.append(f"{page.name}: {match['target']}")
    assert not broken, broken


def test_cli_page_lists_every_flag_of_every_sub_command() -> None:
    import argparse

    from gradgraph.cli.main import build_parser

    page = (ROOT / "docs" / "cli.md").read_text()
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    missing = [f"{name} {flag}" for name, parser in sub.choices.items()
               for action in parser._actions for flag in action.option_strings
               if flag not in ("-h", "--help") and f"`{flag}`" not in page.split(f"## `gradgraph {name}`")[-1]]
    assert not missing, f"docs/cli.md: flags not in their sub-command's section: {missing}"


# --- the parser's own rules: a page that breaks them fails -----------------------------------

def test_a_block_with_a_reason_is_skipped_and_the_others_collected() -> None:
    text = ("intro\n```bash\necho hi\n```\n<!-- not-run: needs a GPU -->\n```python\nimport x\n```\n"
            "```text\noutput\n```\n")
    blocks = parse_blocks(text, "p.md")
    assert [(b.tag, b.line, b.skip_reason) for b in blocks] == [("bash", 2, None),
                                                                 ("python", 6, "needs a GPU")]
    assert blocks[0].code == "echo hi\n"


@pytest.mark.parametrize(("text", "complaint"), [
    ("```\nls\n```\n", "tagged 'nothing'"),
    ("```sh\nls\n```\n", "tagged 'sh'"),
    ("<!-- not-run: -->\n```bash\nls\n```\n", "needs a reason"),
    ("<!-- not-run -->\n```bash\nls\n```\n", "malformed not-run marker"),
    ("```bash\nls\n", "never closed"),
])
def test_the_parser_refuses_an_untagged_fence_or_a_marker_without_reason(text: str, complaint: str) -> None:
    with pytest.raises(DocFormatError, match=complaint):
        parse_blocks(text, "p.md")


def test_a_failing_block_fails(tmp_path: Path) -> None:
    failing = Block("p.md", 1, "bash", "gradgraph --version\nfalse\necho never\n", None)
    proc = run_block(failing, tmp_path)
    assert proc.returncode != 0 and "gradgraph" in proc.stdout and "never" not in proc.stdout
    assert run_block(Block("p.md", 1, "python", "raise SystemExit(3)\n", None), tmp_path).returncode == 3
