"""Human-readable curation reports (rich tables)."""

from __future__ import annotations

from collections.abc import Mapping

import msgspec
from rich.console import Console
from rich.table import Table

__all__ = ["render_summary"]


def render_summary(reports: Mapping[str, msgspec.Struct], *, console: Console | None = None) -> str:
    """One row per curation pass (total -> kept); prints to `console` and returns the text."""
    table = Table(title="curation")
    for col in ("pass", "total", "kept", "removed"):
        table.add_column(col, justify="left" if col == "pass" else "right")
    for name, rep in reports.items():
        total, kept = getattr(rep, "total"), getattr(rep, "kept")  # noqa: B009
        table.add_row(name, str(total), str(kept), str(total - kept))
    con = console or Console(record=True, width=100)
    with con.capture() as cap:
        con.print(table)
    text = cap.get()
    if console is not None:
        console.print(table)
    return text
