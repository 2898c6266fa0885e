"""CUDA graphs of decode steps (``workers/cuda_graphs.py``), checked on the CPU: ``DecodeGraphs`` with
``capture=False`` runs the forward a graph would replay (the padded batch size, every input read from the
persistent buffers, padding rows on the spare block) eagerly, with the Triton backend's kernels under Triton's
interpreter. A continuous batch driven through it stays token-exact with transformers, and the steps it takes
are exactly the decode-only ones. The capture itself runs on a GPU (benchmarks/gpu_check.py)."""

import pytest
import torch

from llmbus.testing.families import family_requests
from llmbus.testing.runner_driver import (BLOCK_SIZE, NUM_BLOCKS, drive, make_prompts,
                                          reference)
from llmbus.testing.triton_interpret import interpreted_triton_kernels
from llmbus.workers import gpu_ops
from llmbus.workers.cuda_graphs import DecodeGraphs
from llmbus.workers.graph_sizes import DEFAULT_CUDA_GRAPHS, cuda_graphs_problem, parse_cuda_graphs
from llmbus.workers import model_runner
from llmbus.workers.model_runner import ModelRunner, SeqInput
from llmbus.workers.sampling import sample
from llmbus.bus.messages import SamplingParams

triton_kernels = interpreted_triton_kernels()
VOCAB = 256
# Tokens per request of the batches driven through the graphs: their kernels run interpreted, a few seconds a
# step, and the wiring shows in 7 as in 12 (r1 is still preempted after 5, decode-only steps still need padding).
SHORT = 7


pytestmark = pytest.mark.usefixtures("interpreted_triton")


def _short(requests: list) -> list:
    for request in requests:
        request.max_new_tokens = SHORT
    return requests


def _runner_with_graphs(model_dir: str, sizes: tuple[int, ...], **kwargs) -> tuple[ModelRunner, list[list]]:
    """A Triton-backend runner (``kwargs``: more of ModelRunner's) whose decode steps go through uncaptured
    graphs; and the sequences of each step that did."""
    runner = ModelRunner(model_dir, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, attention_backend="triton",
                         **kwargs)
    max_blocks = -(-runner.max_position_embeddings // BLOCK_SIZE)
    runner.graphs = DecodeGraphs(runner.model, runner.kv_cache, sizes, max_blocks, capture=False,
                                 adapter_index=runner._adapter_index)
    replayed: list[list] = []
    forward = runner.graphs.forward
    runner.graphs.forward = lambda seqs, feed=None: replayed.append(list(seqs)) or forward(seqs, feed)
    return runner, replayed


@pytest.mark.parametrize("feed_on_device", [False, True], ids=["host-fed", "device-fed"])
def test_a_continuous_batch_through_the_graph_buffers_is_token_exact(llama_dir, plain, monkeypatch, feed_on_device):
    """Arrivals, a chunked prompt beside decodes, a prefix hit and a preemption: the decode-only steps take
    the buffers (at sizes that need padding: 3 rows in a graph of 4, 5 in 8), the rest run eagerly, and
    every request's tokens equal transformers' greedy ones. The layers' small ops run as the GPU runs them,
    as gpu_ops' Triton kernels and the backend's fused RoPE and K/V write (here interpreted). Device-fed: the
    decode rows take their tokens from the step before's sampled ids, written over the staged ones (as a step
    sent ahead does on a GPU). A replayed step's greedy rows take the graph's own choice, sampled nowhere else."""
    fused = []
    for module, name in ((gpu_ops, "rms_norm"), (triton_kernels, "rotary_kv_write"), (gpu_ops, "silu_and_mul")):
        op = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, op=op, name=name, **k: fused.append(name) or op(*a, **k))
    prompts = make_prompts(VOCAB)
    runner, replayed = _runner_with_graphs(llama_dir, (1, 2, 4, 8))
    steps: list[set] = []  # what each step did: a replayed step's greedy rows take the graph's own choice
    launch, forward = runner.launch, runner.graphs.forward
    monkeypatch.setattr(runner, "launch", lambda *a, **k: steps.append(set()) or launch(*a, **k))
    monkeypatch.setattr(runner.graphs, "forward", lambda *a, **k: steps[-1].add("replay") or forward(*a, **k))
    monkeypatch.setattr(model_runner, "sample", lambda *a, **k: steps[-1].add("sample") or sample(*a, **k))
    results = drive(runner, _short(family_requests(prompts)), feed_on_device=feed_on_device)
    assert {"replay"} in steps and {"sample"} in steps and {"replay", "sample"} not in steps
    for i in range(len(prompts)):
        assert results[f"r{i}"].tokens == plain.tokens[i][:SHORT], f"r{i}"
    assert results["hit"].tokens == plain.tokens[4][:SHORT]
    assert results["r1"].preemptions == 1
    sizes = [len(seqs) for seqs in replayed]
    assert sizes and set(sizes) - {1, 2, 4, 8}, f"no step needed padding: {sizes}"
    assert set(fused) == {"rms_norm", "rotary_kv_write", "silu_and_mul"}


