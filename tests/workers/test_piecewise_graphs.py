"""Piecewise CUDA graphs (``workers/piecewise_graphs.py``), checked on the CPU: ``PiecewiseGraphs`` with
``capture=False`` runs the parts a bucket's graphs would replay (ids and positions through the persistent
buffers, the step padded to the bucket, each layer's attention between the parts on the real rows, the heads
through the one buffer every part reads), with the Triton backend's kernels under Triton's interpreter. A
continuous batch whose prompt-chunk steps take it stays token-exact with transformers, beside decode steps
through the decode graphs' buffers. The capture itself runs on a GPU (benchmarks/gpu_check.py)."""

import pytest
import torch

from llmbus.bus.messages import SamplingParams
from llmbus.testing.families import family_requests
from llmbus.testing.runner_driver import (BLOCK_SIZE, NUM_BLOCKS, drive, make_prompts, mixed_requests,
                                          uncaptured_piecewise)
from llmbus.testing.triton_interpret import interpreted_triton_kernels
from llmbus.workers.cuda_graphs import DecodeGraphs
from llmbus.workers.graph_sizes import parse_cuda_graphs
from llmbus.workers.model_runner import ModelRunner, SeqInput
from llmbus.workers.piecewise_graphs import PiecewiseGraphs
from llmbus.workers.sampling import greedy

# The parts' attention runs the kernels interpreted; another test module of this process may have imported
# them for the GPU first (a runner built in-process by tests/bench or tests/supervisor).
triton_kernels = interpreted_triton_kernels()
VOCAB = 256
SHORT = 7  # tokens per request where the kernels run interpreted for the wiring's or the ranks' sake

pytestmark = pytest.mark.usefixtures("interpreted_triton")


