"""The client libraries users already have, unmodified, against a real llmbus on the tiny model.

One server (float32, so greedy outputs can be compared with transformers): ``text-generation``'s
``Client`` and ``AsyncClient``, ``huggingface_hub.InferenceClient`` and the ``openai`` SDK. Greedy
answers must equal transformers' generate on the same checkpoint, whichever client asked.
"""

from __future__ import annotations

import asyncio

import pytest


MAX_NEW = 8
PROMPT = "The quick brown fox"
MESSAGES = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def server(tiny_server):
    """The shared tiny server: float32, ``--max-total-tokens 256`` (the refusal below names it) and
    ``--max-best-of 2``."""
    return tiny_server


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    return tok, AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def chat_reference(hf):
    """Greedy ids transformers generates for MESSAGES through the model's chat template."""
    tok, model = hf
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=None,
                         pad_token_id=tok.pad_token_id)
    return tok, out[0, ids["input_ids"].shape[1]:].tolist()


# --- text-generation ----------------------------------------------------------------------------


def test_text_generation_client(server, reference):
    from text_generation import Client
    from text_generation.errors import ValidationError

    client = Client(server.url, timeout=60)
    response = client.generate(PROMPT, max_new_tokens=MAX_NEW)
    ids = [t.id for t in response.details.tokens]
    assert ids == reference(PROMPT, MAX_NEW)
    assert response.details.finish_reason == "length" and response.details.generated_tokens == MAX_NEW
    streamed = list(client.generate_stream(PROMPT, max_new_tokens=MAX_NEW))
    assert [r.token.id for r in streamed] == ids
    assert streamed[-1].generated_text == response.generated_text
    assert streamed[-1].details.finish_reason == "length"

    best = client.generate(PROMPT, max_new_tokens=4, best_of=2, do_sample=True, top_n_tokens=2)
    assert len(best.details.best_of_sequences) == 1
    assert all(len(top) == 2 for top in best.details.top_tokens)

    with pytest.raises(ValidationError, match="must be <= 256"):
        client.generate(PROMPT, max_new_tokens=1000)


def test_text_generation_async_client(server, reference):
    from text_generation import AsyncClient

    async def run():
        client = AsyncClient(server.url, timeout=60)
        response = await client.generate(PROMPT, max_new_tokens=MAX_NEW)
        streamed = [r.token.id async for r in client.generate_stream(PROMPT, max_new_tokens=MAX_NEW)]
        return response, streamed

    response, streamed = asyncio.run(run())
    assert [t.id for t in response.details.tokens] == streamed == reference(PROMPT, MAX_NEW)


# --- huggingface_hub -----------------------------------------------------------------------------


def test_inference_client_text_generation(server, reference):
    from huggingface_hub import InferenceClient

    client = InferenceClient(base_url=server.url, timeout=60)
    # it posts to POST /, where TGI prepends the prompt unless the model's pipeline tag says otherwise
    full = client.text_generation(PROMPT, max_new_tokens=MAX_NEW)
    text = client.text_generation(PROMPT, max_new_tokens=MAX_NEW, return_full_text=False)
    assert full == PROMPT + text
    detailed = client.text_generation(PROMPT, max_new_tokens=MAX_NEW, details=True, return_full_text=False)
    assert detailed.generated_text == text
    assert [t.id for t in detailed.details.tokens] == reference(PROMPT, MAX_NEW)
    assert "".join(client.text_generation(PROMPT, max_new_tokens=MAX_NEW, stream=True)) == text
    events = list(client.text_generation(PROMPT, max_new_tokens=MAX_NEW, stream=True, details=True))
    assert [e.token.id for e in events] == [t.id for t in detailed.details.tokens]
    assert events[-1].details.finish_reason == "length"


