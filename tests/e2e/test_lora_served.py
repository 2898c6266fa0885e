"""LoRA adapters through the whole stack: `llmbus up --lora-adapters` on the tiny demo model, two PEFT
adapters (every projection, and queries and values only), real processes, sockets and HTTP.

Each request's greedy tokens equal PEFT's float32 ``generate`` with its adapter (the base model's without
one), alone and with the base model and both adapters in one batch, after the base model cached the same
prompts: a prefix cache shared across adapters, a delta applied to the wrong rows or left out, would show
as other tokens (``lora_reference`` checks every compared step's margin is decisive)."""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from llmbus.testing import Server
from llmbus.testing.http import get, metrics, post
from llmbus.testing.lora import lora_reference, save_lora_adapter
from llmbus.testing.tiny_prompts import MAX_NEW, PROMPTS, generate, ids_of, tiny_server_args

ADAPTERS = {"sql": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
            "poet": ["q_proj", "v_proj"]}
ASKED = PROMPTS[:4]


@pytest.fixture(scope="module")
def adapter_dirs(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    return {name: save_lora_adapter(str(tiny_model_dir), str(root / name), targets, seed=i + 1)
            for i, (name, targets) in enumerate(ADAPTERS.items())}


@pytest.fixture(scope="module")
def expected(tiny_model_dir, adapter_dirs):
    """PEFT's greedy tokens of each prompt, per adapter ("" the base model)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = [tokenizer(p).input_ids for p in ASKED]
    return {name: dict(zip(ASKED, lora_reference(str(tiny_model_dir), folder, prompts).tokens))
            for name, folder in {"": None, **adapter_dirs}.items()}


@pytest.fixture(scope="module")
def server(tiny_model_dir, adapter_dirs):
    lora = ",".join(f"{name}={folder}" for name, folder in adapter_dirs.items())
    srv = Server([*tiny_server_args(tiny_model_dir), "--lora-adapters", lora])
    yield srv
    assert srv.stop() == 0, srv.stderr.text[-3000:]


def served(server, prompt: str, adapter: str) -> list[int]:
    body, _ = generate(server, prompt, **({"adapter_id": adapter} if adapter else {}))
    return ids_of(body)


def matches(got: list[int], want: list[int]) -> bool:
    """The served tokens are PEFT's up to where the server stopped (an EOS ends the served answer)."""
    return got == want[:len(got)] and (len(got) == MAX_NEW or len(got) == len(want))


def test_each_adapter_answers_as_peft_alone_and_in_one_batch(server, expected):
    assert expected["sql"] != expected[""] and expected["poet"] != expected[""]  # the adapters change answers
    for prompt in ASKED:  # the base model first: its prompts' blocks are cached when the adapters ask
        assert matches(served(server, prompt, ""), expected[""][prompt]), prompt
    for adapter in ("sql", "poet"):
        for prompt in ASKED:
            assert matches(served(server, prompt, adapter), expected[adapter][prompt]), (adapter, prompt)
    jobs = [(prompt, adapter) for prompt in ASKED for adapter in ("", "sql", "poet")] * 2
    with ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(lambda job: served(server, *job), jobs))
    for (prompt, adapter), got in zip(jobs, together):
        assert matches(got, expected[adapter][prompt]), (adapter, prompt)


def test_openai_model_names_an_adapter_and_is_echoed(server, expected):
    prompt = ASKED[1]
    status, _, answer = post(server.url + "/v1/completions", {"model": "poet", "prompt": prompt,
                                                               "max_tokens": MAX_NEW, "temperature": 0})
    assert status == 200 and answer["model"] == "poet", answer
    assert answer["choices"][0]["text"] == generate(server, prompt, adapter_id="poet")[0]["generated_text"]
    status, _, answer = post(server.url + "/v1/completions", {"model": "gpt-4o", "prompt": prompt,
                                                               "max_tokens": MAX_NEW, "temperature": 0})
    assert status == 200 and answer["model"] != "gpt-4o", answer  # any other name: the base model
    assert answer["choices"][0]["text"] == generate(server, prompt)[0]["generated_text"]
    status, listed = get(server.url + "/v1/models")
    base = listed["data"][0]["id"]
    assert [(m["id"], m.get("parent")) for m in listed["data"]] == [(base, None), ("sql", base), ("poet", base)]
    from openai import NotFoundError, OpenAI

    sdk = OpenAI(base_url=server.url + "/v1", api_key="-")  # models.retrieve: each card by its id, slashes too
    assert [sdk.models.retrieve(card["id"]).model_dump(exclude_none=True) for card in listed["data"]] == listed["data"]
    with pytest.raises(NotFoundError, match="The model `gpt-4o` does not exist"):
        sdk.models.retrieve("gpt-4o")


def test_huggingface_hub_selects_an_adapter_as_it_does_on_tgi(server):
    from huggingface_hub import InferenceClient

    prompt = ASKED[2]
    answer = InferenceClient(base_url=server.url).text_generation(prompt, adapter_id="sql", max_new_tokens=MAX_NEW,
                                                                  details=True)
    assert [t.id for t in answer.details.tokens] == served(server, prompt, "sql") != served(server, prompt, "")


def test_metrics_count_generations_by_adapter(server):
    def counts() -> dict[str, float]:
        samples = metrics(server.url, labels=True)
        return {adapter: samples.get(f'llmbus_generation_adapter_count{{adapter="{adapter}"}}', 0.0)
                for adapter in ("", "sql", "poet")}

    before = counts()
    for adapter in ("sql", "sql", "poet", ""):
        served(server, ASKED[0], adapter)
    want = {"": before[""] + 1, "sql": before["sql"] + 2, "poet": before["poet"] + 1}
    deadline = time.monotonic() + 10
    while counts() != want:  # each generation is counted as it is closed, beside its answer
        assert time.monotonic() < deadline, (counts(), want)
        time.sleep(0.05)


def test_an_adapter_that_is_not_loaded_is_refused_naming_the_loaded_ones(server):
    status, _, answer = post(server.url + "/generate", {"inputs": "hi", "parameters": {"adapter_id": "chef"}})
    assert status == 422 and answer["error_type"] == "validation", answer
    assert answer["error"] == "Input validation error: adapter `chef` is not loaded; loaded adapters: `sql`, `poet`"


def up(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmbus.supervisor", "up", *args], capture_output=True, text=True,
                          timeout=120)


def test_an_adapter_that_cannot_be_served_stops_the_launch_with_why(tiny_model_dir, tmp_path):
    missing = up("--model-id", str(tiny_model_dir), "--lora-adapters", f"sql={tmp_path / 'missing'}")
    assert missing.returncode != 0 and "Traceback" not in missing.stderr, missing.stderr
    assert f"--lora-adapters: LoRA adapter `sql`: no folder {tmp_path / 'missing'}" in missing.stderr, missing.stderr
    # the head is not a projection the decoder adapts: the rank refuses the adapter as it loads, in one line
    head = save_lora_adapter(str(tiny_model_dir), str(tmp_path / "head"), ["q_proj", "lm_head"])
    refused = up("--model-id", str(tiny_model_dir), "--dtype", "float32", "--lora-adapters", f"head={head}")
    assert refused.returncode != 0 and "Traceback" not in refused.stderr, refused.stderr
    assert f"LoraError: LoRA adapter 'head' ({head}): target_modules ['lm_head'] cannot be adapted" \
        in refused.stderr, refused.stderr