def test_logit_bias_and_min_tokens_rows_are_sampled_beside_the_graphs_choice_as_transformers_processes_them(
        llama_dir, plain, monkeypatch):
    """OpenAI's logit_bias and vLLM's min_tokens through the graph buffers: a step with such a row still replays its
    forward, but its rows are chosen by ``sample`` from the processed logits (the graph's own argmax knows neither);
    every request's tokens and logprobs equal transformers' ``generate`` with the bias as one-token
    ``sequence_bias``, and min_tokens as its ``MinNewTokensLengthLogitsProcessor`` (masking, not stopping)."""
    from transformers import LogitsProcessorList
    from transformers.generation.logits_process import MinNewTokensLengthLogitsProcessor

    from llmbus.testing.runner_driver import Request

    prompts = make_prompts(VOCAB)
    # none; a ban on the third token it would say; a boost for its last (of SHORT); a ban on its first with a
    # boost beside
    biases = [None, {plain.tokens[1][2]: -100.0}, {plain.tokens[2][SHORT - 1]: 6.0},
              {plain.tokens[3][0]: -100.0, 17: 2.5}, None]
    # the last request may not say its second token before its sixth
    masked, minimum = plain.tokens[4][1], 6
    kwargs = [{"sequence_bias": [[[t], v] for t, v in bias.items()]} if bias else None for bias in biases]
    kwargs[4] = {"logits_processor": LogitsProcessorList([MinNewTokensLengthLogitsProcessor(
        len(prompts[4]), minimum, [masked])])}
    expected = reference(llama_dir, prompts, generate_kwargs=kwargs)
    assert expected.tokens[0] == plain.tokens[0]
    assert all(expected.tokens[i][:SHORT] != plain.tokens[i][:SHORT] for i in (1, 2, 3, 4)), \
        "a processor that changes nothing in the tokens compared"
    assert masked not in expected.tokens[4][:minimum] and masked in plain.tokens[4][:minimum]
    runner, _ = _runner_with_graphs(llama_dir, (1, 2, 4, 8))
    steps: list[set] = []
    launch, forward = runner.launch, runner.graphs.forward
    monkeypatch.setattr(runner, "launch", lambda *a, **k: steps.append(set()) or launch(*a, **k))
    monkeypatch.setattr(runner.graphs, "forward", lambda *a, **k: steps[-1].add("replay") or forward(*a, **k))
    monkeypatch.setattr(model_runner, "sample", lambda *a, **k: steps[-1].add("sample") or sample(*a, **k))
    sampling = [SamplingParams(logit_bias_ids=list(bias or {}), logit_bias_values=list((bias or {}).values()))
                for bias in biases]
    sampling[4] = SamplingParams(min_new_tokens=minimum, min_tokens_masked_ids=[masked])
    requests = [Request(rid=f"r{i}", prompt=prompt, sampling=params, max_new_tokens=SHORT)
                for i, (prompt, params) in enumerate(zip(prompts, sampling))]
    requests[4].arrival_step = SHORT  # alone after the others (steps 0 to SHORT - 1): its steps hold no biased row
    results = drive(runner, requests)
    assert {"replay", "sample"} in steps
    for i in range(len(prompts)):
        assert results[f"r{i}"].tokens == expected.tokens[i][:SHORT], f"r{i}: {sampling[i]}"
        torch.testing.assert_close(torch.tensor(results[f"r{i}"].logprobs), expected.greedy_logprobs(i)[:SHORT],
                                   rtol=0, atol=1e-4)


