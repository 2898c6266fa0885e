"""Rotary position embeddings for the native decoder (``llama.py``): the frequency schemes of the
families served natively, and partial rotation (``partial_rotary_factor``: only the first part of each
head is rotated, the rest passes through). The rotation itself is ``gpu_ops.apply_rotary``, which the
attention backends apply (``AttentionBackend.forward_rotary``).

Schemes: default, ``linear``, ``dynamic`` (NTK), ``llama3``, ``yarn`` (Qwen's long-context setting: frequencies
blended between interpolated and original across a ramp of dimensions, and an attention factor on cos and
sin), and Phi-3's ``longrope`` (configs may say
``su``, or ``yarn`` for Phi-3, which Phi3Config reads as longrope): per-dimension ``short_factor`` or
``long_factor`` divisors of the frequencies and an attention factor on cos and sin. A sequence whose
length passes ``original_max_position_embeddings`` is rotated with the long factors, one within it with
the short ones, as transformers chooses; the choice is made per sequence of the step, by its last
position in it, or for a chunk of a longer prompt by the prompt's last (transformers rotates a prompt in one
go). A step's sequences are its attention metadata's (``AttentionMetadata.start_mask``), not
guessed from the positions: two sequences side by side whose positions continue each other stay two, and
in a decode-only step every row is its own. One difference remains: when a
generation crosses the original length, transformers' Phi-3 drops its cache and recomputes the whole
sequence with the long factors, where here the keys already computed keep their short-factor rotation
and only the tokens from the crossing on take the long factors; prompts longer than the
original length are rotated with the long factors from their first token, as in transformers.
"""

from __future__ import annotations

import math

import torch

from llmbus.bus.model_files import scaled_positions


