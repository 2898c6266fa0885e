"""Multi-LoRA serving in the worker (``workers/lora.py``): a step's rows of each adapter get that adapter's
delta, base rows none, and every request's greedy tokens and logprobs are PEFT's (``PeftModel.generate`` in
float32 over transformers), on one rank and over two (Phi-3's fused qkv_proj/gate_up_proj with its one K/V
head replicated on both ranks); adapters PEFT saved with random, decisive ``lora_B`` (``testing/lora.py``).
What cannot be served is refused at load with a ``LoraError`` that names the adapter and the problem."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from llmbus.bus.messages import SamplingParams
from llmbus.testing.families import family_requests, family_runner, make_prompts, requantized_copy, save_tiny_family
from llmbus.testing.lora import lora_reference, on_adapters, save_lora_adapter
from llmbus.testing.runner_driver import BLOCK_SIZE, drive, drive_tensor_parallel
from llmbus.workers.loader import read_config
from llmbus.workers.lora import LoraError, StepAdapters
from llmbus.workers.model_runner import ModelRunner, SeqInput

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
# family_requests' rids: r1 is preempted and resumes from its first block, "hit" starts on r4's blocks (so
# runs with r4's adapter: a prefix computed under one adapter is another's only for the same adapter).
MIXED = {"r0": "", "r1": "all", "r2": "attn", "r3": "all", "r4": "attn", "hit": "attn"}


class Adapted:
    """A tiny checkpoint, its adapters and PEFT's reference for each (name "" the base model)."""

    def __init__(self, path: str, adapters: dict[str, str]):
        self.path, self.adapters = path, adapters
        self.prompts = make_prompts(read_config(path)["vocab_size"])
        self.refs = {name: lora_reference(path, adapters.get(name), self.prompts) for name in ("", *adapters)}

    @property
    def lora_adapters(self) -> tuple[tuple[str, str], ...]:
        return tuple(self.adapters.items())

    def runner(self, **kwargs) -> ModelRunner:
        return family_runner(self.path, lora_adapters=self.lora_adapters, **kwargs)

    def check(self, results: dict, adapter_of: dict[str, str], logprob_atol: float = 1e-4) -> None:
        """Each request got its adapter's reference tokens and logprobs."""
        for rid, adapter in adapter_of.items():
            i = len(self.prompts) - 1 if rid == "hit" else int(rid[1:])
            ref = self.refs[adapter]
            tokens, logprobs = results[rid]
            assert tokens == ref.tokens[i], f"{rid} with adapter {adapter!r}"
            torch.testing.assert_close(torch.tensor(logprobs), ref.greedy_logprobs(i), rtol=0, atol=logprob_atol)


def _run(runner, prompts, adapter_of: dict[str, str]) -> dict:
    results = drive(runner, on_adapters(family_requests(prompts), adapter_of))
    assert results["r1"].preemptions == 1
    return {rid: (r.tokens, r.logprobs) for rid, r in results.items()}


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Adapted:
    root = tmp_path_factory.mktemp("lora_llama")
    path = str(root / "model")
    save_tiny_family(path, "LlamaConfig")
    return Adapted(path, {
        "all": save_lora_adapter(path, str(root / "all"), ALL_MODULES, r=4, alpha=8, seed=3, use_rslora=True),
        # per-module ranks and alphas: v_proj rank 2, o_proj alpha 4
        "attn": save_lora_adapter(path, str(root / "attn"), ATTENTION, r=8, alpha=16, seed=2,
                                  rank_pattern={"v_proj": 2}, alpha_pattern={"o_proj": 4}),
    })


@pytest.fixture(scope="module")
def llama_runner(llama) -> ModelRunner:
    runner = llama.runner()
    assert runner.lora_names == ["all", "attn"]
    return runner


def test_adapters_change_greedy_output_decisively(llama):
    for adapter in llama.adapters:
        differ = sum(a != b for a, b in zip(llama.refs[adapter].tokens, llama.refs[""].tokens))
        assert differ == len(llama.prompts), adapter