def test_lora_adapter_rows_replay_the_graphs_with_each_rows_own_adapter(llama_dir, plain, tmp_path):
    """A GPU's path for LoRA, on the CPU: base requests and requests on two adapters decode together through
    the graph buffers, each row's adapter staged with its token (the deltas as Triton kernels, interpreted);
    steps with adapter rows take the graphs holding the adapters' kernels, steps without them the plain ones,
    and every request's tokens equal PEFT's with its adapter or transformers'."""
    from llmbus.testing.lora import lora_reference, on_adapters, save_lora_adapter
    from llmbus.testing.runner_driver import Request

    adapters = {"a": save_lora_adapter(llama_dir, str(tmp_path / "a"), ["q_proj", "v_proj", "o_proj", "down_proj"],
                                       seed=3),
                "b": save_lora_adapter(llama_dir, str(tmp_path / "b"), ["k_proj", "gate_proj", "up_proj"], r=8,
                                       seed=9)}
    prompts = make_prompts(VOCAB)[:2]
    expected = {"": plain.tokens[:2],
                **{name: lora_reference(llama_dir, folder, prompts).tokens for name, folder in adapters.items()}}
    runner, replayed = _runner_with_graphs(llama_dir, (1, 2, 4, 8), lora_adapters=tuple(adapters.items()))
    adapter_of = {f"{name}{i}": name for name in adapters for i in range(2)}  # 6 rows: within the graph of 8
    requests = ([Request(f"base{i}", p, max_new_tokens=8) for i, p in enumerate(prompts)]
                + [Request(f"{name}{i}", p, arrival_step=2, max_new_tokens=4) for name in adapters
                   for i, p in enumerate(prompts)])
    results = drive(runner, on_adapters(requests, adapter_of))
    for rid, request in results.items():
        adapter, i = adapter_of.get(rid, ""), int(rid[-1])
        assert request.tokens == expected[adapter][i][:len(request.tokens)], rid
        assert len(request.tokens) == (4 if adapter else 8), rid
    kinds = [{s.adapter for s in seqs} for seqs in replayed]
    assert {"", "a", "b"} in kinds  # base rows and both adapters in one replayed step
    assert {""} in kinds  # and base-only steps, before the adapters' requests came and after they ended
    assert runner.graphs.lora


def test_only_decode_only_steps_within_the_sizes_replay(llama_dir):
    runner, _ = _runner_with_graphs(llama_dir, (1, 2))
    graphs = runner.graphs

    def row(tokens, table=(0,), **kw) -> SeqInput:
        return SeqInput(rid="r", token_ids=list(tokens), num_computed=1, block_table=list(table), sample=True,
                        sampling=SamplingParams(), **kw)
    assert graphs.applies([row([5])]) and graphs.applies([row([5]), row([6])])
    assert not graphs.applies([row([5])] * 3)  # above the largest size
    assert not graphs.applies([row([5, 6])])  # a prompt chunk
    assert not graphs.applies([row([5, 6], num_spec=1)])  # speculative rows
    assert not graphs.applies([row([5], table=range(graphs.max_blocks + 1))])
    assert not graphs.applies([row([5]) if i else SeqInput("p", [1], 0, [0], False, SamplingParams())
                               for i in range(2)])


