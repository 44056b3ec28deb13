"""Tables for people, as the notebooks show them: units in the column names, thousands separators and no scientific
notation ('92,800', '0.0259'), a median and its 95% interval in one column ('92,800 [79,800, 94,800]'), where each
row comes from (CSV, commit, date) when a table joins several, and long tables folded behind a line per group with
every row a click away (HTML <details>).

    summary(rows, ["batch", "allocator"], ["tokens_per_s"])   # HTML text: medians [intervals] per group
    table(frame, full=rows)                                    # any frame, formatted, its full rows folded under it
"""
from __future__ import annotations

import html
import math

import pandas as pd

from . import intervals, sources
from .intervals import fmt_bytes

# column -> its label, with its unit
COLUMNS = {
    "tokens_per_s": "tokens/s",
    "host_ms_per_step": "host ms/step",
    "gpu_ms_per_step": "GPU ms/step",
    "ms_per_step": "ms/step",
    "dispatch_ms_per_step": "dispatch ms/step",
    "gpu_util_mean": "GPU busy (%)",
    "device_mallocs_per_step": "device mallocs/step",
    "device_mallocs_warm": "device mallocs once warm",
    "reserved_over_requested": "reserved/requested (×)",
    "us_per_pair": "µs/pair",
    "ns_per_pair": "ns/pair",
    "ratio_vs_cupy_pool": "vs CuPy pool (×)",
    "kpairs_per_s": "thousand pairs/s",
    "speedup": "speedup (×)",
    "size_bytes": "request size",
    "batch": "batch (sequences)",
    "world": "GPUs",
    "threads": "threads",
    "k": "k (classes per doubling)",
}
SOURCE = "source"   # a summary of several CSVs: its rows' numbers of the sources listed above it
MAX_ROWS = 2000    # the full rows shown at most
LONG = 16          # a summary of more rows than this is folded, one line per group of its first key
STYLE = ("<style>.xlab-table td {white-space: nowrap} .xlab-table summary {cursor: pointer; margin: 0.3em 0}"
         "</style>")


def label(column: str) -> str:
    """The column's name for people, with its unit ('tokens/s'); the name itself, spaced, where none is known."""
    return COLUMNS.get(column, str(column).replace("_", " "))


SUPERSCRIPT = str.maketrans("-0123456789", "⁻⁰¹²³⁴⁵⁶⁷⁸⁹")
TINY = 1e-4        # below this a number is written 1.20×10⁻⁹, not 0.00000000120


def number(v, sig: int = 3, decimals: int | None = None) -> str:
    """A number for people: `sig` significant digits (or `decimals` places), thousands separators, no e-notation:
    92,800, 1.49, 0.0259, 0, and a magnitude below TINY as 1.20×10⁻⁹ (errors of float64 checks); "n/a" for NaN."""
    if v is None or isinstance(v, str):
        return "n/a" if v is None else v
    v = float(v)
    if not math.isfinite(v):
        return "n/a"
    if v != 0 and abs(v) < TINY:
        exp = math.floor(math.log10(abs(v)))
        return f"{v / 10 ** exp:.{sig - 1}f}×10{str(exp).translate(SUPERSCRIPT)}"
    if decimals is None:
        decimals = places(v, sig)
    if decimals <= 0:
        return f"{round(v, decimals):,.0f}"
    return f"{v:,.{decimals}f}"


def places(v: float, sig: int = 3) -> int:
    """Decimal places that show `sig` significant digits of v (negative: rounded to tens, hundreds, ...)."""
    return 0 if v == 0 or not math.isfinite(v) else sig - 1 - math.floor(math.log10(abs(v)))


def interval(value: float, lo: float, hi: float) -> str:
    """'92,800 [79,800, 94,800]': the median to three significant digits and its bounds to the same places, a digit
    more (up to three) where two bounds that differ would print alike; '482 (single run)' without bounds."""
    if value is None or not math.isfinite(value):
        return "n/a"
    if value != 0 and abs(value) < TINY:
        return f"{number(value)} [{number(lo)}, {number(hi)}]" if math.isfinite(lo) and math.isfinite(hi) else \
            f"{number(value)} (single run)"
    d = places(value)
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return f"{number(value, decimals=d)} (single run)"
    for extra in range(4):
        if lo == hi or number(lo, decimals=d + extra) != number(hi, decimals=d + extra):
            d += extra
            break
    return f"{number(value, decimals=d)} [{number(lo, decimals=d)}, {number(hi, decimals=d)}]"


def cell(column: str, v) -> str:
    """One value of `column` for people: bytes as '64 KiB', dates as their day, booleans as yes/no, numbers as
    `number`, whole numbers with separators."""
    if isinstance(v, str):
        return v[:10] if column == "date" and len(v) >= 10 and v[4:5] == "-" else v
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    if isinstance(v, bool) or type(v).__name__ == "bool_":
        return "yes" if v else "no"
    if column == "size_bytes" or column.endswith("_bytes") and abs(float(v)) >= 1024:
        return fmt_bytes(float(v))
    if float(v) == int(float(v)) and abs(float(v)) < 1e15:
        return f"{int(float(v)):,}"
    return number(v)