def test_batch_mixing_base_rows_and_two_adapters_matches_peft(llama, llama_runner):
    """Where the fused CPU layer runs, it takes the steps with adapter rows too, adding their deltas itself."""
    fused, ran = llama_runner.model.fused_decode, []
    if fused is not None:
        fused.run = lambda *args, run=fused.run: ran.append((args[-1] is not None, run(*args))) or ran[-1][1]
    try:
        llama.check(_run(llama_runner, llama.prompts, MIXED), MIXED)
    finally:
        if fused is not None:
            del fused.run
    assert fused is None or sum(took for with_adapters, took in ran if with_adapters) >= 5


def test_one_adapter_over_every_row_matches_peft(llama, llama_runner, monkeypatch):
    groups = []
    monkeypatch.setattr(StepAdapters, "of",
                        lambda *a, of=StepAdapters.of, **k: groups.append(of(*a, **k)) or groups[-1])
    every = {rid: "all" for rid in MIXED}
    llama.check(_run(llama_runner, llama.prompts, every), every)
    assert all(rows is None for step in groups for _, rows in step.groups)  # no index ops


def test_base_only_steps_take_the_base_paths(llama, llama_runner):
    """With adapters loaded, a step of base rows alone runs as before: the fused decode layer where it applies,
    no delta computed."""
    base = dict.fromkeys(MIXED, "")
    fused, ran = llama_runner.model.fused_decode, []
    if fused is not None:
        fused.run = lambda *args, run=fused.run: ran.append(run(*args)) or ran[-1]
    try:
        llama.check(_run(llama_runner, llama.prompts, base), base)
    finally:
        if fused is not None:
            del fused.run
    assert fused is None or sum(ran) >= 5


def test_large_adapter_batches_through_gemm_match_peft(llama, llama_runner, monkeypatch):
    """Past MAX_ROWS decode rows in float32, where gemm.c runs (AVX2 without AVX-512; test_avx2_build.py runs
    this on that build), the fused layer computes its projections as GEMMs and adds each row's delta after
    them: three copies of every prompt, on both adapters and the base model, equal PEFT's tokens."""
    from llmbus.testing.runner_driver import Request
    from llmbus.workers.kernels.bindings import MAX_ROWS

    fused = llama_runner.model.fused_decode
    if fused is None or not fused._large_batches:
        pytest.skip("no C compiler, or gemm.c does not run on this CPU: large batches take the torch layers")
    fused_rows = []

    def run(hidden, *args, run=fused.run):
        took = run(hidden, *args)
        fused_rows.extend([hidden.shape[0]] if took and args[-1] is not None else [])
        return took

    monkeypatch.setattr(fused, "run", run)
    adapters = ["all", "attn", ""]
    requests = [Request(rid=f"{adapter or 'base'}-{i}", prompt=prompt, adapter=adapter)
                for adapter in adapters for i, prompt in enumerate(llama.prompts)]
    results = drive(llama_runner, requests)
    for adapter in adapters:
        for i in range(len(llama.prompts)):
            assert results[f"{adapter or 'base'}-{i}"].tokens == llama.refs[adapter].tokens[i], (adapter, i)
    assert len(requests) > MAX_ROWS and max(fused_rows) > MAX_ROWS  # adapter steps of GEMM size took it


def test_quantized_base_weights_keep_the_delta_exact(llama, tmp_path):
    """``--quantize int8``: the delta is added in float beside the int8 projections; PEFT over the requantized
    weights is the reference."""
    requantized = requantized_copy(llama.path, str(tmp_path / "int8"), "int8")
    runner = llama.runner(quantize="int8")
    assert "int8" in runner.model.weight_summary
    adapter_of = {"r0": "all", "r3": "attn"}
    requests = [r for r in family_requests(llama.prompts) if r.rid in adapter_of]
    results = drive(runner, on_adapters(requests, adapter_of))
    for rid, adapter in adapter_of.items():
        i = int(rid[1:])
        ref = lora_reference(requantized, llama.adapters[adapter], [llama.prompts[i]])
        assert results[rid].tokens == ref.tokens[0], rid
        torch.testing.assert_close(torch.tensor(results[rid].logprobs), ref.greedy_logprobs(0), rtol=0, atol=1e-3)


