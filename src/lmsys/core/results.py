"""The one renderer: a `Report` (meta lines + rows + notes) -> Rich table, Markdown, CSV or JSON.

Library functions build rows (plain dicts whose keys are column headings, in order) and never print.
Commands hand a `Report` to `render`, which writes to the terminal and, with `--output FILE`, to a file
(through `lmsys.core.files`: whole or not at all, devices and pipes written directly).
"""

from __future__ import annotations

import csv
import functools
import io
import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmsys.core.files import check_output_path, write_atomic  # noqa: F401 - the names commands import from here
from lmsys.core.parsing import choose

FORMATS = ("table", "md", "csv", "json")

# A cell's two kinds of missing value: None (nothing to measure there: a dim of size 1, no GPU peak),
# shown "—" (empty in CSV, null in JSON); NOT_MEASURED (there is something, but this row's implementation
# does not let lmsys measure it: torch's pipelining hides its compute time), shown "n/m" in every format.
# A plain string, so that it survives the JSON a rank's rows travel in.
NOT_MEASURED = "n/m"


@dataclass(frozen=True)
class MeanStd:
    """A timing cell: shown as 'mean ± std', expanded into two columns in CSV and JSON. `median`, where the
    samples were kept, is for callers that hold a prediction against the cell (plan validate); not shown."""

    mean: float
    std: float
    median: float | None = field(default=None, compare=False)

    def __str__(self) -> str:
        mean = _fmt(self.mean)
        decimals = len(mean.split(".")[1]) if "." in mean and "e" not in mean else 0
        return f"{mean} ± {self.std:.{decimals}f}"


@dataclass
class Report:
    title: str
    rows: list[dict[str, Any]]
    meta: dict[str, Any] = field(default_factory=dict)  # what makes the run reproducible
    notes: list[str] = field(default_factory=list)
    # On the terminal only: (heading, columns) shown as one column of 'a/b/c' cells where the first of
    # them stands (a wide table stays readable); Markdown, CSV and JSON keep every column.
    groups: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)

    @property
    def columns(self) -> list[str]:
        cols: dict[str, None] = {}
        for row in self.rows:
            cols.update(dict.fromkeys(row))
        return list(cols)

    def terminal_view(self) -> tuple[list[str], list[dict[str, Any]]]:
        """(columns, rows) with each group's columns joined into one (groups whose columns are absent skip)."""
        cols, rows = self.columns, [dict(r) for r in self.rows]
        for heading, members in self.groups:
            if not all(m in cols for m in members):
                continue
            at = cols.index(members[0])
            cols = [c for c in cols if c not in members]
            cols.insert(at, heading)
            for row in rows:
                row[heading] = "/".join(_short(row.get(m)) for m in members)
        return cols, rows


def _fmt(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, MeanStd):
        return str(value)
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value):
            return "—"
        if math.isinf(value):
            return "inf"
        a = abs(value)
        if a == 0:
            return "0"
        if a >= 1000:
            return f"{value:,.0f}"
        if a >= 100:
            return f"{value:.1f}"
        if a >= 1:
            return f"{value:.2f}"
        if a >= 1e-3:
            return f"{value:.4f}"
        return f"{value:.2e}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _short(value: Any) -> str:
    """A grouped cell's part: 3 significant digits for floats."""
    if isinstance(value, float) and not isinstance(value, bool) and math.isfinite(value):
        return f"{value:.3g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return _fmt(value)


def _plain(value: Any) -> Any:
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    return value


@functools.cache
def _pipe_format():
    """GitHub's pipe table as the docs show it: cells unpadded, a fixed `|---|` rule under the header."""
    from tabulate import DataRow, TableFormat

    row = DataRow("|", "|", "|")
    return TableFormat(
        lineabove=None,
        linebelowheader=lambda widths, _aligns: "|" + "|".join("---" for _ in widths) + "|",
        linebetweenrows=None,
        linebelow=None,
        headerrow=row,
        datarow=row,
        padding=1,
        with_header_hide=None,
    )


def markdown_table(headers: list[str], cells: list[list[str]]) -> str:
    """A pipe table of already formatted strings, rendered by tabulate without number parsing or
    alignment: `_fmt` decides how a number reads, and the tables in the docs stay byte for byte."""
    from tabulate import tabulate

    def cell(text: str) -> str:  # a pipe inside a cell (`|Δloss|`) would end it: escaped, as GitHub reads it
        return text.replace("|", "\\|")

    return tabulate([[cell(c) for c in row] for row in cells], headers=[cell(h) for h in headers],
                    tablefmt=_pipe_format(), disable_numparse=True, stralign=None, numalign=None)


def to_markdown(report: Report) -> str:
    out = io.StringIO()
    out.write(f"### {report.title}\n\n")
    for key, value in report.meta.items():
        out.write(f"- **{key}**: {_fmt(value)}\n")
    if report.meta:
        out.write("\n")
    cols = report.columns
    if cols:
        out.write(markdown_table(cols, [[_fmt(row.get(c)) for c in cols] for row in report.rows]) + "\n")
    for note in report.notes:
        out.write(f"\n{note}\n")
    return out.getvalue()


