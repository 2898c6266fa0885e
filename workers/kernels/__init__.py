"""llmbus's CPU kernels: one C library, built on first use with the machine's C compiler and loaded with ctypes.

- ``csrc/``: the sources, each its own translation unit, and ``llmbus_kernels.h``, which declares every
  structure, constant and entry point Python shares with them (``internal.h``: what they share among
  themselves);
- ``build.py``: the content-hashed build and its cache;
- ``bindings.py``: the ctypes mirror of the header (structures, constants, signatures) and the loader,
  which checks the library's ABI against it.

The torch-facing wrappers live with their callers: decode attention in ``workers/attention/cpu.py``,
token choice in ``workers/sampling.py``, the fused decode layer in ``workers/fused_decode.py``, the int8 /
int4 products in ``workers/quant.py`` and the float32 GEMM in ``workers/linear.py``.
"""