# Qwen2 (q/k/v biases), Gemma 3 (its own layers around Llama's attention and MLP), Qwen3-MoE (attention
# adapters beside routed experts, which the fused CPU layer computes for base steps).
FAMILIES = {
    "qwen2": ("Qwen2Config", {}, ALL_MODULES),
    "gemma3": ("Gemma3TextConfig", dict(num_hidden_layers=2, head_dim=16, sliding_window=8,
                                        layer_types=["sliding_attention", "full_attention"]), ALL_MODULES),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                         norm_topk_prob=False, mlp_only_layers=[1]), ATTENTION),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_other_families_match_peft(family, tmp_path):
    config_class, arguments, targets = FAMILIES[family]
    path = str(tmp_path / "model")
    save_tiny_family(path, config_class, **arguments)
    adapted = Adapted(path, {"all": save_lora_adapter(path, str(tmp_path / "a"), targets, seed=3)})
    adapter_of = {"r0": "", "r2": "all", "r3": "all", "r4": ""}
    requests = [r for r in family_requests(adapted.prompts) if r.rid in adapter_of]
    results = drive(adapted.runner(), on_adapters(requests, adapter_of))
    adapted.check({rid: (r.tokens, r.logprobs) for rid, r in results.items()}, adapter_of)


@pytest.fixture(scope="module")
def phi3(tmp_path_factory) -> Adapted:
    """Phi-3's checkpoint fuses qkv_proj and gate_up_proj, and so do its adapters; one K/V head."""
    root = tmp_path_factory.mktemp("lora_phi3")
    path = str(root / "model")
    save_tiny_family(path, "Phi3Config", num_key_value_heads=1)
    return Adapted(path, {
        "all": save_lora_adapter(path, str(root / "all"), ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
                                 seed=4),
        "attn": save_lora_adapter(path, str(root / "attn"), ["qkv_proj", "o_proj"], r=6, alpha=3, seed=5)})


def test_phi3_fused_modules_match_peft(phi3):
    phi3.check(_run(phi3.runner(), phi3.prompts, MIXED), MIXED)


def test_tensor_parallel_2_matches_peft(phi3, tmp_path):
    """Over two ranks: qkv_proj's B cut into each rank's query rows and the replicated K/V head's rows, gate_up's
    into both halves' shares; o_proj's and down's A cut by columns, their partial deltas summed by the
    all-reduce."""
    results = drive_tensor_parallel(phi3.path, {"lora": on_adapters(family_requests(phi3.prompts), MIXED)},
                                    str(tmp_path), lora_adapters=phi3.lora_adapters)
    phi3.check(results["lora"], MIXED)


# -- refusals ----------------------------------------------------------------------------------------


def _edit_config(**changes):
    def edit(folder):
        path = os.path.join(folder, "adapter_config.json")
        with open(path) as f:
            config = json.load(f)
        with open(path, "w") as f:
            json.dump(config | changes, f)
    return edit


def _edit_tensors(edit_state):
    def edit(folder):
        from safetensors.torch import load_file, save_file

        path = os.path.join(folder, "adapter_model.safetensors")
        state = load_file(path)
        edit_state(state)
        save_file(state, path)
    return edit


def _rename(old: str, new: str):
    def edit(state):
        for key in [k for k in state if old in k]:
            state[key.replace(old, new)] = state.pop(key)
    return edit


def _only_bin(folder):
    os.rename(os.path.join(folder, "adapter_model.safetensors"), os.path.join(folder, "adapter_model.bin"))


def _narrow_b(state):
    key = next(k for k in state if "k_proj.lora_B" in k)
    state[key] = state[key][:-1]


def _add_head(state):
    state["base_model.model.lm_head.lora_A.weight"] = torch.zeros(4, 64)
    state["base_model.model.lm_head.lora_B.weight"] = torch.zeros(509, 4)