def to_csv(report: Report | list[Report]) -> str:
    """Plain CSV, the header first (csv.reader, pandas.read_csv, spreadsheets read it as it is): the rows only;
    the run's metadata and notes are in the Markdown and JSON formats. A mean ± std cell is two columns (`ms`,
    `ms std`). Several reports are one table whose first column, `table`, is each row's report title."""
    reports = [report] if isinstance(report, Report) else list(report)
    several = len(reports) > 1
    columns: dict[str, None] = {}
    for one in reports:
        columns.update(dict.fromkeys(one.columns))
    rows = [(one, row) for one in reports for row in one.rows]
    pairs = {c for c in columns if any(isinstance(row.get(c), MeanStd) for _, row in rows)}
    header = ["table"] if several else []
    for c in columns:
        header += [c, f"{c} std"] if c in pairs else [c]
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(header)
    for one, row in rows:
        cells: list[Any] = [one.title] if several else []
        for c in columns:
            v = row.get(c)
            if c in pairs:
                cells += [v.mean, v.std] if isinstance(v, MeanStd) else [_plain(v), None]
            else:
                cells.append(_plain(v))
        writer.writerow(["" if c is None else c for c in cells])
    return out.getvalue()


def _json_doc(report: Report) -> dict:
    def conv(v: Any) -> Any:
        if isinstance(v, MeanStd):
            return {"mean": _plain(v.mean), "std": _plain(v.std)}
        return _plain(v)

    return {
        "title": report.title,
        "meta": {k: conv(v) for k, v in report.meta.items()},
        "rows": [{k: conv(v) for k, v in row.items()} for row in report.rows],
        "notes": report.notes,
    }


def to_json(report: Report) -> str:
    return json.dumps(_json_doc(report), indent=2, default=str) + "\n"


def print_rich(report: Report, file=None) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    out = file or sys.stdout
    # On a terminal, Rich fits its width; into a pipe or file, keep rows on one line for pasting.
    console = Console(file=out, width=None if out.isatty() else 250)
    for key, value in report.meta.items():
        console.print(f"[dim]{key}:[/dim] {escape(_fmt(value))}", highlight=False, soft_wrap=True)
    table = Table(title=report.title, title_justify="left", header_style="bold")
    cols, rows = report.terminal_view()
    grouped = {heading for heading, _ in report.groups}
    for c in cols:
        numeric = all(isinstance(r.get(c), (int, float, MeanStd, type(None))) or r.get(c) == NOT_MEASURED
                      for r in rows)
        table.add_column(c, justify="right" if numeric or c in grouped else "left", no_wrap=numeric or c in grouped)
    for row in rows:
        table.add_row(*(Text(_fmt(row.get(c))) for c in cols))  # cells are text, not Rich markup: "[hf]" stays
    console.print(table)
    for note in report.notes:
        console.print(note, highlight=False, soft_wrap=True, markup=False)


NON_FINITE_LOSS = "non-finite loss"  # a row's status when its loss is NaN or infinite: a failed row


def outcome(reports: Report | list[Report]) -> str | None:
    """What makes a run with these rows a failure (exit 1), in one line, or None: rows whose status is an
    error, `wrong (...)` (a checked result that is not right) or a non-finite loss; or every row out of memory (an OOM row beside rows that ran is a result:
    the largest sizes of a sweep are expected not to fit)."""
    rows = [row for report in ([reports] if isinstance(reports, Report) else reports) for row in report.rows]
    statuses = [str(row.get("status", "")) for row in rows]
    failed = [s for s in statuses if s.startswith(("error", "wrong")) or s == NON_FINITE_LOSS]
    if failed:
        return f"{len(failed)} of {len(rows)} rows failed; the status column says why"
    if rows and all(s.startswith("OOM") for s in statuses):
        return "every row ran out of memory"
    return None


_RENDERERS = {"md": to_markdown, "csv": to_csv, "json": to_json}


def format_for_path(path: str | os.PathLike) -> str:
    suffix = Path(path).suffix.lower().lstrip(".")
    return {"csv": "csv", "json": "json"}.get(suffix, "md")


def check_format(fmt: str | None) -> str | None:
    """None (not given): a table on stdout, and the --output file's format from its extension."""
    return None if fmt is None else choose(fmt, FORMATS, what="--format")


EXTENSIONS = {"csv": "csv", "json": "json", "md": "md", "markdown": "md"}


def check_format_for_output(fmt: str | None, output: str | os.PathLike | None) -> None:
    """`-f csv -o out.json` is a contradiction, refused before any work (one line, exit 2), not CSV written
    into a .json file. An extension that names no format (.txt, none, /dev/stdout) takes what --format says."""
    if output is None or fmt in (None, "table"):
        return
    suffix = Path(os.fspath(output)).suffix.lower().lstrip(".")
    named = EXTENSIONS.get(suffix)
    if named is not None and named != fmt:
        from lmsys.core.errors import LmsysError

        raise LmsysError(f"--format {fmt} and --output {output} disagree: a .{suffix} file holds {named}",
                         hint=f"leave out --format (the extension picks {named}), or name the file .{fmt}")


def _text(reports: list[Report], fmt: str) -> str:
    if fmt == "json" and len(reports) > 1:
        return json.dumps([_json_doc(r) for r in reports], indent=2, default=str) + "\n"
    if fmt == "csv":
        return to_csv(reports)
    return "\n".join(_RENDERERS[fmt](r) for r in reports)


def render(reports: Report | list[Report], fmt: str | None = None, output: str | os.PathLike | None = None) -> None:
    """Print the report(s) in `fmt` to stdout; with `output`, also write them there (format from `fmt`,
    or from the file's extension when `fmt` is None or 'table': .json, .csv, else Markdown)."""
    fmt = check_format(fmt) or "table"
    reports = [reports] if isinstance(reports, Report) else list(reports)
    if fmt == "table":
        for report in reports:
            print_rich(report)
    else:
        sys.stdout.write(_text(reports, fmt))
    if output is not None:
        write_atomic(output, _text(reports, fmt if fmt != "table" else format_for_path(output)))
