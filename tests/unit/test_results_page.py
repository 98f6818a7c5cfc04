"""benchmarks/page.py: RESULTS.md as one current page, rewritten a section at a time."""

from benchmarks import page

RUN_A = "`python -m benchmarks.run`, 2026-12-01 22:59 UTC, commit abc1234"
RUN_B = "`python -m benchmarks.run --sections 2`, 2026-12-06 10:00 UTC, commit def5678"


def _page() -> page.Page:
    lines = ["## 1. Throughput", "", "| a | b |", "|---|---|", "| 1 | 2 |", "",
             "## 2. TTFT", "", "### Alone", "", "text"]  # fmt: skip
    return page.Page(tuple(page.sections_of(lines, RUN_A)), {RUN_A: ("- Machine: x",)})


def test_render_and_parse_are_inverse() -> None:
    p = _page()
    text = page.render(p)
    assert text.startswith(page.TITLE + "\n")
    assert f"_Run: {RUN_A}_" in text and f"### {RUN_A}" in text
    assert page.parse(text) == p
    assert page.parse("# an old page\n\n## 1. x\n") == page.Page()  # not this layout: empty


def test_a_partial_run_replaces_its_sections_and_retires_the_old_ones(tmp_path) -> None:
    old = _page()
    new = page.sections_of(["## 2. TTFT", "", "new figures"], RUN_B)
    merged, replaced = page.merge(old, new, RUN_B, ["- Machine: y"])
    assert [(s.number, s.run) for s in sorted(merged.sections, key=lambda s: s.number)] == [
        (1, RUN_A),
        (2, RUN_B),
    ]
    text = page.render(merged)
    assert "new figures" in text and "### Alone" not in text
    assert f"### {RUN_A}" in text and f"### {RUN_B}" in text  # both runs still named
    path = page.retire(replaced, old.runs, tmp_path / "history", "2026-12-06")
    assert path is not None and "### Alone" in path.read_text()
    assert "> - Machine: x" in path.read_text()
    # a run whose sections were all replaced drops out of the runs list
    again, _ = page.merge(merged, page.sections_of(["## 1. Throughput", "", "z"], RUN_B), RUN_B, [])
    assert f"### {RUN_A}" not in page.render(again)


def test_write_keeps_what_it_replaces(tmp_path) -> None:
    out = tmp_path / "RESULTS.md"
    out.write_text("# an appended-runs page\n\n## 1. x\n\nold text\n")  # another layout
    page.write(out, page.sections_of(["## 1. Throughput", "", "a"], RUN_A), RUN_A, [], "2026-12-06")
    assert "old text" in (tmp_path / "history" / "2026-12-06-RESULTS-before.md").read_text()
    page.write(out, page.sections_of(["## 1. Throughput", "", "b"], RUN_B), RUN_B, [], "2026-12-07")
    assert page.parse(out.read_text()).sections[0].body == ("b",)
    assert "\na\n" in (tmp_path / "history" / "2026-12-07.md").read_text()