def test_inference_client_chat_completion(server, chat_reference):
    from huggingface_hub import InferenceClient

    tok, expected = chat_reference
    client = InferenceClient(base_url=server.url, timeout=60)
    out = client.chat_completion(MESSAGES, max_tokens=MAX_NEW, temperature=0)
    assert out.choices[0].message.content == tok.decode(expected, skip_special_tokens=True)
    assert out.usage.completion_tokens == MAX_NEW
    chunks = list(client.chat_completion(MESSAGES, max_tokens=MAX_NEW, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == out.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


# --- openai --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def openai_client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=60)


def test_openai_chat_stream_with_usage(openai_client, chat_reference):
    tok, expected = chat_reference
    stream = openai_client.chat.completions.create(
        model="tgi", messages=MESSAGES, max_tokens=MAX_NEW, temperature=0, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == tok.decode(expected, skip_special_tokens=True)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_NEW
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + MAX_NEW
    assert len({c.id for c in chunks}) == 1 and chunks[0].id


def test_openai_chat_n2(openai_client):
    out = openai_client.chat.completions.create(model="tgi", messages=MESSAGES, max_tokens=MAX_NEW, n=2,
                                                seed=5, temperature=0.9, logprobs=True, top_logprobs=2)
    assert [c.index for c in out.choices] == [0, 1]
    assert all(len(c.logprobs.content) == MAX_NEW for c in out.choices)
    assert out.usage.completion_tokens == 2 * MAX_NEW
    again = openai_client.chat.completions.create(model="tgi", messages=MESSAGES, max_tokens=MAX_NEW, n=2,
                                                  seed=5, temperature=0.9)
    assert [c.message.content for c in again.choices] == [c.message.content for c in out.choices]


def test_openai_completions(openai_client, reference, tiny_model_dir):
    from transformers import AutoTokenizer

    out = openai_client.completions.create(model="tgi", prompt=PROMPT, max_tokens=MAX_NEW, temperature=0)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == MAX_NEW
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert out.choices[0].text == tok.decode(reference(PROMPT, MAX_NEW), skip_special_tokens=True)
    stream = openai_client.completions.create(model="tgi", prompt=[PROMPT, "Hello"], max_tokens=MAX_NEW,
                                              temperature=0, stream=True)
    texts = {0: "", 1: ""}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts[0] == out.choices[0].text


def test_openai_errors_are_typed(openai_client):
    import openai

    with pytest.raises(openai.UnprocessableEntityError) as raised:
        openai_client.chat.completions.create(model="tgi", messages=MESSAGES, top_p=1.5)
    assert raised.value.body["code"] == "validation" and raised.value.body["param"] == "top_p"


def test_presence_penalty_matches_a_transformers_logits_processor(server, hf, openai_client):
    """OpenAI's presence penalty, written as a transformers LogitsProcessor over the generated tokens,
    gives the same greedy tokens as llmbus (through both the native and the OpenAI route)."""
    import torch
    from transformers import LogitsProcessorList

    from llmbus.testing.http import post

    tok, model = hf
    penalty, max_new = -2.0, 16  # negative: rewards repeats, which this random model rarely makes unasked
    ids = tok(PROMPT, return_tensors="pt").input_ids

    def presence(input_ids, scores):
        generated = input_ids[:, ids.shape[1]:]
        present = torch.zeros_like(scores).scatter_(1, generated, 1.0) if generated.numel() else 0.0
        return scores - penalty * present

    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new,
                         eos_token_id=None, pad_token_id=tok.pad_token_id,
                         logits_processor=LogitsProcessorList([presence]))
    expected = out[0, ids.shape[1]:].tolist()
    plain = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new,
                           eos_token_id=None, pad_token_id=tok.pad_token_id)[0, ids.shape[1]:].tolist()
    assert expected != plain, "the penalty must change this greedy continuation for the test to mean anything"

    status, _, body = post(f"{server.url}/generate", {"inputs": PROMPT, "parameters": {
        "max_new_tokens": max_new, "presence_penalty": penalty, "details": True}})
    assert status == 200 and [t["id"] for t in body["details"]["tokens"]] == expected
    completion = openai_client.completions.create(model="tgi", prompt=PROMPT, max_tokens=max_new, temperature=0,
                                                  presence_penalty=penalty)
    assert completion.choices[0].text == tok.decode(expected, skip_special_tokens=True)


def test_metrics_count_every_request(server):
    from llmbus.testing.http import metrics, post

    n, generated = 5, 0
    before = metrics(server.url)
    for i in range(n):
        status, _, body = post(f"{server.url}/generate", {"inputs": f"{PROMPT} {i}",
                                                          "parameters": {"max_new_tokens": 3, "details": True}})
        assert status == 200
        generated += body["details"]["generated_tokens"]
    after = metrics(server.url)
    for name in ("tgi_request_count", "tgi_request_success", "tgi_request_duration_count",
                 "tgi_request_queue_duration_count", "tgi_request_generated_tokens_count"):
        assert after[name] - before.get(name, 0) == n, name
    assert after["tgi_request_generated_tokens_sum"] - before.get("tgi_request_generated_tokens_sum", 0) == generated
