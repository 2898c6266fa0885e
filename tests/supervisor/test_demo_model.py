"""The built-in demo model (supervisor/demo_model.py): tiny size only, built into tmp dirs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from llmbus.supervisor import demo_model as dm

FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
         "tokenizer_config.json", "special_tokens_map.json"]

TEXTS = [
    "Hello, world! How are you today?",
    "Ça va? naïve façade, Straße, smørrebrød, mañana.",
    "日本語のテキストと中文字符。",
    "emoji 😀🚀👍🏽 and ❤️ mixed in",
    "  leading spaces\n\ttabs and\nnewlines  ",
    "def f(x):\n    return x ** 2  # 3.14159",
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    out = dm.build_demo_model(tmp_path_factory.mktemp("demo") / "tiny", "tiny")
    assert isinstance(out, Path)
    return out


@pytest.fixture(scope="module")
def hf(tiny):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, info = AutoModelForCausalLM.from_pretrained(tiny, output_loading_info=True)
    tok = AutoTokenizer.from_pretrained(tiny)
    return model.eval(), tok, info


def _llama_params(c: dict) -> int:
    h, i, n, v = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    hd = c["head_dim"]
    attn = h * c["num_attention_heads"] * hd * 2 + h * c["num_key_value_heads"] * hd * 2
    layer = attn + 3 * h * i + 2 * h
    emb = v * h * (1 if c["tie_word_embeddings"] else 2)
    return n * layer + emb + h


def test_sizes():
    assert set(dm.SIZES) == {"tiny", "small"}
    small, tiny = dm.SIZES["small"], dm.SIZES["tiny"]
    assert 120e6 < _llama_params(small) < 130e6
    assert _llama_params(tiny) < 5e6
    for c in (small, tiny):
        assert c["hidden_size"] == c["num_attention_heads"] * c["head_dim"]
        assert c["num_attention_heads"] % c["num_key_value_heads"] == 0
    assert small["dtype"] == "bfloat16" and tiny["dtype"] == "float32"
    with pytest.raises(ValueError):
        dm.build_demo_model("/nonexistent/never-created", "huge")


def test_files_and_configs(tiny):
    assert sorted(p.name for p in tiny.iterdir()) == sorted(FILES)
    cfg = json.loads((tiny / "config.json").read_text())
    gen = json.loads((tiny / "generation_config.json").read_text())
    tcfg = json.loads((tiny / "tokenizer_config.json").read_text())
    for k, v in dm.SIZES["tiny"].items():
        assert cfg[k] == v, k
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["torch_dtype"] == cfg["dtype"] == "float32"
    assert cfg["initializer_range"] == dm.DEFAULT_INIT_STD["tiny"]
    ids = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}
    assert {k: cfg[k] for k in ids} == ids and gen == ids
    assert tcfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (tcfg["bos_token"], tcfg["eos_token"], tcfg["pad_token"]) == ("<s>", "</s>", "<pad>")
    assert tcfg["model_max_length"] == cfg["max_position_embeddings"]
    assert "transformers_version" not in cfg  # the files do not depend on the installed version


def test_transformers_loads_it(tiny, hf):
    model, tok, info = hf
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"))
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.dtype == torch.float32
    v = dm.SIZES["tiny"]["vocab_size"]
    assert model.config.vocab_size == v == len(tok) == model.get_input_embeddings().weight.shape[0]
    assert model.lm_head.weight.shape[0] == v
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
    assert tok.convert_ids_to_tokens(list(range(5))) == dm.SPECIAL_TOKENS
    assert model.generation_config.eos_token_id == 1


def test_tokenizer_parity_and_round_trip(tiny, hf):
    from tokenizers import Tokenizer

    _, tok, _ = hf
    raw = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    assert raw.get_vocab_size(with_added_tokens=True) == dm.SIZES["tiny"]["vocab_size"]
    for text in TEXTS:
        ids = tok(text).input_ids
        assert ids == raw.encode(text).ids
        assert ids[0] == tok.bos_token_id and tok.bos_token_id not in ids[1:]
        assert tok(text, add_special_tokens=False).input_ids == ids[1:]
        assert tok.decode(ids, skip_special_tokens=True) == text
        assert raw.decode(ids) == text
    # Trained merges: common words are one token, multi-byte text is not byte-by-byte.
    assert len(tok(" the", add_special_tokens=False).input_ids) == 1
    assert len(tok("café", add_special_tokens=False).input_ids) < len("café".encode())
    # Special tokens in text are recognised as single tokens.
    assert tok("<|im_start|>user<|im_end|>", add_special_tokens=False).input_ids[0] == 3


def test_chat_template(hf):
    _, tok, _ = hf
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there ☕"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == ("<s><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there ☕<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert tok.apply_chat_template(msgs, tokenize=False) == text[: -len("<|im_start|>assistant\n")]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    assert ids == tok(text, add_special_tokens=False).input_ids
    assert ids.count(0) == 1 and ids.count(3) == 3 and ids.count(4) == 2
    content = [{"type": "text", "text": "a"}, {"type": "image"}, {"type": "text", "text": "b"}]
    parts = [{"role": "user", "content": content}]
    assert tok.apply_chat_template(parts, tokenize=False) == "<s><|im_start|>user\nab<|im_end|>\n"


def test_greedy_margins_and_variety(hf):
    model, tok, _ = hf
    prompts = ["Hello, how are you?", "The quick brown fox", "def main():", "Café 日本語 😀",
               "1 2 3 4", "Once upon a time", "What is the capital of France?", "zz"]
    margins, conts = [], []
    with torch.no_grad():
        for p in prompts:
            ids = tok(p, return_tensors="pt").input_ids
            out = model.generate(ids, max_new_tokens=16, do_sample=False, output_scores=True,
                                 return_dict_in_generate=True, pad_token_id=tok.pad_token_id)
            for s in out.scores:
                top2 = torch.topk(s[0].float(), 2).values
                margins.append((top2[0] - top2[1]).item())
            conts.append(tuple(out.sequences[0, ids.shape[1]:].tolist()))
    assert sum(m > 1e-2 for m in margins) >= 0.9 * len(margins), sorted(margins)[:10]
    assert sorted(margins)[len(margins) // 2] > 0.2  # median: wide, not near-tied
    assert len(set(conts)) >= 6
    assert len({c[0] for c in conts}) >= 4
    assert all(len(set(c)) > 1 for c in conts)  # no prompt decodes to one token repeated


def test_seed_changes_weights_only():
    cfg = dm._model_config("tiny", 0.5)
    a = dm._random_state_dict(cfg, 0, 0.5)
    b = dm._random_state_dict(cfg, 1, 0.5)
    c = dm._random_state_dict(cfg, 0, 0.5)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], c[k]) for k in a)
    assert not torch.equal(a["lm_head.weight"], b["lm_head.weight"])
    assert abs(a["model.embed_tokens.weight"].std().item() - 0.5) < 0.01


def test_demo_model_dir_caches_and_is_deterministic(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("LLMBUS_CACHE", raising=False)
    assert dm._cache_root() == tmp_path / "xdg" / "llmbus"
    monkeypatch.setenv("LLMBUS_CACHE", str(tmp_path / "cache"))
    d = dm.demo_model_dir("tiny")
    assert d == tmp_path / "cache" / "demo-tiny-v1"
    # A second, independent build is byte-identical (tokenizer training included).
    for f in FILES:
        assert (d / f).read_bytes() == (tiny / f).read_bytes(), f
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["demo-tiny-v1"]  # no temp dirs left

    # Cached: no rebuild.
    monkeypatch.setattr(dm, "build_demo_model", lambda *a, **k: pytest.fail("rebuilt"))
    assert dm.demo_model_dir("tiny") == d


def test_demo_model_dir_lost_race(tiny, tmp_path, monkeypatch):
    """Another process renames its build into place while we build: ours is dropped, theirs is used."""
    monkeypatch.setenv("LLMBUS_CACHE", str(tmp_path))
    final = tmp_path / "demo-tiny-v1"

    def build(out, size, **kw):
        for f in FILES:
            shutil.copy(tiny / f, Path(out) / f)
        shutil.copytree(tiny, final)  # the other process wins
        return Path(out)

    monkeypatch.setattr(dm, "build_demo_model", build)
    assert dm.demo_model_dir("tiny") == final
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo-tiny-v1"]

    # A partial folder that is not ours gets replaced.
    shutil.rmtree(final)
    final.mkdir()
    (final / "config.json").write_text("{}")
    def good_build(out, size, **kw):
        for f in FILES:
            shutil.copy(tiny / f, Path(out) / f)
        return Path(out)

    monkeypatch.setattr(dm, "build_demo_model", good_build)
    assert dm.demo_model_dir("tiny") == final
    assert (final / "config.json").read_bytes() == (tiny / "config.json").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo-tiny-v1"]
