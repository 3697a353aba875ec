"""MkDocs hooks of the documentation site (``mkdocs.yml``): the pages generated at build time,
so none of them is maintained by hand.

- ``reference/config.md``: every config key with its type, default and help, from the config
  dataclasses (:func:`recsys.config.config_reference`, what ``recsys config --reference``
  prints);
- ``reference/cli.md``: every ``recsys`` command's ``--help``;
- ``benchmarks/<topic>.md``: one page per ``benchmarks/results/<topic>.csv``, its latest run's
  rows as a table (:func:`latest_rows`), the topic's description from ``benchmarks/README.md``,
  and the whole CSV beside it (``benchmarks/<topic>.csv``) to download.

The functions here are plain Python (no MkDocs import) so the tests can call them.
"""

from __future__ import annotations

import csv
import os
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
HIDDEN_COLUMNS = ("versions", "timestamp")  # said once above the table
MAX_ROWS = 200


def topics() -> list[str]:
    """The benchmark topics that have results, by file name."""
    return sorted(path.stem for path in RESULTS.glob("*.csv"))


def latest_rows(topic: str) -> tuple[list[str], list[dict[str, str]]]:
    """The columns of ``topic``'s CSV and the rows of its latest run: those of the last row's
    commit (a benchmark run appends all its rows under one commit)."""
    with open(RESULTS / f"{topic}.csv", newline="") as handle:
        reader = csv.DictReader(handle)
        rows = list(reader)
        columns = list(reader.fieldnames or [])
    if not rows or "commit" not in columns:
        return columns, rows
    commit = rows[-1]["commit"]
    return columns, [row for row in rows if row["commit"] == commit]


def topic_descriptions() -> dict[str, tuple[str, str]]:
    """``topic -> (module, what it compares)`` from the table of ``benchmarks/README.md``."""
    out = {}
    for line in (REPO / "benchmarks" / "README.md").read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`results/"):
            topic = cells[0].strip("`").removeprefix("results/").removesuffix(".csv")
            out[topic] = (cells[1], cells[2])
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def topic_page(topic: str) -> str:
    """The Markdown page of one benchmark topic."""
    columns, rows = latest_rows(topic)
    module, compares = topic_descriptions().get(topic, ("", ""))
    out = [f"# {topic}", ""]
    if module:
        out += [f"Written by `benchmarks/{module.strip('`')}`: {compares}", ""]
    out += [f"All rows, every run: [{topic}.csv]({topic}.csv).", ""]
    if not rows:
        return "\n".join([*out, "No rows yet.", ""])
    shown = [c for c in columns if c not in HIDDEN_COLUMNS]
    first = rows[0]
    said = [f"`{c}` {first[c]}" for c in HIDDEN_COLUMNS if c in first]
    out += [
        f"The latest run: {len(rows)} rows of commit `{first.get('commit', '?')}` "
        f"({'; '.join(said)}).",
        "",
        "| " + " | ".join(shown) + " |",
        "| " + " | ".join("---" for _ in shown) + " |",
    ]
    for row in rows[:MAX_ROWS]:
        out.append("| " + " | ".join(_cell(row.get(c) or "") for c in shown) + " |")
    if len(rows) > MAX_ROWS:
        out += ["", f"({len(rows) - MAX_ROWS} more rows of this run in the CSV.)"]
    return "\n".join(out) + "\n"


def benchmarks_index() -> str:
    """The list of topic pages, for the benchmarks overview."""
    descriptions = topic_descriptions()
    out = ["| topic | compares |", "| --- | --- |"]
    for topic in topics():
        compares = descriptions.get(topic, ("", ""))[1]
        out.append(f"| [{topic}]({topic}.md) | {_cell(compares)} |")
    return "\n".join(out) + "\n"


def cli_reference() -> str:
    """Every command's ``--help`` at 100 columns, as ``recsys <command> --help`` prints it."""
    from recsys.cli import help_pages

    os.environ["COLUMNS"] = "100"
    out = ["# Command line", "", "Generated from `recsys --help` and each command's `--help`.", ""]
    for command, text in help_pages().items():
        out += [f"## recsys {command}".rstrip(), "", "```text", text.rstrip(), "```", ""]
    return "\n".join(out)


def columns_table() -> str:
    """The table of what each CSV column means, from ``benchmarks/README.md``."""
    lines = (REPO / "benchmarks" / "README.md").read_text().splitlines()
    start = lines.index("| column | meaning |")
    end = next(i for i in range(start, len(lines)) if not lines[i].startswith("|"))
    return "\n".join(lines[start:end]) + "\n"


MARKERS = {  # <!-- name --> in a page -> its generated Markdown
    "benchmark-topics": benchmarks_index,
    "benchmark-columns": columns_table,
}


# ---------------------------------------------------------------------------------------------
# MkDocs events


def on_config(config):
    """List every topic page under the nav's Benchmarks section, after its overview."""
    for entry in config["nav"]:
        if isinstance(entry, dict) and "Benchmarks" in entry:
            pages = entry["Benchmarks"]
            pages += [{"GPU runs": "benchmarks/gpu_check.md"}]
            pages += [{topic: f"benchmarks/{topic}.md"} for topic in topics()]
    return config


def on_files(files, config):
    """Add the generated pages and the result CSVs to the site."""
    from mkdocs.structure.files import File

    from recsys.config import config_reference

    generated = {
        "reference/config.md": config_reference(),
        "reference/cli.md": cli_reference(),
    }
    for topic in topics():
        generated[f"benchmarks/{topic}.md"] = topic_page(topic)
        generated[f"benchmarks/{topic}.csv"] = (RESULTS / f"{topic}.csv").read_text()
    generated["benchmarks/gpu_check.md"] = (RESULTS / "gpu_check.md").read_text()
    for uri, content in generated.items():
        files.append(File.generated(config, uri, content=content))
    return files


def on_page_markdown(markdown, page, config, files):
    """Fill the ``<!-- name -->`` markers of MARKERS, and say above an example which short
    settings the test suite runs it with (``<!-- example: run with ARGS -->``,
    ``scripts/docs_examples.py``)."""
    for name, make in MARKERS.items():
        marker = f"<!-- {name} -->"
        if marker in markdown:
            markdown = markdown.replace(marker, make())
    return re.sub(
        r"^<!-- example: run with (.+) -->$",
        lambda m: f"*The docs' tests run this with `{m.group(1)}` appended to `recsys train`.*\n",
        markdown,
        flags=re.M,
    )
