"""A simulated worker for policy tests: it keeps block tables from the step diffs exactly as the real
workers do, "writes" KV slots, checks that every position a step relies on holds K/V computed from
that very prefix, and samples a deterministic function of the prefix — so a preempted or cache-hit
request must produce the same tokens as one that ran alone, and any wrong block table, stale block or
corrupt cache entry fails loudly."""

from __future__ import annotations

from llmbus.scheduler.policy import Scheduler
from llmbus.scheduler.requests import ScheduledBatch


def next_token(prefix: tuple[int, ...], eos: int | None = None, copy_period: int | None = None) -> int:
    """With ``copy_period``, mostly the token that many places back (a model that quotes its input, as
    speculation needs), else a hash of the prefix."""
    token = (hash(prefix) % 997) + 10  # never a small id such as an EOS id, unless asked
    if eos is not None and len(prefix) % 7 == 0:
        return eos
    if copy_period is not None and len(prefix) >= copy_period and token % 4:
        return prefix[-copy_period]
    return token


def solo_output(prompt: list[int], max_new_tokens: int, eos: int | None = None,
                copy_period: int | None = None) -> list[int]:
    tokens, out = list(prompt), []
    for _ in range(max_new_tokens):
        t = next_token(tuple(tokens), eos, copy_period)
        out.append(t)
        tokens.append(t)
        if t == eos:
            break
    return out


class SimWorker:
    def __init__(self, block_size: int, eos: int | None = None, copy_period: int | None = None):
        self.block_size = block_size
        self.eos = eos
        self.copy_period = copy_period
        self.tables: dict[str, list[int]] = {}
        self.kv: dict[tuple[int, int], int] = {}  # (block, slot) -> hash of the prefix up to that position
        self.steps = 0

    def run(self, batch: ScheduledBatch) -> dict[str, tuple[int, float]]:
        self.steps += 1
        bs = self.block_size
        for rid in batch.finished_rids:
            self.tables.pop(rid, None)
        for req in batch.new_requests:
            assert req.rid not in self.tables, f"{req.rid} sent as new while the workers hold it"
            self.tables[req.rid] = list(req.block_table)
        for rid, blocks in batch.added_blocks:
            self.tables[rid].extend(blocks)
        sampled, writes = {}, {}
        for seq in batch.seqs:
            req = seq.request
            table = self.tables[req.rid]
            assert table == req.block_table, f"{req.rid}: workers' table {table} != {req.block_table}"
            tokens = tuple(req.tokens(0, seq.num_computed)) + tuple(seq.token_ids)
            assert len(table) * bs >= len(tokens), f"{req.rid}: {len(tokens)} tokens in {len(table)} blocks"
            for p in range(seq.num_computed):
                slot = (table[p // bs], p % bs)
                assert self.kv.get(slot) == hash(tokens[:p + 1]), f"{req.rid}: stale K/V at position {p}"
            for p in range(seq.num_computed, len(tokens)):
                slot = (table[p // bs], p % bs)
                assert slot not in writes, f"two sequences write block slot {slot} in one step"
                writes[slot] = hash(tokens[:p + 1])
            if seq.sample and seq.num_spec:
                # every position sampled alone; guesses kept up to the first disagreement, plus that sample
                first = len(tokens) - seq.num_spec
                kept = []
                for end in range(first, len(tokens) + 1):
                    kept.append((next_token(tokens[:end], self.eos, self.copy_period), -0.5))
                    if end == len(tokens) or kept[-1][0] != tokens[end]:
                        break
                sampled[req.rid] = kept
            elif seq.sample:
                sampled[req.rid] = (next_token(tokens, self.eos, self.copy_period), -0.5)
        self.kv.update(writes)
        return sampled


def drive(s: Scheduler, worker: SimWorker, max_steps: int = 10_000, on_step=None) -> int:
    """Run until the scheduler is idle, checking the block accounting after every step."""
    for step in range(max_steps):
        batch = s.schedule()
        if batch is None:
            assert not s.has_work, "work left but nothing scheduled"
            return step
        check_budgets(s, batch)
        s.update(batch, worker.run(batch))
        s.kv.check([r.block_table for r in s.running])
        if on_step is not None:
            on_step(step)
    raise AssertionError("did not finish")


def check_budgets(s: Scheduler, batch: ScheduledBatch) -> None:
    cfg = s.config
    if cfg.max_batch_size is not None:
        assert len(batch.seqs) <= cfg.max_batch_size
    prefill = sum(len(q.token_ids) for q in batch.seqs if not q.is_decode)
    decodes = sum(1 for q in batch.seqs if q.is_decode)
    guesses = sum(q.num_spec for q in batch.seqs)
    if guesses:
        assert decodes <= cfg.speculate_max_batch and all(q.num_spec <= cfg.speculate for q in batch.seqs)
    if cfg.prefill_chunking:
        assert prefill + guesses <= max(0, cfg.max_batch_prefill_tokens - decodes), "prefill budget exceeded"
    else:
        # Whole prompts: one may exceed the budget alone.
        prompts = [len(q.token_ids) for q in batch.seqs if not q.is_decode]
        assert len(prompts) <= 1 or prefill <= cfg.max_batch_prefill_tokens
