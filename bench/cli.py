"""The `llmbus bench` command (registered by supervisor/cli.py).

Imported whenever any `llmbus` command runs, so everything heavy (aiohttp, tqdm, matplotlib) is imported
inside the command, not here.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

# Bounds on what one invocation may send: a typo must not become a flood.
MAX_REQUESTS = 100_000
MAX_CONCURRENCY = 4096


class NumberList(click.ParamType):
    """``1,4,16`` -> [1, 4, 16], each number within (low, high]."""

    name = "list"

    def __init__(self, kind: type, low: float, high: float):
        self.kind, self.low, self.high = kind, low, high

    def convert(self, value, param, ctx):
        if isinstance(value, list):
            return value
        try:
            numbers = [self.kind(v) for v in str(value).split(",") if v.strip()]
        except ValueError:
            self.fail(f"{value!r} is not a comma-separated list of numbers", param, ctx)
        if not numbers or not all(self.low < n <= self.high for n in numbers):
            self.fail(f"{value!r}: every value must be > {self.low:g} and <= {self.high:g}", param, ctx)
        return numbers


class TokenRange(click.ParamType):
    """``128`` -> (128, 128); ``64:256`` -> (64, 256), sampled uniformly per request."""

    name = "N|LO:HI"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        try:
            lo, _, hi = str(value).partition(":")
            bounds = (int(lo), int(hi or lo))
        except ValueError:
            self.fail(f"{value!r} is not N or LO:HI", param, ctx)
        if not 1 <= bounds[0] <= bounds[1]:
            self.fail(f"{value!r}: need 1 <= LO <= HI", param, ctx)
        return bounds


class MissingExtra(click.ClickException):
    exit_code = 2


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--url", default="http://127.0.0.1:3000", show_default=True,
              help="The server's base URL; nothing is sent anywhere else.")
@click.option("--api", type=click.Choice(["tgi", "openai"]), default="tgi", show_default=True,
              help="tgi: POST /generate_stream. openai: POST /v1/completions (streamed, with usage; "
                   "completions rather than chat, so no chat template changes the prompt length).")
@click.option("--model", default=None, help="OpenAI's model name. Default: the first of GET /v1/models.")
@click.option("--concurrency", type=NumberList(int, 0, MAX_CONCURRENCY), default="1,4,16,64",
              show_default=True, help="Closed-loop levels: this many requests in flight at once.")
@click.option("--request-rate", type=NumberList(float, 0, 1e6), default=None,
              help="Open-loop levels instead: Poisson arrivals at R requests/s (comma-separated to sweep).")
@click.option("--requests", type=click.IntRange(1, MAX_REQUESTS), default=128, show_default=True,
              help="Requests per level.")
@click.option("--warmup", type=click.IntRange(0, 1024), default=4, show_default=True,
              help="Requests sent (all at once) before the first level, not measured.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seeds prompts, lengths and arrivals.")
@click.option("--prompt-tokens", type=TokenRange(), default="128", show_default=True,
              help="Prompt length in tokens, or LO:HI sampled uniformly. Exact where the server has "
                   "TGI's /tokenize, else about one word per token.")
@click.option("--max-new-tokens", type=TokenRange(), default="128", show_default=True,
              help="Tokens to generate, or LO:HI sampled uniformly.")
@click.option("--ignore-eos/--no-ignore-eos", default=True, show_default=True,
              help="Generate exactly max-new-tokens (ignore_eos_token / ignore_eos).")
@click.option("--timeout", type=click.FloatRange(0, min_open=True), default=300.0, show_default=True,
              help="Seconds one request may take before it counts as an error.")
@click.option("--max-duration", type=click.FloatRange(0, min_open=True), default=1800.0, show_default=True,
              help="Seconds the whole run may take; levels not reached are skipped.")
@click.option("--api-key", default=None, help="Sent as `Authorization: Bearer KEY`.")
@click.option("--output", "-o", type=click.Path(dir_okay=False), default="bench-results.json",
              show_default=True, help="JSON: the configuration, per-level stats and every request's samples.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="Throughput-vs-latency PNG. Default: the --output path with .png.")
@click.option("--no-plot", is_flag=True, help="Skip the plot (matplotlib not needed).")
@click.option("--progress/--no-progress", default=True, show_default=True, help="Progress bars on stderr.")
@click.pass_context
def bench(ctx: click.Context, **kw) -> None:
    """Load-test a TGI- or OpenAI-compatible server: streaming requests at each concurrency (or request
    rate), then TTFT, inter-token and end-to-end latency percentiles, requests/s and generated tokens/s
    per level, as a table, a JSON file and a throughput-vs-latency plot."""
    from llmbus.bench import report
    from llmbus.bench.loadgen import BenchConfig, BenchError, run_bench

    if kw["request_rate"] and ctx.get_parameter_source("concurrency") is not click.core.ParameterSource.DEFAULT:
        raise click.UsageError("give --concurrency (closed loop) or --request-rate (open loop), not both")
    if not kw["url"].startswith(("http://", "https://")):
        raise click.BadParameter(f"{kw['url']!r} is not an http:// or https:// URL", param_hint="--url")
    plot_path = None if kw["no_plot"] else kw["plot_path"] or str(Path(kw["output"]).with_suffix(".png"))
    for option, path in (("--output", kw["output"]), ("--plot", plot_path)):
        folder = Path(path).parent if path is not None else None
        if folder is not None and not (folder.is_dir() and os.access(folder, os.W_OK)):
            # found now, not after a benchmark that may run for half an hour
            raise click.BadParameter(f"{folder} is not a folder this user can write to", param_hint=option)
    if plot_path is not None:
        try:
            report.require_matplotlib()
        except report.PlotUnavailable as e:
            raise MissingExtra(str(e)) from None

    config = BenchConfig(
        url=kw["url"], api=kw["api"], concurrency=kw["concurrency"], request_rates=kw["request_rate"] or [],
        requests=kw["requests"], warmup=kw["warmup"], seed=kw["seed"], prompt_tokens=kw["prompt_tokens"],
        max_new_tokens=kw["max_new_tokens"], ignore_eos=kw["ignore_eos"], timeout=kw["timeout"],
        max_duration=kw["max_duration"], model=kw["model"], api_key=kw["api_key"])
    try:
        result = run_bench(config, progress=kw["progress"])
    except BenchError as e:
        raise click.ClickException(str(e)) from None

    report.write_json(result, kw["output"])
    if plot_path is not None:
        report.plot(result, plot_path)
    click.echo(report.headline(result))
    click.echo(report.table(result))
    click.echo(f"results: {kw['output']}" + (f", plot: {plot_path}" if plot_path else ""))
    if result.truncated:
        click.echo(f"warning: the run reached --max-duration ({config.max_duration:g} s); "
                   "later levels were skipped", err=True)
    if not any(level.stats["ok"] for level in result.levels):
        first = next((s.error for level in result.levels for s in level.samples if s.error), "no requests")
        click.echo(f"Error: every request failed; the first: {first}", err=True)
        sys.exit(1)
