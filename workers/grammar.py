"""Constrained decoding on rank 0: a grammar matcher per constrained request, and the batch's token masks.

A request that carries a ``Grammar`` (bus/messages.py) gets an llguidance ``LLMatcher``: a parser of the
grammar over the model's own token vocabulary. Before each token it samples, the matcher gives the set of
tokens that keep the output inside the language (a bitmask, one bit per token id); the sampler sees the
logits of every other token as ``-inf``. Once the grammar is complete, only the end-of-sequence tokens are
allowed, so a request whose grammar reaches its end finishes with ``eos_token`` like any other.

llguidance (MIT, the parser llama.cpp, vLLM and SGLang also use) was chosen over xgrammar and outlines-core
by measurement: docs/design-notes.md, "Structured output", and benchmarks/grammar_libraries.py.

State is rebuilt, never shipped: a matcher consumes the request's generated tokens as rank 0 sees them
(positions from ``prompt_len`` on, whether they arrive as ``cached_ids``, prompt chunks of a recomputed
request, or the last sampled token fed back in a decode step). So a preempted request that comes back as a
new one recomputes its grammar state from the same tokens, and nothing about it survives ``drop``.

Requests whose grammar writes JSON (a schema, or tool calls' ``%json``) have their numbers stopped at a
float64's 17 significant digits in these masks (workers/json_numbers.py): llguidance bounds no number.

The masks of a step are computed on a background thread while the forward pass runs (llguidance drops the
GIL), then applied to the logits rows of the constrained requests; unconstrained rows are not touched.
"""

from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from llmbus.bus.grammar import llguidance_grammar
from llmbus.bus.messages import Grammar
from llmbus.bus.model_files import eos_token_ids
from llmbus.workers.json_numbers import JsonScanner, NumberCap, scanner_for
from llmbus.workers.launched_step import to_device

COMPILED_CACHE_SIZE = 256  # distinct grammars kept compiled (a tool set or a schema is usually reused)


def load_llg_tokenizer(model_dir: str | Path, vocab_size: int):
    """llguidance's view of the model's vocabulary: tokenizer.json, the logits' width, and every id the
    frontend stops on as end-of-sequence (so a finished grammar allows each of them)."""
    import llguidance
    from tokenizers import Tokenizer

    model_dir = Path(model_dir)
    text = (model_dir / "tokenizer.json").read_text(encoding="utf-8")
    eos = eos_token_ids(model_dir, Tokenizer.from_str(text))
    return llguidance.LLTokenizer(text, n_vocab=vocab_size, eos_token=eos or None)


def _without_state(reason: str) -> str:
    """llguidance's error message without the parser state it appends: hundreds of characters of internals."""
    return reason.split("\n<state>", 1)[0].strip()


def grammar_fault(reason: str) -> str:
    """llguidance's reason for stopping a matcher mid-output (a lexer or parser limit the grammar runs into,
    or a dead end) as the request's error."""
    reason = _without_state(reason)
    if reason == "NoExtensionBias":  # no token extends the output: the grammar matches no text from here
        reason = "no token can continue the output"
    return f"grammar cannot be followed: {reason}"


@dataclass(eq=False)
class _RequestGrammar:
    matcher: object  # llguidance.LLMatcher
    consumed: int  # the matcher has consumed the tokens at positions prompt_len..consumed-1
    pending: dict[int, int] = field(default_factory=dict)  # position -> token, seen but not yet consumed
    error: str | None = None
    # "validation": the grammar itself is at fault (it named a special token this vocabulary lacks, which
    # only a tokenizer shows, or it ran into llguidance's limits while generating); "generation": the engine
    # broke it (a lost token, a token it fed that the grammar did not allow)
    error_type: str = "generation"
    # where the output stands in JSON, for grammars that write JSON (numbers are capped: json_numbers.py)
    json: JsonScanner | None = None


@dataclass
class MaskJob:
    """One step's masks, being computed: ``rows[i]`` is the logits row of ``rids[i]``."""

    rows: list[int]
    rids: list[str]
    future: Future