def test_cuda_graph_sizes_parse_as_tgis_flag():
    assert parse_cuda_graphs(None) == DEFAULT_CUDA_GRAPHS
    assert parse_cuda_graphs("8,1, 2,2") == (1, 2, 8)
    assert parse_cuda_graphs("0") == () and parse_cuda_graphs("") == ()
    assert "must list batch sizes" in cuda_graphs_problem("1,two")
    assert "must list batch sizes" in cuda_graphs_problem("-1")
    assert cuda_graphs_problem("1,2,4") is None


def test_no_graphs_off_cuda_or_for_a_backend_that_cannot_be_captured(llama_dir):
    cpu = ModelRunner(llama_dir, block_size=BLOCK_SIZE, num_blocks=8, cuda_graphs=(1, 2))
    cpu.warmup()
    assert cpu.graphs is None and cpu.compute_paths["cuda_graphs"] == []
    portable = ModelRunner(llama_dir, block_size=BLOCK_SIZE, num_blocks=8, attention_backend="torch_sdpa")
    assert not DecodeGraphs.supported(portable.model)
    triton = ModelRunner(llama_dir, block_size=BLOCK_SIZE, num_blocks=8, attention_backend="triton")
    assert DecodeGraphs.supported(triton.model)
    assert torch.equal(torch.tensor(triton_kernels.query_tile(1)), torch.tensor(1))


def test_a_padded_step_writes_only_its_rows_slots_and_the_spare_block(llama_dir):
    """3 rows in the graph of 4: the pool changes at the 3 rows' slots and in the spare block only, and
    each row's logits equal those of the same step run eagerly."""
    runner, replayed = _runner_with_graphs(llama_dir, (4,))
    seqs = [SeqInput(rid=f"s{i}", token_ids=[7 + i], num_computed=i + 1, block_table=[2 * i, 2 * i + 1],
                     sample=True, sampling=SamplingParams()) for i in range(3)]
    key = runner.kv_cache.key
    before = key.clone()
    with torch.inference_mode():
        logits = runner._forward(seqs, runner.kv_cache).clone()
        assert [len(seqs) for seqs in replayed] == [3]
        changed = (key != before).any(dim=-1).any(dim=1)  # [layers, blocks + 1, block_size]
        spare = runner.kv_cache.num_blocks
        written = {(int(b), int(o)) for b, o in changed.any(dim=0).nonzero()}
        assert written - {(spare, o) for o in range(BLOCK_SIZE)} == {(2 * i, i + 1) for i in range(3)}
        assert changed[:, spare].any(), "the padding row wrote nowhere"
        runner.graphs = None
        eager = runner._forward(seqs, runner.kv_cache)
    torch.testing.assert_close(logits, eager)


def test_a_mixture_of_experts_is_not_captured(tmp_path):
    """Its routing reads each expert's token count on the host, which a graph cannot replay."""
    from llmbus.testing.families import save_tiny_family

    save_tiny_family(str(tmp_path), "MixtralConfig", num_local_experts=4, num_experts_per_tok=2)
    runner = ModelRunner(str(tmp_path), block_size=BLOCK_SIZE, num_blocks=8, attention_backend="triton")
    assert not DecodeGraphs.supported(runner.model)