class RotaryEmbedding:
    """cos/sin are computed per step from the positions (one ``[T, rotary_dim]`` pair shared by all
    layers) rather than kept as a table of every position, which for long-context models is large."""

    SUPPORTED = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")

    def __init__(self, head_dim: int, theta: float, scaling: dict, max_position_embeddings: int,
                 device: torch.device, partial_rotary_factor: float = 1.0):
        self.rope_type = scaling.get("rope_type", "default")
        if self.rope_type not in self.SUPPORTED:
            raise ValueError(f"rope type {self.rope_type!r} is not supported (supported: {self.SUPPORTED})")
        self.head_dim = head_dim
        self.rotary_dim = int(head_dim * partial_rotary_factor)
        self.theta = theta
        self.exponents = (torch.arange(0, self.rotary_dim, 2, dtype=torch.int64, device=device).float()
                          / self.rotary_dim)
        inv_freq = 1.0 / (theta ** self.exponents)
        self.max_positions = max_position_embeddings
        self.attention_factor = 1.0
        if self.rope_type == "linear":
            inv_freq = inv_freq / scaling["factor"]
        elif self.rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif self.rope_type == "dynamic":
            # NTK scaling grows the base once the sequence passes the trained length. transformers picks the base
            # by the length it computes: a prompt's tokens by the whole prompt (one prefill), a generated one by
            # its own position. So here: by the position, or by the prompt's last position where the runner
            # gives it (``cos_sin``'s horizons), never by what else shares the step.
            self.factor = scaling["factor"]
            self.original_max_positions = max_position_embeddings
            self.max_positions = scaled_positions(scaling, max_position_embeddings)
        elif self.rope_type == "yarn":
            inv_freq, self.attention_factor = _yarn(self.rotary_dim, theta, scaling, max_position_embeddings, device)
            self.max_positions = scaled_positions(scaling, max_position_embeddings)
        elif self.rope_type == "longrope":
            self.original_max_positions = scaling["original_max_position_embeddings"]
            factor = scaling.get("factor") or max_position_embeddings / self.original_max_positions
            self.attention_factor = scaling.get("attention_factor") or (
                math.sqrt(1 + math.log(factor) / math.log(self.original_max_positions)) if factor > 1 else 1.0)
            self.long_inv_freq = inv_freq / torch.tensor(scaling["long_factor"], dtype=torch.float32, device=device)
            inv_freq = inv_freq / torch.tensor(scaling["short_factor"], dtype=torch.float32, device=device)
        self.inv_freq = inv_freq
        # Qwen2-VL's M-RoPE: the rotary pairs in three sections, rotated by a token's temporal, row and column
        # position (``cos_sin``'s [3, T] positions); a text token's three are equal, which is plain RoPE
        self.mrope_section = scaling.get("mrope_section")
        if self.mrope_section is not None:
            if self.rope_type != "default" or sum(self.mrope_section) != self.rotary_dim // 2:
                raise ValueError(f"mrope_section {self.mrope_section} must split the {self.rotary_dim // 2} rotary "
                                 f"pairs of a default RoPE (rope type {self.rope_type!r})")

    @property
    def by_prompt_length(self) -> bool:
        """Whether a prompt's tokens are rotated by the prompt's length and generated ones by their positions
        (``cos_sin``'s horizons: each sequence's prompt's last position): dynamic NTK's base."""
        return self.rope_type == "dynamic"

    @property
    def per_sequence(self) -> bool:
        """Whether a token's rotation depends on its sequence's other tokens in the step (``cos_sin``'s
        ``starts``): LongRoPE's factors are chosen by the sequence's last position."""
        return self.rope_type == "longrope"

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype, starts: torch.Tensor | None = None,
                horizons: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``[T, 1, rotary_dim]`` cos and signed sin for ``positions [T]`` (or M-RoPE's ``[3, T]``), broadcastable
        over heads. ``starts``
        ([T] bool, True at each sequence's first row; None: every row its own sequence) and ``horizons`` ([N],
        ``AttentionMetadata.sequence_horizons``) where ``per_sequence``, or where the runner gives a dynamic
        NTK step its sequences' prompts' last positions (both, or neither)."""
        if positions.dim() == 2:  # M-RoPE's [3, T]: each section of the pairs by its own position
            freqs = positions.float()[..., None] * self.inv_freq
            freqs = torch.cat([part[i % 3] for i, part in enumerate(freqs.split(self.mrope_section, dim=-1))], -1)
            return self._cos_sin(freqs, dtype)
        pos = positions.float()[:, None]
        if self.rope_type == "dynamic":
            reach = (positions if horizons is None
                     else torch.maximum(positions, horizons[sequence_of_row(starts, positions)]))
            seq_len = torch.clamp(reach.float()[:, None] + 1, min=self.original_max_positions)
            factor, dim = self.factor, self.rotary_dim
            base = self.theta * ((factor * seq_len / self.original_max_positions) - (factor - 1)) ** (dim / (dim - 2))
            freqs = pos * (1.0 / base ** self.exponents[None, :])
        elif self.rope_type == "longrope":
            long = (_sequence_last_positions(positions, starts, horizons) >= self.original_max_positions)[:, None]
            freqs = pos * torch.where(long, self.long_inv_freq[None, :], self.inv_freq[None, :])
        else:
            freqs = pos * self.inv_freq[None, :]
        return self._cos_sin(freqs, dtype)

    def _cos_sin(self, freqs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        # The sine carries rotate-half's sign: x * cos + cat(x2, x1) * cat(-sin, sin) is the usual
        # x * cos + cat(-x2, x1) * sin with one negation per step instead of one per layer.
        return (torch.cat((cos, cos), dim=-1).to(dtype)[:, None, :],
                torch.cat((-sin, sin), dim=-1).to(dtype)[:, None, :])


def sequence_of_row(starts: torch.Tensor | None, positions: torch.Tensor) -> torch.Tensor:
    """Each row's sequence (an index into per-sequence values): from ``starts``, or every row its own (a step of
    one token a sequence, whose metadata marks none)."""
    return torch.arange(len(positions), device=positions.device) if starts is None else torch.cumsum(starts, 0) - 1


def _sequence_last_positions(positions: torch.Tensor, starts: torch.Tensor | None,
                             horizons: torch.Tensor | None = None) -> torch.Tensor:
    """Per token, the last position of its sequence in the step (a sequence's rows are consecutive, from a row
    ``starts`` marks), or its horizon where that is later. Not inferred from the positions: two sequences side
    by side at consecutive positions are still two."""
    if starts is None and horizons is None:
        return positions
    run = sequence_of_row(starts, positions)
    last = torch.zeros_like(positions).scatter_reduce(0, run, positions, reduce="amax", include_self=False)
    if horizons is not None:
        last[:horizons.shape[0]] = torch.maximum(last[:horizons.shape[0]], horizons)
    return last[run]


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(dim: int, theta: float, scaling: dict, max_position_embeddings: int,
          device: torch.device) -> tuple[torch.Tensor, float]:
    """YaRN's frequencies and attention factor, as transformers computes them (``_compute_yarn_parameters``)."""
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_position_embeddings / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of no width
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1).to(device)
    position_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)
    extrapolated, interpolated = 1.0 / position_freqs, 1.0 / (factor * position_freqs)
    kept = 1 - ramp  # the share of each dimension's original (extrapolated) frequency
    return interpolated * (1 - kept) + extrapolated * kept, float(attention_factor)
