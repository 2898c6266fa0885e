"""Defaults and choices that several services' settings declare: the same flag appears on more than one
service's command line (the scheduler and the workers both size steps by --max-batch-prefill-tokens; the
frontend reports --quantize, the workers apply it), and each declares it without importing the other."""

from __future__ import annotations

# --quantize's methods (workers/quant.py implements them)
QUANTIZE_METHODS = ("int8", "int4")
# --quantize's names for a checkpoint published quantized (bus/prequantized.py): read from the checkpoint
# whether given or not, as TGI's launcher reads them from its config
CHECKPOINT_METHODS = ("gptq", "awq", "fp8", "compressed-tensors", "mxfp4")
QUANTIZE_CHOICES = QUANTIZE_METHODS + CHECKPOINT_METHODS
QUANTIZE_HELP = ("int8 or int4: weight-only quantization of the linear layers at load, in groups of 32 inputs. "
                 "gptq, awq, fp8, compressed-tensors or mxfp4: a checkpoint published so, as its config says "
                 "(read without the flag too). GGUF files keep their Q8_0/Q4_0/Q4_1 tensors quantized either way.")

# Tokens one step computes (prompt chunks + decodes) unless --max-batch-prefill-tokens says otherwise.
DEFAULT_MAX_BATCH_PREFILL_TOKENS = 4096
PREFILL_TOKENS_HELP = (f"Tokens computed per step (prompt chunks + decodes). Default: "
                       f"{DEFAULT_MAX_BATCH_PREFILL_TOKENS}, at most the KV capacity; without chunking at least "
                       f"max_input_tokens.")