def _runner(model_dir: str, sizes: tuple[int, ...], decode_sizes: tuple[int, ...] = (), *,
            whole: bool = False) -> tuple[ModelRunner, list]:
    """A Triton-backend runner whose eager steps within ``sizes`` go through uncaptured piecewise graphs (with
    ``whole``, their attention too, as ``--full-graphs`` captures it), and its decode steps through uncaptured
    decode graphs of ``decode_sizes``; and each piecewise step's token count."""
    runner = ModelRunner(model_dir, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, attention_backend="triton")
    counts = uncaptured_piecewise(runner, sizes, whole=whole)
    if decode_sizes:
        runner.graphs = DecodeGraphs(runner.model, runner.kv_cache, decode_sizes,
                                     -(-runner.max_position_embeddings // BLOCK_SIZE), capture=False)
    return runner, counts


@pytest.mark.parametrize("decode_graphs,whole", [(True, False), (False, True)],
                         ids=["beside decode graphs", "whole, alone"])
def test_a_continuous_batch_through_the_piecewise_parts_is_token_exact(llama_dir, plain, decode_graphs, whole):
    """Arrivals, chunked prompts beside decodes, a prefix hit and a preemption: the steps within the buckets
    take the parts, padded (token counts between buckets), and every request's tokens equal transformers'.
    Whole (``--full-graphs``): each bucket's attention over the fixed index too, its program map padded; alone,
    the decode-only steps take the buckets too (as they do over two ranks in
    ``test_piecewise_parts_over_two_ranks_are_token_exact``). SHORT tokens a request: r1 is still preempted
    after 5, the hit still arrives at step 9, and 4-token blocks are crossed within 7 tokens."""
    prompts, expected = make_prompts(VOCAB), plain
    requests = family_requests(prompts)
    for request in requests:  # the kernels run interpreted: seconds a step
        request.max_new_tokens = SHORT
    runner, counts = _runner(llama_dir, (4, 8, 16, 32), (1, 2, 4, 8) if decode_graphs else (), whole=whole)
    replayed = []
    if decode_graphs:
        replay = runner.graphs.forward
        runner.graphs.forward = lambda seqs, feed=None: replayed.append(len(seqs)) or replay(seqs, feed)
    results = drive(runner, requests)
    for i in range(len(prompts)):
        assert results[f"r{i}"].tokens == expected.tokens[i][:SHORT], f"r{i}"
    assert results["hit"].tokens == expected.tokens[4][:SHORT]
    assert results["r1"].preemptions == 1
    assert counts and set(counts) - {4, 8, 16, 32}, f"no step needed padding: {counts}"
    if decode_graphs:  # the decode-only steps replayed the decode graphs instead
        assert replayed


def _chunk_beside_decodes(first_block: int) -> list[SeqInput]:
    """A prompt chunk of 5 tokens beside two decodes, in blocks from ``first_block`` on: 5 blocks in all."""
    def seq(rid, tokens, computed, blocks):
        return SeqInput(rid=rid, token_ids=tokens, num_computed=computed,
                        block_table=[first_block + b for b in blocks], sample=True, sampling=SamplingParams())
    return [seq("p", [3, 4, 5, 6, 7], 0, [0, 1]), seq("d0", [9], 5, [2, 3]), seq("d1", [11], 2, [4])]


def test_a_padded_piecewise_step_gives_each_row_its_eager_logits_and_writes_only_its_slots(llama_dir):
    """A prompt chunk of 5 beside 2 decodes, 7 tokens in the bucket of 8: the pool changes at the 7 tokens'
    slots only (the padding row's attention never runs), and the logits equal the eager step's. Their head
    (3 rows, padded to the head of 4) also gives each row's greedy choice, which the step takes instead of
    sampling; not where the logits rows are others than the sampled ones (prompt logprobs)."""
    runner, counts = _runner(llama_dir, (8,))
    seqs = _chunk_beside_decodes(first_block=0)
    key = runner.kv_cache.key
    before = key.clone()
    with torch.inference_mode():
        logits = runner._forward(seqs, runner.kv_cache).clone()
        assert counts == [7]
        ids, logprobs, packed = (t.clone() for t in runner._graph_greedy)
        assert packed.shape[0] == 2 * 4 and not runner.replayed_last  # (the timeline counts it eager)
        changed = (key != before).any(dim=-1).any(dim=1).any(dim=0)  # [blocks + 1, block_size]
        written = {(int(b), int(o)) for b, o in changed.nonzero()}
        assert written == {(0, o) for o in range(BLOCK_SIZE)} | {(1, 0)} | {(3, 1), (4, 2)}
        runner._forward(seqs, runner.kv_cache, logits_index=torch.tensor([0, 4, 5, 6]))
        assert counts == [7, 7] and runner._graph_greedy is None
        runner.piecewise = None
        eager = runner._forward(seqs, runner.kv_cache)
    torch.testing.assert_close(logits, eager)
    expected_ids, expected_logprobs = greedy(eager)
    assert ids.tolist() == expected_ids.tolist()
    torch.testing.assert_close(logprobs, expected_logprobs)


@pytest.mark.parametrize("kv_dtype", [None, torch.float16], ids=["pool of the model's dtype", "float16 pool"])
def test_a_whole_bucket_gives_each_row_its_eager_logits_and_writes_only_its_slots(llama_dir, kv_dtype):
    """``--full-graphs``' bucket (uncaptured): the same step as above, after a larger one left its programs,
    slots and tables in the index, attends over the index; its logits equal the eager step's, and the pool
    changes at the step's slots only (none in block 0, where zeroed slots would land), and in the spare block
    where a pool of another dtype has the whole bucket's keys written first (its padding rows' slots)."""
    runner = ModelRunner(llama_dir, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, attention_backend="triton",
                         kv_cache_dtype=kv_dtype)
    counts = uncaptured_piecewise(runner, (8, 16), whole=True)
    larger = [SeqInput(rid="big", token_ids=list(range(3, 15)), num_computed=0, block_table=[6, 7, 8, 9],
                       sample=True, sampling=SamplingParams())]
    seqs = _chunk_beside_decodes(first_block=1)
    key = runner.kv_cache.key
    with torch.inference_mode():
        runner._forward(larger, runner.kv_cache)
        before = key.clone()
        logits = runner._forward(seqs, runner.kv_cache).clone()
        assert counts == [12, 7]
        changed = (key != before).any(dim=-1).any(dim=1).any(dim=0)  # [blocks + 1, block_size]
        written = {(int(b), int(o)) for b, o in changed.nonzero()}
        spare = {(NUM_BLOCKS, 0)} if kv_dtype is not None else set()
        assert written - spare == {(1, o) for o in range(BLOCK_SIZE)} | {(2, 0)} | {(4, 1), (5, 2)}
        runner.piecewise = None
        eager = runner._forward(seqs, runner.kv_cache)
    torch.testing.assert_close(logits, eager)


def test_only_llama_layers_split_and_steps_within_the_buckets_without_adapters_take_them(llama_dir, tmp_path):
    from llmbus.testing.families import save_tiny_family

    runner, _ = _runner(llama_dir, (4, 8))
    assert PiecewiseGraphs.supported(runner.model)
    pieces = runner.piecewise
    assert pieces.applies(1, None) and pieces.applies(8, None)
    assert not pieces.applies(9, None)  # above the largest bucket: eager
    assert not pieces.applies(4, object())  # a step with LoRA adapter rows: eager
    max_blocks = runner.context_blocks
    pieces.attend_in_graphs(runner.kv_cache, max_blocks)  # whole: over that pool, tables the index holds
    assert pieces.applies(8, None, runner.kv_cache, [[0], list(range(max_blocks))])
    assert not pieces.applies(8, None, runner.kv_cache, [[0], list(range(max_blocks + 1))])
    assert not pieces.applies(8, None, runner._new_cache(8), [[0]])  # another pool (warmup's scratch)
    save_tiny_family(str(tmp_path / "moe"), "MixtralConfig", num_local_experts=4, num_experts_per_tok=2)
    moe = ModelRunner(str(tmp_path / "moe"), block_size=BLOCK_SIZE, num_blocks=8, attention_backend="triton")
    assert not PiecewiseGraphs.supported(moe.model)  # its routing reads token counts on the host
    torch_backend = ModelRunner(llama_dir, block_size=BLOCK_SIZE, num_blocks=8, attention_backend="torch_sdpa")
    assert not PiecewiseGraphs.supported(torch_backend.model)


def test_the_setting_is_on_where_decode_graphs_are_unless_turned_off():
    from llmbus.workers.graph_sizes import DEFAULT_PIECEWISE_GRAPHS, parse_piecewise_graphs
    from llmbus.workers.process import WorkerConfig

    unset = WorkerConfig.__dataclass_fields__["piecewise_graphs"].default
    assert parse_piecewise_graphs(unset, parse_cuda_graphs(None)) == DEFAULT_PIECEWISE_GRAPHS
    assert parse_piecewise_graphs(unset, parse_cuda_graphs("0")) == ()  # --cuda-graphs 0: no graphs at all
    assert parse_piecewise_graphs("0", parse_cuda_graphs(None)) == ()
    assert parse_piecewise_graphs("32,16", parse_cuda_graphs("0")) == (16, 32)


def test_a_captured_plan_hands_each_part_what_the_one_before_left(llama_dir, plain, monkeypatch):
    """The captured path's wiring, on the CPU: each part's "graph" is a stand-in whose replay runs the part
    again and writes its outputs over the tensors the capture made (where a CUDA graph's kernels write), so a
    step reads only what the capture kept (the heads each attention takes, rotated in the parts; the head
    graphs' logits and greedy choices) and what each replay left there. The continuous batch stays token-exact
    with transformers, its steps' tokens the head graphs' choices. The batch is ``mixed_requests``' (arrivals,
    a prompt in chunks over its cached blocks beside decodes): the plans keep nothing of a request between
    steps, so the family batch's preemption and prefix hit would only add steps of shapes these already have."""
    from llmbus.workers import piecewise_graphs

    class Replayed:
        def __init__(self, part, out):
            self.part, self.out = part, out

        def replay(self):
            made = self.part()
            for kept, new in zip(*((self.out, made) if isinstance(made, tuple) else ((self.out,), (made,)))):
                kept.copy_(new)

    def capture(plan, part):
        part()  # the warm call before a capture
        out = part()
        plan.graphs.append(Replayed(part, out))
        return out

    monkeypatch.setattr(piecewise_graphs._Captures, "_capture", capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "Stream", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    prompts, expected = make_prompts(VOCAB), plain
    runner = ModelRunner(llama_dir, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, attention_backend="triton")
    runner.piecewise = PiecewiseGraphs(runner.model, (8, 32))
    plan = runner.piecewise.plans[8]
    assert len(plan.graphs) == len(runner.model.layers) + 1 == len(plan.inputs) + 1
    assert [len(head.graphs) for head in runner.piecewise.logits_plans.values()] == [1] * 6  # 32 to 1 rows
    replays, heads = [], []
    run, head_run = piecewise_graphs._Plan.run, piecewise_graphs._LogitsPlan.run
    monkeypatch.setattr(piecewise_graphs._Plan, "run", lambda self, *a: replays.append(self.size) or run(self, *a))
    monkeypatch.setattr(piecewise_graphs._LogitsPlan, "run", lambda self: heads.append(self.rows) or head_run(self))
    requests = mixed_requests(prompts)
    for request in requests:  # the wiring, not the length: SHORT tokens each
        request.max_new_tokens = SHORT
    results = drive(runner, requests)
    for i in range(len(prompts)):
        assert results[f"r{i}"].tokens == expected.tokens[i][:SHORT], f"r{i}"
    assert set(replays) == {8, 32}
    assert heads and len(heads) == len(replays)  # (no step of this batch has more than 32 logits rows)


def test_padding_rows_do_not_lengthen_the_last_sequence_under_longrope(tmp_path):
    """LongRoPE takes short or long factors from the last position of each sequence in the step. A 5-token
    prompt in the bucket of 8 after an 8-token one: the padding rows keep the stale positions 5, 6, 7, and were
    they counted as its rows, its last position would pass the original length of 6 and its real rows would
    rotate with the long factors. Each padding row starts a sequence of its own; the step's logits equal the
    eager step's, where the prompt ends at 4."""
    from llmbus.testing.families import save_tiny_family

    half = 8
    save_tiny_family(str(tmp_path), "Phi3Config", original_max_position_embeddings=6, rope_parameters=dict(
        rope_type="longrope", rope_theta=10000.0, short_factor=[1.0] * half,
        long_factor=[4.0 ** i for i in range(half)]))
    runner, counts = _runner(str(tmp_path), (8,))
    assert runner.model.rotary.rope_type == "longrope"

    def prompt(rid, length, table):
        return [SeqInput(rid=rid, token_ids=list(range(3, 3 + length)), num_computed=0, block_table=table,
                         sample=True, sampling=SamplingParams())]

    with torch.inference_mode():
        runner._forward(prompt("a", 8, [0, 1]), runner.kv_cache)
        logits = runner._forward(prompt("b", 5, [2, 3]), runner.kv_cache).clone()
        assert counts == [8, 5]
        runner.piecewise = None
        eager = runner._forward(prompt("b", 5, [2, 3]), runner.kv_cache)
    torch.testing.assert_close(logits, eager)


def test_piecewise_parts_over_two_ranks_are_token_exact(llama_dir, plain, tmp_path):
    """Tensor parallelism: the embedding's, each attention output's and each MLP's all-reduce run inside the
    parts, over the padded rows too, on two gloo ranks, in whole buckets (each rank's attention over its own
    heads through its fixed index, as ``--full-graphs`` holds it); every request's tokens equal transformers'
    (each rank fails the run where no step took the parts padded). The parts with their attention eager
    between them run on one rank in ``test_a_continuous_batch_through_the_piecewise_parts_is_token_exact``:
    the all-reduces in the parts are the same either way. The batch is ``mixed_requests``' (prompts padded to
    buckets, a prompt in chunks over its cached blocks beside decodes, decode-only steps padded): the family
    batch's preemption and prefix hit go through the same parts in the one-rank tests, and add no collective."""
    from llmbus.testing.runner_driver import drive_tensor_parallel

    prompts = make_prompts(VOCAB)
    requests = mixed_requests(prompts)
    for request in requests:  # the kernels run interpreted: seconds a step on each rank
        request.max_new_tokens = SHORT
    results = drive_tensor_parallel(llama_dir, {"mixed": requests}, str(tmp_path),
                                    attention_backend="triton", piecewise=(4, 8, 16, 32), whole=True)["mixed"]
    for i in range(len(prompts)):
        assert results[f"r{i}"][0] == plain.tokens[i][:SHORT], f"r{i}"


def _warming_runner(monkeypatch, world_size: int, compile_error: Exception | None = None):
    """A stand-in for a GPU runner in ``RunnerWarmup._capture_piecewise``: its compile steps recorded (and
    raising ``compile_error``), the CUDA calls of a failure path made no-ops."""
    import types

    from llmbus.workers import runner_warmup

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    runner = types.SimpleNamespace(piecewise_sizes=(16, 32), device=torch.device("cpu"), model=None,
                                   piecewise="stale", world_size=world_size, _piecewise_wanted=lambda: True,
                                   compiled=[])

    def compile_steps(cache, lengths):
        runner.compiled.append((cache, lengths))
        if compile_error is not None:
            raise compile_error

    runner._compile_short_queries = compile_steps
    runner._compile_decode_rows = lambda cache, rows: runner.compiled.append((cache, rows))
    runner._piecewise_failed = types.MethodType(runner_warmup.RunnerWarmup._piecewise_failed, runner)
    runner._agree_on_piecewise = types.MethodType(runner_warmup.RunnerWarmup._agree_on_piecewise, runner)
    runner._on_every_rank = types.MethodType(runner_warmup.RunnerWarmup._on_every_rank, runner)
    return runner


@pytest.mark.parametrize("outcome", ["off", "whole", "failed before", "failed midway"])
def test_full_graphs_capture_the_buckets_again_over_the_pool_or_leave_the_steps_eager(monkeypatch, outcome):
    """``--full-graphs``: once the pool exists, the piecewise graphs are asked to attend in their graphs over
    it, for tables as long as the model's context. A failure before any bucket was redone (the index's
    buffers) leaves the parts serving; one after, steps with prompt rows eager; either said."""
    import structlog

    from llmbus.workers import runner_warmup

    asked = []

    class Pieces:
        index = None

        def attend_in_graphs(self, kv_cache, max_blocks):
            asked.append((kv_cache, max_blocks))
            if outcome == "failed before":
                raise torch.OutOfMemoryError("CUDA out of memory")
            self.index = "index"
            if outcome == "failed midway":
                raise RuntimeError("operation not permitted when stream is capturing")

    runner = _warming_runner(monkeypatch, 1)
    pieces = Pieces()
    runner.piecewise, runner.full_graphs, runner.kv_cache = pieces, outcome != "off", "pool"
    runner.context_blocks = 7  # (100 positions in blocks of 16)
    with structlog.testing.capture_logs() as logs:
        runner_warmup.RunnerWarmup._capture_whole_piecewise(runner)
    assert asked == ([] if outcome == "off" else [("pool", 7)])
    assert runner.piecewise is (None if outcome == "failed midway" else pieces)
    warnings = [entry for entry in logs if entry["log_level"] == "warning"]
    if outcome.startswith("failed"):
        (warning,) = warnings
        assert "--full-graphs" in warning["event"]
        assert ("eagerly" if outcome == "failed midway" else "their parts serve") in warning["event"]
        assert ("stream is capturing" if outcome == "failed midway" else "out of memory") in warning["error"]
    else:
        assert warnings == []


def test_a_capture_that_fails_leaves_prompt_steps_eager_and_says_why(monkeypatch):
    """On by default, so a model whose layers do not capture must still start: eager steps, a warning."""
    import structlog

    from llmbus.workers import runner_warmup

    class Uncapturable:
        def __init__(self, model, sizes):
            raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(runner_warmup, "PiecewiseGraphs", Uncapturable)
    runner = _warming_runner(monkeypatch, 1)
    with structlog.testing.capture_logs() as logs:
        runner_warmup.RunnerWarmup._capture_piecewise(runner, "scratch")
    assert runner.piecewise is None and runner.compiled == []
    (warning,) = [entry for entry in logs if entry["log_level"] == "warning"]
    assert "eagerly" in warning["event"] and "stream is capturing" in warning["error"]


def test_the_parts_attention_compiles_at_warmup_for_every_query_tile_or_the_steps_stay_eager(monkeypatch):
    """After the capture, one step of each query tile through the parts (their attention writes the keys
    as it attends: kernels of their own), over the warmup's scratch pool; a compilation that fails leaves the
    steps eager with the reason, as a failed capture does."""
    import structlog

    from llmbus.workers import runner_warmup

    monkeypatch.setattr(runner_warmup, "PiecewiseGraphs", lambda model, sizes: "captured")
    runner = _warming_runner(monkeypatch, 1)
    runner_warmup.RunnerWarmup._capture_piecewise(runner, "scratch")
    assert runner.piecewise == "captured"
    # a step of each query tile, and one of decodes alone past the decode graphs (bounded by the largest bucket)
    assert runner.compiled == [("scratch", runner_warmup.PIECEWISE_QUERY_LENGTHS), ("scratch", 32)]
    assert {triton_kernels.query_tile(n) for n in runner_warmup.PIECEWISE_QUERY_LENGTHS} == {1, 2, 4, 8, 16}
    runner = _warming_runner(monkeypatch, 1, RuntimeError("PassManager::run failed"))
    with structlog.testing.capture_logs() as logs:
        runner_warmup.RunnerWarmup._capture_piecewise(runner, "scratch")
    assert runner.piecewise is None
    (warning,) = [entry for entry in logs if entry["log_level"] == "warning"]
    assert "did not compile" in warning["event"] and "PassManager" in warning["error"]


@pytest.mark.parametrize("elsewhere", [True, False], ids=["captured everywhere", "failed on another rank"])
def test_ranks_of_a_group_run_prompt_steps_alike(monkeypatch, elsewhere):
    """The parts hold the group's collectives: a rank keeps them only where every rank captured them (the
    group's MIN of a flag, stood in for here by the other rank's)."""

    import structlog

    from llmbus.workers import runner_warmup

    class Captured:
        def __init__(self, model, sizes):
            pass

    def all_reduce(flag, op):
        assert op == torch.distributed.ReduceOp.MIN
        flag.copy_(torch.minimum(flag, torch.tensor([int(elsewhere)])))

    monkeypatch.setattr(runner_warmup, "PiecewiseGraphs", Captured)
    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    runner = _warming_runner(monkeypatch, 2)  # (a GPU rank's flag: here)
    with structlog.testing.capture_logs() as logs:
        runner_warmup.RunnerWarmup._capture_piecewise(runner, "scratch")
    assert isinstance(runner.piecewise, Captured) is elsewhere
    assert any("another rank" in entry["event"] for entry in logs) is not elsewhere
    assert bool(runner.compiled) is elsewhere  # the compile steps' collectives: every rank runs them, or none


@pytest.mark.parametrize("elsewhere", [True, False], ids=["whole everywhere", "not whole on another rank"])
def test_ranks_of_a_group_hold_their_attention_in_graphs_alike(monkeypatch, elsewhere):
    """``--full-graphs`` with two ranks: a rank keeps its whole buckets only where every rank made them; else
    every rank runs steps with prompt rows eagerly (the other rank's flags stood in for)."""
    import structlog

    from llmbus.workers import runner_warmup

    class Whole:
        index = None

        def attend_in_graphs(self, kv_cache, max_blocks):
            self.index = "index"

    def all_reduce(flag, op):
        assert op == torch.distributed.ReduceOp.MIN
        flag.copy_(torch.minimum(flag, torch.tensor([int(elsewhere)])))

    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    runner = _warming_runner(monkeypatch, 2)
    runner.piecewise, runner.full_graphs, runner.kv_cache = Whole(), True, "pool"
    runner.context_blocks = 4
    with structlog.testing.capture_logs() as logs:
        runner_warmup.RunnerWarmup._capture_whole_piecewise(runner)
    assert isinstance(runner.piecewise, Whole) is elsewhere
    assert any("whole on another rank" in entry["event"] for entry in logs) is not elsewhere