def formatted(df: pd.DataFrame) -> pd.DataFrame:
    """Every value as `cell` gives it, the columns under their labels."""
    return pd.DataFrame({label(c): [cell(str(c), v) for v in df[c].tolist()] for c in df.columns})


def source_of(rows: pd.DataFrame) -> str:
    """'single_gpu_recheck.csv · a3c2c01 · 2026-11-30': the CSV(s), commit(s) and day(s) of these rows."""
    if "csv" not in rows:
        return "this run"
    parts = []
    for csv, g in rows.groupby("csv", sort=False):
        parts.append(f"{csv} · {sources.run_label(g)} · {sources.day_range(g['date'].dropna()) if 'date' in g else ''}"
                     .rstrip(" ·"))
    return "; ".join(parts)


def _html(df: pd.DataFrame) -> str:
    """A table that scrolls sideways where it is wider than the page, its cells unwrapped."""
    return f"<div style='overflow-x:auto'>{df.to_html(index=False, escape=True, border=0, classes='xlab-table')}</div>"


def table(df: pd.DataFrame | None, full: pd.DataFrame | None = None, group: str | None = None,
          lines: dict | None = None, caption: str = "") -> str | None:
    """HTML of `df` for people (`formatted`), folded one <details> per value of `group` when longer than LONG rows
    (`lines`: each group's summary line; default: the value and its number of rows), then `full`'s rows folded under
    "All N rows". None without rows."""
    if df is None or not len(df):
        return None
    text = STYLE + (f"<p>{html.escape(caption)}</p>" if caption else "")
    shown = formatted(df)
    if group is not None and group in df and len(df) > LONG:
        groups = []
        for key, idx in df.groupby(group, sort=False).groups.items():
            arm = sources.arm_column(df)
            line = (lines or {}).get(key) or f"{label(group)} {cell(group, key)}: " + (
                f"{df.loc[idx, arm].nunique()} {arm}s" if arm else f"{len(idx)} rows")
            groups.append((line, shown.iloc[df.index.get_indexer(idx)]))
        text += f"<p>{len(df)} rows in {len(groups)} groups by {html.escape(label(group))}; click one to open it.</p>"
        text += "".join(f"<details><summary>{html.escape(line)}</summary>{_html(g)}</details>" for line, g in groups)
    else:
        text += _html(shown)
    if full is not None and len(full):
        some = f"The first {MAX_ROWS:,} of {len(full):,} rows" if len(full) > MAX_ROWS else f"All {len(full):,} rows"
        text += (f"<details><summary>{some} ({html.escape(source_of(full))})</summary>"
                 f"{_html(formatted(full.head(MAX_ROWS)))}</details>")
    return text


def summary(df: pd.DataFrame | None, by, columns) -> str | None:
    """Medians [95% intervals] of `columns` per group of `by` (`interval`), with the trials, each row's source (its
    number in the list of CSVs, commits and dates above the table) where the rows join several CSVs or commits (else
    one caption), folded per value of by[0] when long, each fold's line giving the range of the first column's medians
    and their arms; every row a click away. None without rows."""
    if df is None or not len(df):
        return None
    by, columns = list(by), [c for c in columns if c in df]
    arm = sources.arm_column(df)
    several = "csv" in df and df.groupby(["csv", "commit"] if "commit" in df else ["csv"]).ngroups > 1
    rows, medians, numbered = [], [], {}
    for key, g in df.groupby(by, sort=False, dropna=False):
        key = key if isinstance(key, tuple) else (key,)
        row = dict(zip(by, key))
        stats = {c: intervals.median_ci(g[c])[:3] for c in columns}
        row.update({c: interval(*stats[c]) for c in columns})
        row["trials"] = len(g)
        if several:         # a number per source, listed above: the CSV, commit and date in each row made it too wide
            row[SOURCE] = ", ".join(f"[{numbered.setdefault(s, len(numbered) + 1)}]"
                                    for s in source_of(g).split("; "))
        rows.append(row)
        medians.append({**dict(zip(by, key)), **{c: stats[c][0] for c in columns}})
    out, med = pd.DataFrame(rows), pd.DataFrame(medians)
    lines = _spread_lines(med, by[0], arm, columns[0]) if columns and arm in by and by[0] != arm else None
    caption = ("Rows from " + "; ".join(f"[{n}] {s}" for s, n in numbered.items()) + "." if several
               else f"Rows from {source_of(df)}.")
    return table(out, full=df, group=by[0], lines=lines, caption=caption)


def _spread_lines(med: pd.DataFrame, group: str, arm: str, column: str) -> dict:
    """{group value: 'request size 64 KiB: 9 allocators; median µs/pair from 1.13 (noop) to 80.5 (raw)'}."""
    lines = {}
    for key, g in med.groupby(group, sort=False):
        line = f"{label(group)} {cell(group, key)}: {g[arm].nunique()} {arm}s"
        g = g.dropna(subset=[column])
        if len(g) > 1:
            lo, hi = g.loc[g[column].idxmin()], g.loc[g[column].idxmax()]
            line += f"; median {label(column)} from {number(lo[column])} ({lo[arm]}) to {number(hi[column])} ({hi[arm]})"
        lines[key] = line
    return lines
