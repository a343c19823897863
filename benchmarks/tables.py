"""Benchmark tables rendered from the result files of benchmarks/results/.

    python benchmarks/tables.py            # rewrite every table in README.md and docs/*.md
    python benchmarks/tables.py --check    # exit 1, naming each table its data renders otherwise

A page marks a table with `<!-- table:NAME -->` and `<!-- /table -->`; what
lies between is the rendering of benchmarks/results/NAME.json, whose fields are

    title, machine, date, commit, command, conditions, source: where the numbers come from
    row_header: the first column's heading
    unit: "bytes" where the cells are bytes, not seconds (optional; the key stays "seconds")
    ratio_note: what the ratios in parentheses are, where the baseline is not symbackprop's plain call (optional)
    baseline: the column key that ratios divide by (null: no ratios)
    columns: [{"key", "label", "ratio": true where the cell shows its ratio to the baseline}]
    rows: [{"label", "seconds": {key: seconds | [low, high]},
            "ratios": {key: [median, low, high]} (ratios measured round by round, shown as they are),
            "note": text shown under the table,
            "fastest": {key: seconds} (optional: the fastest sample, kept beside the medians, not shown)}]

`benchmarks/run.py --save NAME` writes such a file from a run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKED = re.compile(r"(<!-- table:([\w.-]+) -->\n)(.*?)(<!-- /table -->)", re.DOTALL)
FIELDS = ("title", "machine", "date", "commit", "command", "conditions", "source", "columns", "rows")


def format_seconds(seconds: float | None) -> str:
    """Three significant digits in the largest unit below the value: 2.53 us, 1.2 s."""
    if seconds is None:
        return ""
    value, unit = _scaled(seconds)
    return f"{value:.3g} {unit}"


def _scaled(seconds: float) -> tuple[float, str]:
    """The unit by the magnitude: a difference of medians may be negative (-0.87 ms)."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if abs(seconds) >= scale:
            return seconds / scale, unit
    return seconds / 1e-9, "ns"


def format_bytes(count: float) -> str:
    """Three significant digits in binary units: 563 KiB, 35.2 MiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            return f"{count / scale:.3g} {unit}"
    return f"{count:.0f} B"


def _time(value, unit: str | None = None) -> str:
    if unit == "bytes":
        return " - ".join(format_bytes(v) for v in value) if isinstance(value, list) else format_bytes(value)
    if isinstance(value, list):  # a range of medians: 3.19-5.9 ms
        (low, low_unit), (high, high_unit) = _scaled(value[0]), _scaled(value[1])
        if low_unit == high_unit:
            return f"{low:.3g}-{high:.3g} {high_unit}"
        return f"{format_seconds(value[0])} - {format_seconds(value[1])}"
    return format_seconds(value)


def _cell(row: dict, column: dict, baseline: str | None, unit: str | None = None) -> str:
    value = row["seconds"].get(column["key"])
    if value is None:
        return ""
    text = _time(value, unit)
    measured = row.get("ratios", {}).get(column["key"])
    base = row["seconds"].get(baseline) if baseline else None
    if measured:
        text += f" ({measured[0]:.2f}, {measured[1]:.2f}-{measured[2]:.2f})"
    elif column.get("ratio") and isinstance(value, (int, float)) and isinstance(base, (int, float)):
        text += f" ({_ratio(value / base)})"
    return text


def _ratio(ratio: float) -> str:
    """Two decimals below 10, one below 100, none above: 0.15, 18.2, 2560."""
    return f"{ratio:.2f}" if ratio < 10 else f"{ratio:.1f}" if ratio < 100 else f"{ratio:.0f}"


def load(name: str) -> dict:
    """The result file NAME, checked for the fields every file carries."""
    data = json.loads((RESULTS / f"{name}.json").read_text())
    missing = [field for field in FIELDS if field not in data]
    if missing:
        raise ValueError(f"benchmarks/results/{name}.json lacks {missing}")
    return data


def render(name: str) -> str:
    """The Markdown of result file NAME: its table, its notes, where it comes from."""
    data = load(name)
    columns, baseline = data["columns"], data.get("baseline")
    notes: list[str] = []
    lines = ["| " + " | ".join([data.get("row_header", "")] + [c["label"] for c in columns]) + " |",
             "|" + "---|" * (len(columns) + 1)]
    for row in data["rows"]:
        label = row["label"]
        if row.get("note"):
            if row["note"] not in notes:
                notes.append(row["note"])
            label += f" [{notes.index(row['note']) + 1}]"
        lines.append("| " + " | ".join([label] + [_cell(row, c, baseline, data.get("unit")) for c in columns]) + " |")
    lines.append("")
    for number, note in enumerate(notes, 1):  # a paragraph each
        lines += [f"[{number}] {note}", ""]
    shown = baseline and any(c.get("ratio") for c in columns)
    ratio = "; in parentheses the peer's time over symbackprop's (above 1: symbackprop is faster)" if shown else ""
    if shown and data.get("ratio_note"):
        ratio = f"; {data['ratio_note']}"
    elif shown and data.get("unit") == "bytes":
        ratio = "; in parentheses the peer's bytes over symbackprop's (above 1: symbackprop needs less)"
    lines.append(f"{data['title']}: {data['conditions']}{ratio}. `{data['command']}` on {data['machine']}, "
                 f"{data['date']}, commit {data['commit']}; data: `benchmarks/results/{name}.json`.")
    return "\n".join(lines) + "\n"


def _cpu_model() -> str:
    """The CPU's model name and a space (Linux's /proc/cpuinfo), else empty."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip() + " "
    except OSError:
        pass
    return ""


def provenance() -> dict:
    """The machine, date and commit fields of a result file written now."""
    run = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    machine = f"{_cpu_model()}{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, " \
              f"{platform.platform()}, Python {platform.python_version()}"
    return {"machine": machine, "date": time.strftime("%Y-%m-%d"), "commit": run.stdout.strip() or "unknown"}


def save(name: str, data: dict) -> Path:
    """Write result file NAME (data holds every field load checks); its path."""
    missing = [field for field in FIELDS if field not in data]
    if missing:
        raise ValueError(f"a result file needs {missing}")
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")
    return path


def refresh(text: str) -> str:
    """text with every marked table rendered again from its data."""
    return MARKED.sub(lambda m: m.group(1) + render(m.group(2)) + m.group(4), text)


def stale(pages=PAGES) -> list[str]:
    """The pages whose marked tables differ from what their data renders."""
    return [str(page.relative_to(ROOT)) for page in pages if refresh(page.read_text()) != page.read_text()]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="render the benchmark tables of README.md and docs/ from benchmarks/results/")
    parser.add_argument("--check", action="store_true", help="exit 1 if a page's table is not what its data renders")
    args = parser.parse_args(argv)
    if args.check:
        out_of_date = stale()
        for page in out_of_date:
            print(f"{page}: a table differs from its data; run python benchmarks/tables.py", file=sys.stderr)
        return 1 if out_of_date else 0
    for page in PAGES:
        text = page.read_text()
        if refresh(text) != text:
            page.write_text(refresh(text))
            print(f"wrote {page.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
