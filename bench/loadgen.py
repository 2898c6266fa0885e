"""The load generator: closed-loop concurrency sweeps and open-loop Poisson arrivals against one URL.

``run_bench(BenchConfig(...)) -> BenchResult`` is the library entry point (``llmbus bench`` and
``benchmarks/compare.py`` call it). What it sends is bounded: ``requests`` per level (plus ``warmup``
once), each request cut off after ``timeout`` seconds, the whole run after ``max_duration``, and nothing
goes anywhere but ``url``.

- Closed loop (``concurrency``): N clients, each sending its next request when its last one finished,
  so exactly N are in flight until the level's requests run out. It measures what the server does at
  that load, whatever its speed.
- Open loop (``request_rates``): requests sent at exponentially distributed gaps of mean 1/R (a Poisson
  process, seeded) whether or not earlier ones finished, as independent users would. Queues build up
  when R exceeds what the server sustains; that is the point of it.

Every level gets its own prompts (drawn from ``seed`` and the level's position), so no level is served
from the prefix cache an earlier one filled.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone

import aiohttp

from llmbus.bench.apis import API_CLASSES, error_text
from llmbus.bench.prompts import approximate_prompt, exact_prompt
from llmbus.bench.stats import Sample, level_stats

_PROMPT_BUILDERS = 8  # /tokenize calls in flight while prompts are prepared


class BenchError(Exception):
    """The run cannot go on (the server is unreachable, refuses us): one line for the user."""


@dataclass
class BenchConfig:
    url: str = "http://127.0.0.1:3000"
    api: str = "tgi"  # "tgi": /generate_stream; "openai": /v1/completions
    concurrency: list[int] = field(default_factory=lambda: [1, 4, 16, 64])
    request_rates: list[float] = field(default_factory=list)  # non-empty: open loop instead of concurrency
    requests: int = 128  # per level
    warmup: int = 4  # sent once, all at once, before the first level; not measured
    seed: int = 0
    prompt_tokens: tuple[int, int] = (128, 128)  # uniform in [lo, hi]
    max_new_tokens: tuple[int, int] = (128, 128)
    ignore_eos: bool = True  # lengths fixed by max_new_tokens alone
    timeout: float = 300.0  # seconds per request
    max_duration: float = 1800.0  # seconds for the whole run
    model: str | None = None  # OpenAI's "model"; None: the first of GET /v1/models
    api_key: str | None = None  # sent as a Bearer token
    # Library callers that need the very same texts elsewhere (compare.py) give them here: taken in order
    # by the warm-up then the levels, cycling; prompt_tokens is then unused.
    prompts: list[str] | None = None

    def __post_init__(self):
        if self.api not in API_CLASSES:
            raise ValueError(f"api must be one of {sorted(API_CLASSES)}, not {self.api!r}")
        self.url = self.url.rstrip("/")
        if self.api == "openai" and self.url.endswith("/v1"):  # OpenAI clients' base_url habit
            self.url = self.url[:-3]

    def levels(self) -> list[tuple[str, str, float]]:
        """(label, mode, value) per level, in the order they run."""
        if self.request_rates:
            return [(f"rate={r:g}/s", "rate", r) for r in self.request_rates]
        return [(f"c={c}", "concurrency", c) for c in self.concurrency]

    def public_dict(self) -> dict:
        """The configuration as written into results: never the API key, and the given prompts counted,
        not copied."""
        d = dataclasses.asdict(self)
        d["api_key"] = "(set)" if self.api_key else None
        d["prompts"] = None if self.prompts is None else f"{len(self.prompts)} given"
        return d


@dataclass
class LevelResult:
    label: str
    mode: str  # "concurrency" | "rate"
    value: float
    duration: float
    samples: list[Sample]
    stats: dict
    truncated: bool = False  # cut short by max_duration

    def to_dict(self) -> dict:
        return {"label": self.label, "mode": self.mode, "value": self.value, "duration_s": self.duration,
                "truncated": self.truncated, "stats": self.stats,
                "samples": [_sample_dict(s) for s in self.samples]}


@dataclass
class BenchResult:
    config: BenchConfig
    levels: list[LevelResult]
    prompt_lengths: str  # how prompt lengths were met: "exact", "approximate" or "given"
    model: str | None
    started: str

    @property
    def truncated(self) -> bool:
        return any(level.truncated for level in self.levels)

    def to_dict(self) -> dict:
        return {"config": self.config.public_dict(), "model": self.model, "prompt_lengths": self.prompt_lengths,
                "started": self.started, "levels": [level.to_dict() for level in self.levels]}


def _sample_dict(s: Sample) -> dict:
    r6 = lambda x: None if x is None else round(x, 6)  # noqa: E731  (microseconds are plenty)
    return {"index": s.index, "start": r6(s.start), "prompt_tokens": s.prompt_tokens,
            "max_new_tokens": s.max_new_tokens, "output_tokens": s.output_tokens, "ttft": r6(s.ttft),
            "e2e": r6(s.e2e), "token_times": [r6(t) for t in s.token_times], "error": s.error}


@dataclass
class _Spec:
    prompt: str
    prompt_tokens: int | None
    max_new_tokens: int


def arrival_times(n: int, rate: float, rng: random.Random) -> list[float]:
    """Send times (seconds from the level's start) of a Poisson process at ``rate`` per second: the
    first at once, each next one an exponentially distributed gap of mean 1/rate later."""
    times, due = [], 0.0
    for _ in range(n):
        times.append(due)
        due += rng.expovariate(rate)
    return times


def arrival_rng(seed: int, position: int) -> random.Random:
    """The generator of level ``position``'s arrivals: a stream of its own, so the schedule stays the
    same when the prompt or length settings change."""
    return random.Random(f"{seed}/arrivals/{position}")


def run_bench(config: BenchConfig, *, progress: bool = False) -> BenchResult:
    """Run every level of ``config`` and return what was measured. ``progress`` draws a tqdm bar per
    level on stderr. Raises BenchError when the server cannot be reached or refuses the credentials."""
    return asyncio.run(_Run(config, progress).run())


class _Run:
    def __init__(self, config: BenchConfig, progress: bool):
        self.config, self.progress = config, progress
        self.session: aiohttp.ClientSession | None = None
        self.exact = False  # /tokenize is there: prompts are cut to exact token counts
        self.next_prompt = 0  # position in config.prompts
        self.api = None  # the dialect, once the model name is known

    async def run(self) -> BenchResult:
        c = self.config
        started = datetime.now(timezone.utc).isoformat(timespec="seconds")
        deadline = time.monotonic() + c.max_duration
        headers = {"Authorization": f"Bearer {c.api_key}"} if c.api_key else {}
        # The clients cap in-flight requests themselves; the connector must not queue them again.
        async with aiohttp.ClientSession(headers=headers, connector=aiohttp.TCPConnector(limit=0)) as session:
            self.session = session
            await self._probe()
            model = await self._model() if c.api == "openai" else None
            self.api = API_CLASSES[c.api](session, c.url, ignore_eos=c.ignore_eos, timeout=c.timeout,
                                          model=model)
            levels: list[LevelResult] = []
            if c.warmup:
                await self._level("warmup", "concurrency", c.warmup, c.warmup, "warmup", deadline)
            for position, (label, mode, value) in enumerate(c.levels()):
                level = await self._level(label, mode, value, c.requests, position, deadline)
                levels.append(level)
                if level.truncated:
                    break
        lengths = "given" if c.prompts is not None else "exact" if self.exact else "approximate"
        return BenchResult(c, levels, lengths, model, started)

    # --- before the levels ---------------------------------------------------------------------------

    async def _probe(self) -> None:
        """One ``/tokenize`` call: it tells whether prompts can be cut exactly, and it is the run's
        connectivity check, so an unreachable server is one clear error before anything else."""
        try:
            async with self.session.post(f"{self.config.url}/tokenize", json={"inputs": "Hello"},
                                         timeout=aiohttp.ClientTimeout(total=30)) as resp:
                if resp.status in (401, 403):
                    raise BenchError(f"{self.config.url} refused the request "
                                     f"({error_text(resp.status, await resp.text())}); pass --api-key")
                self.exact = resp.status == 200 and isinstance(await resp.json(content_type=None), list)
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
            raise BenchError(f"cannot reach {self.config.url}: {e or type(e).__name__}") from None
        except (aiohttp.ClientError, ValueError):
            self.exact = False  # answered, but not with TGI's tokenize: an OpenAI-only server

    async def _model(self) -> str:
        """The model name OpenAI's API wants: the one given, else the first ``GET /v1/models`` lists, else
        "tgi" (TGI and llmbus answer whatever is named)."""
        if self.config.model:
            return self.config.model
        try:
            async with self.session.get(f"{self.config.url}/v1/models",
                                        timeout=aiohttp.ClientTimeout(total=30)) as resp:
                return (await resp.json(content_type=None))["data"][0]["id"]
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, LookupError, TypeError):
            return "tgi"

    async def _tokenize(self, text: str) -> list:
        problem = "/tokenize failed while building prompts"
        try:
            async with self.session.post(f"{self.config.url}/tokenize", json={"inputs": text},
                                         timeout=aiohttp.ClientTimeout(total=60)) as resp:
                if resp.status != 200:
                    raise BenchError(f"{problem}: {error_text(resp.status, await resp.text())}")
                return await resp.json(content_type=None)
        except (aiohttp.ClientError, ValueError) as e:
            raise BenchError(f"{problem}: {type(e).__name__}: {e}") from None
        except asyncio.TimeoutError:  # not the run's deadline, which cancels instead
            raise BenchError(f"{problem}: no answer within 60 s") from None

    async def _specs(self, n: int, position) -> list[_Spec]:
        c = self.config
        rng = random.Random(f"{c.seed}/{position}")
        lengths = [(rng.randint(*c.prompt_tokens), rng.randint(*c.max_new_tokens)) for _ in range(n)]
        if c.prompts is not None:
            texts = [c.prompts[(self.next_prompt + i) % len(c.prompts)] for i in range(n)]
            self.next_prompt += n
            return [_Spec(t, None, new) for t, (_, new) in zip(texts, lengths)]
        if not self.exact:
            return [_Spec(approximate_prompt(rng, p), None, new) for p, new in lengths]
        # each prompt its own seeded generator, so the texts do not depend on the order calls return in
        seeds = [rng.getrandbits(64) for _ in range(n)]
        limit = asyncio.Semaphore(_PROMPT_BUILDERS)

        async def build(seed: int, p: int, new: int) -> _Spec:
            async with limit:
                text, count = await exact_prompt(self._tokenize, random.Random(seed), p)
            return _Spec(text, count, new)

        return list(await asyncio.gather(*(build(s, p, new) for s, (p, new) in zip(seeds, lengths))))

    # --- one level -----------------------------------------------------------------------------------

    async def _level(self, label: str, mode: str, value: float, n: int, position, deadline: float) -> LevelResult:
        samples: list[Sample] = []
        bar = self._bar(label, n)
        t0 = time.perf_counter()
        truncated = False
        try:
            specs = await asyncio.wait_for(self._specs(n, position), max(0.0, deadline - time.monotonic()))
            t0 = time.perf_counter()
            loop = self._closed_loop(specs, int(value), samples, t0, bar) if mode == "concurrency" else \
                self._open_loop(specs, value, arrival_rng(self.config.seed, position), samples, t0, bar)
            await asyncio.wait_for(loop, max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            truncated = True
            for s in samples:
                if s.e2e is None:
                    s.error = "cancelled: the run reached --max-duration"
        finally:
            if bar is not None:
                bar.close()
        ends = [s.start + s.e2e for s in samples if s.e2e is not None]
        duration = max(ends, default=0.0) if not truncated else time.perf_counter() - t0
        return LevelResult(label, mode, value, duration, samples, level_stats(samples, duration), truncated)

    def _bar(self, label: str, n: int):
        if not self.progress:
            return None
        from tqdm import tqdm

        return tqdm(total=n, desc=f"{label:>12}", unit="req", leave=True, dynamic_ncols=True)

    async def _one(self, spec: _Spec, index: int, samples: list[Sample], t0: float, bar) -> None:
        sent = time.perf_counter()
        sample = Sample(index=index, start=sent - t0, prompt_tokens=spec.prompt_tokens,
                        max_new_tokens=spec.max_new_tokens)
        samples.append(sample)
        await self.api.send(sample, spec.prompt, sent)
        if bar is not None:
            bar.update(1)
            if sample.error is not None:
                bar.set_postfix(errors=sum(not s.ok for s in samples), refresh=False)

    async def _closed_loop(self, specs: list[_Spec], concurrency: int, samples, t0: float, bar) -> None:
        queue = iter(enumerate(specs))  # shared: each client takes the next request when it is free

        async def client() -> None:
            for index, spec in queue:
                await self._one(spec, index, samples, t0, bar)

        await asyncio.gather(*(client() for _ in range(min(concurrency, len(specs)))))

    async def _open_loop(self, specs: list[_Spec], rate: float, rng: random.Random, samples, t0: float,
                         bar) -> None:
        tasks = []
        try:
            for (index, spec), due in zip(enumerate(specs), arrival_times(len(specs), rate, rng)):
                # this sleep is the arrival process being simulated, not a wait for something to happen
                await asyncio.sleep(max(0.0, due - (time.perf_counter() - t0)))
                tasks.append(asyncio.ensure_future(self._one(spec, index, samples, t0, bar)))
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