class GrammarMasks:
    """Rank 0's matchers, keyed by request id, and the masks of each step."""

    def __init__(self, model_dir: str | Path, vocab_size: int):
        self.tokenizer = load_llg_tokenizer(model_dir, vocab_size)
        self.eos_ids = [i for i in self.tokenizer.eos_tokens if i < vocab_size]
        self.numbers = NumberCap([self.tokenizer.decode_bytes([i]) for i in range(vocab_size)])
        self.words = (vocab_size + 31) // 32
        self._compiled: OrderedDict[tuple[str, str], object] = OrderedDict()
        self.requests: dict[str, _RequestGrammar] = {}
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")

    # -- requests ----------------------------------------------------------------------------------

    def _matcher(self, grammar: Grammar):
        """(a fresh matcher for ``grammar``, None) or (None, why it cannot be built). Each distinct
        grammar is compiled once; requests get copies."""
        import llguidance

        key = (grammar.kind, grammar.source)
        pristine = self._compiled.get(key)
        if pristine is not None:
            self._compiled.move_to_end(key)
            return pristine.deep_copy(), None
        try:
            pristine = llguidance.LLMatcher(self.tokenizer, llguidance_grammar(grammar), log_level=0)
        except ValueError as e:
            return None, str(e)
        if pristine.is_error():
            return None, _without_state(pristine.get_error())
        self._compiled[key] = pristine
        if len(self._compiled) > COMPILED_CACHE_SIZE:
            self._compiled.popitem(last=False)
        return pristine.deep_copy(), None

    def observe(self, rid: str, grammar: Grammar, prompt_len: int, cached_ids: list[int],
                num_computed: int, token_ids: list[int]) -> None:
        """Note a step's tokens of a constrained request (starting its state on first sight)."""
        state = self.requests.get(rid)
        if state is None:
            matcher, error = self._matcher(grammar)
            state = self.requests[rid] = _RequestGrammar(matcher=matcher, consumed=prompt_len,
                                                          json=scanner_for(grammar))
            if error is not None:
                state.error, state.error_type = f"grammar is not valid: {error}", "validation"
            for position in range(prompt_len, len(cached_ids)):
                state.pending[position] = cached_ids[position]
        for offset, token in enumerate(token_ids):
            position = num_computed + offset
            if position >= state.consumed:
                state.pending[position] = token

    def drop(self, rids: list[str]) -> None:
        for rid in rids:
            self.requests.pop(rid, None)

    @property
    def active(self) -> int:
        return len(self.requests)

    # -- masks -------------------------------------------------------------------------------------

    def start_masks(self, rows: list[int], rids: list[str], positions: list[int]) -> MaskJob:
        """Begin computing, on the background thread, the masks of ``rids`` (logits rows ``rows``) for the
        tokens they sample at ``positions``."""
        states = [self.requests[rid] for rid in rids]
        future = self._executor.submit(self._compute, states, positions)
        return MaskJob(rows=rows, rids=rids, future=future)

    def _compute(self, states: list[_RequestGrammar], positions: list[int]) -> np.ndarray:
        masks = np.zeros((len(states), self.words), dtype=np.int32)
        for i, (state, position) in enumerate(zip(states, positions)):
            self._catch_up(state, position)
            if state.error is None:
                row = masks[i]
                state.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
                if state.matcher.is_error():
                    state.error, state.error_type = grammar_fault(state.matcher.get_error()), "validation"
                elif state.json is not None and state.json.number is not None:
                    self.numbers.apply(row, state.json.number)
        return masks

    def _catch_up(self, state: _RequestGrammar, position: int) -> None:
        """Consume the tokens before ``position`` that the matcher has not seen yet."""
        while state.error is None and state.consumed < position:
            token = state.pending.pop(state.consumed, None)
            if token is None:
                state.error = f"grammar state lost: no token at position {state.consumed}"
                return
            if not state.matcher.consume_token(token):
                # the tokens fed were sampled under this grammar's masks: llguidance's own error is a limit
                reason = state.matcher.get_error()
                state.error, state.error_type = ((grammar_fault(reason), "validation") if reason
                                                 else (f"token {token} does not fit the grammar", "generation"))
            elif state.json is not None:
                state.json.feed(self.numbers.token_bytes[token])
            state.consumed += 1

    def apply(self, logits: torch.Tensor, job: MaskJob) -> dict[str, tuple[str, str]]:
        """Mask ``logits [S, vocab]`` (float32, in place) with the job's masks; the requests whose grammar
        failed, with (error type, why): their rows allow only end-of-sequence, so they end at once."""
        masks = job.future.result()
        states = [self.requests[rid] for rid in job.rids]
        errors = {rid: (state.error_type, state.error) for rid, state in zip(job.rids, states)
                  if state.error is not None}
        words = masks.view(np.uint32)
        for i, rid in enumerate(job.rids):
            if rid in errors:  # only end-of-sequence: the request ends now, and the scheduler fails it
                words[i] = 0
                for token in self.eos_ids:
                    words[i, token // 32] |= np.uint32(1 << (token % 32))
        # One pass over the rows' logits (masked_fill_ is most of the cost; design notes, "Structured
        # output"), so only constrained rows are touched, in place when every row is constrained.
        forbidden = forbidden_tokens(masks, logits.shape[1], logits.device,
                                     unpack_on_device=logits.device.type != "cpu")
        if job.rows == list(range(logits.shape[0])):
            logits.masked_fill_(forbidden, float("-inf"))
        else:
            rows = to_device(job.rows, torch.long, logits.device)
            logits.index_copy_(0, rows, logits.index_select(0, rows).masked_fill_(forbidden, float("-inf")))
        return errors


def forbidden_tokens(masks: np.ndarray, vocab: int, device: torch.device, unpack_on_device: bool) -> torch.Tensor:
    """``[R, vocab]`` bool: the tokens the rows' allowed-token bitmasks (``masks``, 32 tokens a word, token t
    at bit t % 32 of word t // 32) leave out. On the CPU numpy unpacks the bits; for a GPU the bitmask
    itself goes over (32 times fewer bytes, pinned and non-blocking: no wait for the step) and the device
    unpacks it."""
    if not unpack_on_device:
        forbidden = np.unpackbits(np.invert(masks).view(np.uint8), axis=1, bitorder="little")[:, :vocab]
        return torch.from_numpy(forbidden).to(device=device, dtype=torch.bool)
    words = to_device(torch.from_numpy(np.ascontiguousarray(masks).view(np.int32)), torch.int32, device)
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    allowed = ((words[:, :, None] >> shifts) & 1).flatten(1)[:, :vocab]
    return allowed == 0
