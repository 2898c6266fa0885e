"""``--cuda-graphs``: the decode batch sizes a CUDA rank captures as graphs, read without importing torch (the
launcher parses every service's settings; ``workers/cuda_graphs.py`` captures them)."""

from __future__ import annotations

# TGI's default list, continued by doubling: a decode step of n rows replays the smallest captured size >= n,
# its extra rows padded; larger steps run eagerly. Sizes above the step's row budget are not captured.
DEFAULT_CUDA_GRAPHS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# ``--piecewise-graphs``' default, where decode graphs are on: the prompt-chunk steps of a served wave (c=64
# decodes beside a 128-token chunk is 192 tokens) up to vLLM's largest capture size; a larger step's launches
# are a small share of its compute, and it runs eagerly.
DEFAULT_PIECEWISE_GRAPHS = (16, 32, 64, 128, 256, 512)


def parse_cuda_graphs(text: str | None, what: str = "batch sizes",
                      default: tuple[int, ...] = DEFAULT_CUDA_GRAPHS) -> tuple[int, ...]:
    """``"1,2,4"`` -> (1, 2, 4); None -> ``default``; ``"0"`` (TGI's way to turn them off) or an empty
    text -> (). Raises ValueError with the reason for anything else (``--piecewise-graphs`` reads the same
    way)."""
    if text is None:
        return default
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if parts == ["0"] or not parts:
        return ()
    sizes = []
    for part in parts:
        if not part.isdigit() or int(part) < 1:
            raise ValueError(f"must list {what} >= 1 separated by commas (or be 0 to disable them), "
                             f"not {text!r}")
        sizes.append(int(part))
    return tuple(sorted(set(sizes)))


def cuda_graphs_problem(text: str) -> str | None:
    """The settings check: what is wrong with a ``--cuda-graphs`` value, None if nothing."""
    return _problem(text, "batch sizes")


def piecewise_graphs_problem(text: str) -> str | None:
    """The settings check of ``--piecewise-graphs`` (token counts, read as ``--cuda-graphs``)."""
    return _problem(text, "token counts")


def parse_piecewise_graphs(text: str | None, cuda_graphs: tuple[int, ...]) -> tuple[int, ...]:
    """``--piecewise-graphs`` as given; unset, the default list where decode graphs are on and none where
    ``--cuda-graphs 0`` turned graphs off."""
    return parse_cuda_graphs(text, "token counts", DEFAULT_PIECEWISE_GRAPHS if cuda_graphs else ())


def _problem(text: str, what: str) -> str | None:
    try:
        parse_cuda_graphs(text, what=what)
    except ValueError as e:
        return str(e)
    return None