def test_the_tables_kept_on_the_device_follow_every_request(llama_dir):
    """Steps of 1-4 rows whose tables grow (a block appended now and then): after each staging, every row's
    table, position and KV slot in the graph's buffers are the host's. Six requests first (their 8 slots
    are enough): one is dropped and comes back with another table, and one's table changes without a drop
    (the scheduler never does that) and is uploaded again; then 24, whose slots pass from request to request
    (the least recently stepped one gives its up)."""
    runner, _ = _runner_with_graphs(llama_dir, (1, 2, 4))
    graphs = runner.graphs
    assert graphs.padding_slot == 8
    rng = torch.Generator().manual_seed(0)
    tables = {f"q{i}": [int(b) for b in torch.randperm(NUM_BLOCKS - 1, generator=rng)[:1 + i % 3]]
              for i in range(24)}
    lengths = {rid: len(t) * BLOCK_SIZE - 1 for rid, t in tables.items()}  # room for one more token

    def check(step_rids: list[str]) -> None:
        for rid in step_rids:  # each grows: one token, and a block when the last one is full
            lengths[rid] += 1
            if lengths[rid] == len(tables[rid]) * BLOCK_SIZE:
                tables[rid].append(int(torch.randint(NUM_BLOCKS - 1, (1,), generator=rng)))
        seqs = [SeqInput(rid, [5 + k], lengths[rid], list(tables[rid]), True, SamplingParams())
                for k, rid in enumerate(step_rids)]
        batch = graphs.sizes[sum(s < len(seqs) for s in graphs.sizes)]
        graphs._stage(seqs, batch)
        graphs._unpack(batch)
        for row, s in enumerate(seqs):
            assert graphs.inputs.tables[row, :len(s.block_table)].tolist() == s.block_table, (s.rid, row)
            assert graphs.small[:, row].tolist() == [
                s.token_ids[0], s.num_computed,
                s.block_table[s.num_computed // BLOCK_SIZE] * BLOCK_SIZE + s.num_computed % BLOCK_SIZE]
        for row in range(len(seqs), batch):  # padding: token 0 at position 0 in the spare block
            assert graphs.small[:, row].tolist() == [0, 0, graphs.spare_block * BLOCK_SIZE]
            assert graphs.inputs.tables[row, 0] == graphs.spare_block  # (columns past a table are never read)

    def steps(rids: list[str], count: int) -> None:
        for step in range(count):
            check([rids[int(i)] for i in torch.randperm(len(rids), generator=rng)[:1 + step % 4]])

    few = list(tables)[:6]
    steps(few, 20)
    runner.drop(["q0"])  # preempted: back with a new table, from its first token
    tables["q0"], lengths["q0"] = [NUM_BLOCKS - 2], 0
    check(["q0", "q1"])
    tables["q1"][-1] = NUM_BLOCKS - 3  # changed without a drop
    check(["q1"])
    steps(few, 20)
    assert len(graphs.slot_of) == 6
    steps(list(tables), 60)
    assert len(graphs.slot_of) == 8 and not graphs.free_slots


def test_steps_queued_on_the_device_stage_into_buffers_no_copy_still_reads(llama_dir):
    """--launch-depth queues steps on the device, so a step's staging copy may not have run when the next step
    stages: it takes another pinned buffer (up to STAGING_BUFFERS, then waits for the oldest copy), never one
    whose copy is pending. Stand-in events here stay pending for two queries after their record; what the
    graph reads is each step's rows, whichever buffer they came through."""
    from llmbus.workers import cuda_graphs

    class QueuedCopy:
        """A copy that runs two queries after it is queued, or when waited for."""
        def __init__(self):
            self.pending = 0
            self.waits = 0

        def record(self):  # after the buffer was written: its last copy must have run
            assert self.pending == 0, "a buffer was staged into while its copy was pending"
            self.pending = 2

        def query(self):
            self.pending -= self.pending > 0
            return self.pending == 0

        def synchronize(self):
            self.waits += 1
            self.pending = 0

    runner, _ = _runner_with_graphs(llama_dir, (1, 2, 4))
    graphs = runner.graphs
    made = []

    def new_stage():
        stage = torch.zeros(graphs.capacity, dtype=torch.int32)
        made.append((stage, stage.numpy(), QueuedCopy()))
        return made[-1]
    graphs.stages.clear()
    graphs.stages.append(new_stage())
    graphs._new_stage = new_stage
    used = []
    for step in range(12):
        position = 3 + step % 5  # within the rows' two blocks
        seqs = [SeqInput(f"q{i}", [7 + step], position, [i, 8 + i], True, SamplingParams()) for i in range(3)]
        graphs._stage(seqs, 4)
        used.append(graphs.stages[-1][0].data_ptr())
        graphs._unpack(4)
        assert graphs.small[:, :3].tolist() == [
            [7 + step] * 3, [position] * 3,
            [s.block_table[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE for s in seqs]]
    assert 1 < len(set(used)) == len(made) <= cuda_graphs.STAGING_BUFFERS
