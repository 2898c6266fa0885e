"""What a person reads after a run: the table, the JSON file and the throughput-vs-latency plot.

The plot is the main view: one point per level, generated tokens/s on x against latency on y (the
decode pace a user sees, p50 ITL, and the wait for the first token, p50 TTFT, with p90 beside each).
Moving right is more throughput, moving up is users waiting longer; the knee is where a server stops
trading latency for throughput well.
"""

from __future__ import annotations

import json
from pathlib import Path

from llmbus.bench.loadgen import BenchResult

INSTALL_HINT = "pip install 'llmbus[bench]'"


class PlotUnavailable(Exception):
    """matplotlib (the [bench] extra) is not installed."""


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.1f}" if x < 10 else f"{x * 1000:.0f}"


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def table(result: BenchResult) -> str:
    """One row per level: requests, throughput, and TTFT / ITL / e2e percentiles."""
    head = ("level", "ok", "err", "req/s", "tok/s", "TTFT p50/p90/p99 ms", "ITL p50/p90/p99 ms",
            "e2e p50/p90/p99 s")
    rows = [head]
    for level in result.levels:
        s = level.stats
        ttft, itl, e2e = s["ttft_s"], s["itl_s"], s["e2e_s"]
        rows.append((level.label + (" (cut)" if level.truncated else ""), str(s["ok"]), str(s["errors"]),
                     _num(s["request_throughput"], ".2f"), _num(s["output_throughput"], ".1f"),
                     " / ".join(_ms(ttft[f"p{q}"]) for q in (50, 90, 99)),
                     " / ".join(_ms(itl[f"p{q}"]) for q in (50, 90, 99)),
                     " / ".join(_num(e2e[f"p{q}"], ".2f") for q in (50, 90, 99))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    for level in result.levels:
        for message, count in level.stats["error_kinds"].items():
            lines.append(f"{level.label}: {count} x {message}")
    return "\n".join(lines)


def headline(result: BenchResult) -> str:
    c = result.config
    span = lambda lo_hi: str(lo_hi[0]) if lo_hi[0] == lo_hi[1] else f"{lo_hi[0]}-{lo_hi[1]}"  # noqa: E731
    prompt = f"{len(c.prompts)} given prompts" if c.prompts is not None else \
        f"prompt {span(c.prompt_tokens)} tokens ({result.prompt_lengths})"
    return (f"{c.api} {c.url}: {prompt}, {span(c.max_new_tokens)} new tokens"
            f"{' (ignore EOS)' if c.ignore_eos else ''}, {c.requests} requests per level")


def write_json(result: BenchResult, path: str | Path) -> None:
    Path(path).write_text(json.dumps(result.to_dict(), indent=1) + "\n")


def require_matplotlib():
    """matplotlib, or PlotUnavailable: the CLI calls it before a run, so a missing extra fails at once
    rather than after the run."""
    try:
        import matplotlib
    except ImportError:
        raise PlotUnavailable(f"the plot needs matplotlib: {INSTALL_HINT} (or pass --no-plot)") from None
    return matplotlib


def plot(result: BenchResult, path: str | Path) -> None:
    """Write the throughput-vs-latency PNG to ``path``."""
    matplotlib = require_matplotlib()
    matplotlib.use("Agg")  # files only: no display, no GUI toolkit
    import matplotlib.pyplot as plt

    levels = [lv for lv in result.levels if lv.stats["output_throughput"] is not None and lv.stats["ok"]]
    fig, axes = plt.subplots(1, 2, figsize=(12, 5), constrained_layout=True)
    panels = ((axes[0], "itl_s", "inter-token latency (ms)", "decode pace"),
              (axes[1], "ttft_s", "time to first token (ms)", "wait for the first token"))
    x = [lv.stats["output_throughput"] for lv in levels]
    for ax, key, ylabel, title in panels:
        for q, style in ((50, "o-"), (90, "s--")):
            y = [(lv.stats[key][f"p{q}"] or 0.0) * 1000 for lv in levels]
            ax.plot(x, y, style, label=f"p{q}", alpha=1.0 if q == 50 else 0.6)
            if q == 50:
                for xi, yi, lv in zip(x, y, levels):
                    ax.annotate(lv.label, (xi, yi), textcoords="offset points", xytext=(6, 6), fontsize=9)
        ax.set_xlabel("generated tokens/s")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.set_ylim(bottom=0)
        ax.set_xlim(0, max(x, default=0.0) * 1.15 or 1.0)  # room for the last point's label
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(headline(result), fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)
