"""The README is a front door and the manual is generated where it can be: the README stays
short, its links resolve, its headline numbers are the results files' (``scripts/headline.py``),
and the docs site's generated pages (benchmark topics, command line) build from what is there.
``make docs`` builds the site with warnings as errors (broken links and anchors), in ``make
test``."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s#]+)(#[^)\s]*)?\)")


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_readme_is_a_front_door_under_300_lines():
    assert len((REPO / "README.md").read_text().splitlines()) < 300


def test_every_relative_link_of_the_readme_resolves():
    for target, _ in LINK.findall((REPO / "README.md").read_text()):
        if "://" not in target:
            assert (REPO / target).exists(), f"README.md links to missing {target}"


def test_the_readme_headline_numbers_are_the_results_files():
    headline = _script("headline")
    readme = (REPO / "README.md").read_text()
    for begin, end, make in headline.BLOCKS:
        assert headline.readme_block(readme, begin, end) == make(), (
            f"README.md's {begin} block differs from benchmarks/results: "
            "run `python scripts/headline.py --write`"
        )


def test_a_headline_pairs_rows_of_one_run(tmp_path, monkeypatch):
    """The peer's row comes from the same commit and device, the one written nearest."""
    headline = _script("headline")
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    (results / "t.csv").write_text(
        "provider,config,commit,device,ms\n"
        "peer,a,c1,d,10\nours,a,c1,d,5\n"  # run 1
        "ours,a,c2,d,4\n"  # run 2: no peer row
        "peer,a,c3,d,9\nours,a,c3,x,1\n"  # run 3: other devices
        "peer,a,c1,d,99\n"  # a later peer row of commit c1, farther from ours
    )
    monkeypatch.setattr(headline, "REPO", tmp_path)
    item = headline.Headline("w", "t", {"config": "a"}, "ours", "peer", "ms", "ms", False)
    (line, ours), theirs = headline.pair(item)
    assert (line, ours["ms"], theirs["ms"]) == (3, "5", "10")
    missing = headline.Headline("w", "t", {"config": "b"}, "ours", "peer", "ms", "ms", False)
    with pytest.raises(LookupError):
        headline.pair(missing)


def test_benchmark_pages_show_the_latest_run_of_every_results_file():
    hooks = _script("docs_hooks")
    assert hooks.topics(), "no benchmarks/results/*.csv"
    for topic in hooks.topics():
        page = hooks.topic_page(topic)
        columns, rows = hooks.latest_rows(topic)
        assert page.startswith(f"# {topic}\n") and f"({topic}.csv)" in page
        if rows and "commit" in columns:
            assert f"commit `{rows[-1]['commit']}`" in page
            assert {row["commit"] for row in rows} == {rows[-1]["commit"]}
    index = hooks.benchmarks_index()
    assert all(f"({topic}.md)" in index for topic in hooks.topics())


def test_the_command_line_page_has_every_command():
    from recsys.cli import help_pages

    page = _script("docs_hooks").cli_reference()
    for command in help_pages():
        assert f"## recsys {command}".rstrip() + "\n" in page
    assert "recsys eval" in page and "usage: recsys train" in page


def test_every_example_of_the_docs_is_run_or_says_why_not():
    examples = _script("docs_examples")
    pages = {str(p.relative_to(REPO)) for p in (REPO / "docs").rglob("*.md")} | {"README.md"}
    assert pages == set(examples.PAGES), "scripts/docs_examples.PAGES must list every page"
    assert examples.check(list(examples.PAGES)) == []


def test_a_block_without_a_marker_and_a_broken_example_fail(tmp_path, monkeypatch):
    examples = _script("docs_examples")
    page = tmp_path / "page.md"
    page.write_text(
        "```bash\necho unmarked\n```\n\n<!-- example: not run: a reason -->\n```bash\nfalse\n```\n"
    )
    monkeypatch.setattr(examples, "REPO", tmp_path)
    (error,) = examples.check(["page.md"])
    assert error.startswith("page.md:1: a bash block without a marker")
    page.write_text(
        "<!-- example: run -->\n```bash\nmkdir -p out && echo ok > out/a\n```\n\n"
        "<!-- example: run -->\n```python\nfrom pathlib import Path\n"
        "x = Path('out/a').read_text()\n```\n\n"
        "<!-- example: run -->\n```python\nassert x == 'ok\\n'\n```\n\n"
        "<!-- example: run -->\n```bash\ncat out/missing   # a deliberately broken example\n```\n"
    )
    said = []
    (failure,) = examples.run(["page.md"], tmp_path / "work", say=said.append)
    assert failure.startswith("page.md:18: the example failed:") and "out/missing" in failure
    assert [line.split(" (")[0] for line in said] == [
        "ok   page.md:2",
        "ok   page.md:7",
        "ok   page.md:13",
        "FAIL page.md:18",
    ]


def test_short_settings_go_to_every_recsys_train_command():
    examples = _script("docs_examples")
    source = (
        "recsys train --config a.toml \\\n    --run.name=x   # note\n"
        "torchrun --nproc-per-node=2 -m recsys train --config a.toml &\n"
        "recsys export --checkpoint runs/x\n"
    )
    assert examples.with_args(source, "--train.max_steps=2") == (
        "recsys train --config a.toml      --run.name=x --train.max_steps=2  # note\n"
        "torchrun --nproc-per-node=2 -m recsys train --config a.toml --train.max_steps=2 &\n"
        "recsys export --checkpoint runs/x\n"
    )