REFUSALS = {
    "no safetensors": (_only_bin, "convert it to adapter_model.safetensors"),
    "no config": (lambda folder: os.remove(os.path.join(folder, "adapter_config.json")), "adapter_config.json"),
    "not lora": (_edit_config(peft_type="LOHA"), "only LORA adapters"),
    "dora": (_edit_config(use_dora=True), "DoRA"),
    "modules_to_save": (_edit_config(modules_to_save=["lm_head"]), "modules_to_save"),
    "bias": (_edit_config(bias="lora_only"), "bias 'lora_only'"),
    "fan_in_fan_out": (_edit_config(fan_in_fan_out=True), "fan_in_fan_out"),
    "embed_tokens target": (_edit_config(target_modules=["q_proj", "embed_tokens"]), "['embed_tokens'] cannot"),
    "lm_head weights": (_edit_tensors(_add_head), "adapts lm_head"),
    "expert weights": (_edit_tensors(_rename("mlp.gate_proj", "mlp.experts.0.gate_proj")), "routed expert"),
    "unknown module": (_edit_tensors(_rename("mlp.gate_proj", "mlp.fc_in")), "LoRA cannot be applied"),
    "shape": (_edit_tensors(_narrow_b), "an adapter for another model"),
    "layer": (_edit_tensors(_rename("layers.1.", "layers.7.")), "the model has 2 layers"),
    "broken config": (lambda folder: open(os.path.join(folder, "adapter_config.json"), "w").write("{"),
                      "adapter_config.json cannot be read"),
    "broken weights": (lambda folder: open(os.path.join(folder, "adapter_model.safetensors"), "wb").write(b"x" * 9),
                       "adapter_model.safetensors cannot be read"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_unservable_adapters_are_refused_at_load(llama, case, tmp_path):
    edit, message = REFUSALS[case]
    folder = str(tmp_path / "adapter")
    shutil.copytree(llama.adapters["all"], folder)
    edit(folder)
    with pytest.raises(LoraError, match="'broken'") as refused:
        ModelRunner(llama.path, num_blocks=4, block_size=BLOCK_SIZE, lora_adapters=(("broken", folder),))
    assert message in str(refused.value)


def test_adapters_where_the_model_cannot_take_them_are_refused(llama, phi3, tmp_path):
    import transformers

    gpt2 = str(tmp_path / "gpt2")
    transformers.AutoModelForCausalLM.from_config(transformers.GPT2Config(
        n_embd=64, n_layer=2, n_head=4, n_positions=64, vocab_size=509)).save_pretrained(gpt2)
    with pytest.raises(LoraError, match="transformers fallback"):
        ModelRunner(gpt2, num_blocks=4, block_size=BLOCK_SIZE, lora_adapters=(("a", llama.adapters["all"]),))
    with pytest.raises(LoraError, match="has qkv_proj instead"):  # separate q/k/v names on a fused checkpoint
        ModelRunner(phi3.path, num_blocks=4, block_size=BLOCK_SIZE, lora_adapters=(("a", llama.adapters["attn"]),))
    moe = str(tmp_path / "moe")
    save_tiny_family(moe, "Qwen3MoeConfig", **FAMILIES["qwen3_moe"][1])
    with pytest.raises(LoraError, match="which LoRA cannot reach"):  # dense MLP modules on a layer of experts
        ModelRunner(moe, num_blocks=4, block_size=BLOCK_SIZE, lora_adapters=(("a", llama.adapters["all"]),))
    # PEFT adapts the experts' parameters (target_parameters) when asked for their projections
    experts = save_lora_adapter(moe, str(tmp_path / "experts"), ["gate_proj", "up_proj", "down_proj"])
    with pytest.raises(LoraError, match="not supported"):
        ModelRunner(moe, num_blocks=4, block_size=BLOCK_SIZE, lora_adapters=(("a", experts),))
    with pytest.raises(LoraError, match="unique"):
        ModelRunner(llama.path, num_blocks=4, block_size=BLOCK_SIZE,
                    lora_adapters=(("a", llama.adapters["all"]), ("a", llama.adapters["attn"])))


def test_a_step_naming_an_adapter_not_loaded_raises(llama_runner):
    seq = SeqInput(rid="x", token_ids=[1, 2], num_computed=0, block_table=[0], sample=True,
                   sampling=SamplingParams(), adapter="missing")
    with pytest.raises(ValueError, match="'missing' is not loaded"):
        llama_runner.step([seq])
