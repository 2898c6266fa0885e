"""The `llmbus bench` command (registered by supervisor/cli.py)."""

from __future__ import annotations

import click


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
def bench() -> None:
    """Load-test a TGI- or OpenAI-compatible server (being built)."""
    raise click.UsageError("llmbus bench is not built yet")
