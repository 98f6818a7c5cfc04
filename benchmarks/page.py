"""benchmarks/RESULTS.md as one current page: every section holds the latest run of it and names
that run on its first line; a list of the runs on the page (their machine, versions, settings)
closes it. `python -m benchmarks.run --sections ...` rewrites the sections it measured and
keeps the others as they were, each still naming its own run; the text a section replaces is
appended to `benchmarks/history/<date>.md`, so the page never grows with appended runs.

`render` and `parse` are each other's inverse (`parse(render(p)) == p`), so a partial run can
read the page back, `merge` its sections in and write it again.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path

TITLE = "# batchmlx benchmark results"
RUNS_HEADING = "## Runs on this page"
INTRO = (
    "One current page. Every section holds the latest run of it, named on its first line: the "
    "command, when, the commit where known. `python -m benchmarks.run [--sections N,...]` "
    "measures the sections it is given and rewrites this page: those sections from the new run, "
    "the others kept as they were, still naming their own run; the text a section replaces goes "
    "to `benchmarks/history/` (one file a day). Earlier runs, verbatim: "
    "[history/](history/). The machine, versions and settings of each run named here: "
    "[Runs on this page](#runs-on-this-page)."
)
_HEADING = re.compile(r"^## (\d+)\. (.+)$")
_RUN = re.compile(r"^_Run: (.+)_$")


@dataclass(frozen=True)
class Section:
    number: int
    title: str
    run: str  # the run it comes from: a key of Page.runs
    body: tuple[str, ...]  # markdown lines, no "## " heading among them

    def text(self) -> list[str]:
        body = [("#" + ln if ln.startswith("## ") else ln) for ln in self.body]
        return [f"## {self.number}. {self.title}", "", f"_Run: {self.run}_", "", *body]


@dataclass(frozen=True)
class Page:
    sections: tuple[Section, ...] = ()
    runs: dict[str, tuple[str, ...]] = field(default_factory=dict)  # run -> its environment


def _strip(lines: list[str]) -> tuple[str, ...]:
    while lines and not lines[0].strip():
        lines = lines[1:]
    while lines and not lines[-1].strip():
        lines = lines[:-1]
    return tuple(lines)


def render(page: Page) -> str:
    """The page's markdown: the title, how the page is made, the sections in order, the runs."""
    out = [TITLE, "", INTRO, ""]
    for s in sorted(page.sections, key=lambda s: s.number):
        out += [*s.text(), ""]
    out += [RUNS_HEADING, ""]
    used = {s.run for s in page.sections}
    for run, env in page.runs.items():
        if run in used:
            out += [f"### {run}", "", *env, ""]
    return "\n".join(out).rstrip() + "\n"


def parse(text: str) -> Page:
    """The page `render` wrote, read back; an empty page for any other text (an old layout)."""
    lines = text.splitlines()
    if RUNS_HEADING not in lines:
        return Page()
    end = lines.index(RUNS_HEADING)
    sections: list[Section] = []
    starts = [i for i, ln in enumerate(lines[:end]) if _HEADING.match(ln)] + [end]
    for a, b in zip(starts, starts[1:], strict=False):
        m = _HEADING.match(lines[a])
        run = _RUN.match(lines[a + 2]) if a + 2 < b else None
        if m and run:
            body = _strip(lines[a + 3 : b])
            sections.append(Section(int(m.group(1)), m.group(2), run.group(1), body))
    runs: dict[str, tuple[str, ...]] = {}
    heads = [i for i, ln in enumerate(lines) if i > end and ln.startswith("### ")]
    for a, b in zip(heads, [*heads[1:], len(lines)], strict=False):
        runs[lines[a][4:]] = _strip(lines[a + 1 : b])
    return Page(tuple(sections), runs)


def merge(old: Page, new: list[Section], run: str, env: list[str]) -> tuple[Page, list[Section]]:
    """`old` with `new`'s sections (all from `run`) in place of their numbers; also the sections
    replaced, for the history."""
    mine = {s.number for s in new}
    replaced = [s for s in old.sections if s.number in mine]
    kept = [s for s in old.sections if s.number not in mine]
    runs = {**old.runs, run: tuple(env)}
    return Page(tuple(kept + [replace(s, run=run) for s in new]), runs), replaced


def retire(replaced: list[Section], runs: dict[str, tuple[str, ...]], history: Path,
           date: str) -> Path | None:  # fmt: skip
    """Append the replaced sections, and their runs' environment, to history/<date>.md."""
    if not replaced:
        return None
    history.mkdir(parents=True, exist_ok=True)
    path = history / f"{date}.md"
    out = [] if path.exists() else [f"# Benchmark sections replaced on {date}", ""]
    for s in replaced:
        out += [*s.text(), "", *(f"> {ln}" for ln in runs.get(s.run, ())), ""]
    with path.open("a") as f:
        f.write("\n".join(out) + "\n")
    return path


def sections_of(lines: list[str], run: str) -> list[Section]:
    """Sections from a run's markdown lines, each starting at a "## N. Title" heading."""
    out: list[Section] = []
    starts = [i for i, ln in enumerate(lines) if _HEADING.match(ln)] + [len(lines)]
    for a, b in zip(starts, starts[1:], strict=False):
        m = _HEADING.match(lines[a])
        assert m is not None
        out.append(Section(int(m.group(1)), m.group(2), run, _strip(lines[a + 1 : b])))
    return out


def write(out: Path, new: list[Section], run: str, env: list[str], date: str) -> None:
    """Rewrite the page `out` with `new` (all from `run`) in place of the sections of the same
    numbers. For benchmarks/RESULTS.md the replaced sections go to history/<date>.md beside it,
    and a page in another layout, which cannot be merged, is kept there whole first."""
    text = out.read_text() if out.exists() else ""
    old = parse(text)
    merged, replaced = merge(old, new, run, env)
    if out.name == "RESULTS.md":
        history = out.parent / "history"
        if text.strip() and not old.sections:
            history.mkdir(parents=True, exist_ok=True)
            (history / f"{date}-{out.stem}-before.md").write_text(text)
        retire(replaced, old.runs, history, date)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(merged))
