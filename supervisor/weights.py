"""Where the weights come from: the built-in demo model, a local folder, or the Hugging Face hub."""

from __future__ import annotations

import json
from pathlib import Path


class ModelNotFound(RuntimeError):
    pass


def resolve_model(model_id: str | None, *, revision: str | None = None, cache_dir: str | None = None) -> Path:
    """A local Hugging Face model folder for ``model_id`` (None = the demo model, built on first use)."""
    if model_id is None:
        from llmbus.supervisor.demo_model import demo_model_dir

        return demo_model_dir("small")
    path = Path(model_id).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelNotFound(f"{path} is not a Hugging Face model folder (no config.json)")
        return path.resolve()
    if model_id.startswith((".", "/", "~")) or model_id.count("/") > 1:
        raise ModelNotFound(f"model folder {model_id} does not exist")
    return download(model_id, revision=revision, cache_dir=cache_dir)


def download(model_id: str, *, revision: str | None = None, cache_dir: str | None = None) -> Path:
    """Fetch config, tokenizer and safetensors weights with huggingface_hub (HF_HUB_OFFLINE honoured)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]
    try:
        return Path(snapshot_download(model_id, revision=revision, cache_dir=cache_dir, allow_patterns=patterns))
    except LocalEntryNotFoundError as e:
        raise ModelNotFound(f"{model_id}: not in the local cache and the hub is unreachable or offline "
                            f"({type(e).__name__})") from None
    except HfHubHTTPError as e:
        raise ModelNotFound(f"{model_id}: the hub refused the download: {e}") from None
    except (OSError, ValueError) as e:
        raise ModelNotFound(f"{model_id}: download failed: {e}") from None


def read_config(model_dir: Path) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())
