"""Defaults and choices that several services' settings declare: the same flag appears on more than one
service's command line (the scheduler and the workers both size steps by --max-batch-prefill-tokens; the
frontend reports --quantize, the workers apply it), and each declares it without importing the other."""

from __future__ import annotations

# --quantize's methods (workers/quant.py implements them)
QUANTIZE_METHODS = ("int8", "int4")

# Tokens one step computes (prompt chunks + decodes) unless --max-batch-prefill-tokens says otherwise.
DEFAULT_MAX_BATCH_PREFILL_TOKENS = 4096
PREFILL_TOKENS_HELP = (f"Tokens computed per step (prompt chunks + decodes). Default: "
                       f"{DEFAULT_MAX_BATCH_PREFILL_TOKENS}, at most the KV capacity; without chunking at least "
                       f"max_input_tokens.")
