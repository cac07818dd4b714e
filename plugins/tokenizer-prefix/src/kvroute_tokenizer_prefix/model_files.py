"""A model's tokenizer files on this machine: a ``tokenizer.json``, a model directory, or the local Hugging Face
cache (never the network); and the special tokens its configuration names."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvroute.errors import ConfigError

__all__ = ["read_json", "resolve_model_files", "special_tokens"]

_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def resolve_model_files(source: str | os.PathLike[str], *, revision: str | None = None) -> dict[str, Path]:
    """Find a model's tokenizer files: a ``tokenizer.json`` path, a directory, or a Hub id in the local cache.

    Never touches the network: a Hub id (``org/name``) is looked up in the local Hugging Face
    cache only. Returns the files found by name; ``tokenizer.json`` is required.
    """
    path = Path(source).expanduser()
    found: dict[str, Path] = {}
    if path.is_file():
        found["tokenizer.json"] = path
        folder = path.parent
        for name in _FILES[1:]:
            if (folder / name).is_file():
                found[name] = folder / name
    elif path.is_dir():
        for name in _FILES:
            if (path / name).is_file():
                found[name] = path / name
        if "tokenizer.json" not in found:
            raise ConfigError(
                f"'tokenizer': the directory {str(path)!r} has no tokenizer.json (a fast tokenizer is required; "
                "save one with transformers' save_pretrained or the tokenizers library)."
            )
    else:
        text = str(source)
        if text.count("/") != 1 or text.startswith(("/", ".", "~")):
            raise ConfigError(
                f"'tokenizer' must be a tokenizer.json file, a model directory or a Hub model id in the local cache "
                f"(got {text!r}, which does not exist)."
            )
        from huggingface_hub import try_to_load_from_cache

        for name in _FILES:
            hit = try_to_load_from_cache(text, name, revision=revision)
            if isinstance(hit, str):
                found[name] = Path(hit)
        if "tokenizer.json" not in found:
            raise ConfigError(
                f"'tokenizer': model {text!r} has no tokenizer.json in the local Hugging Face cache "
                "(kvroute never downloads: fetch it once with `huggingface-cli download` or point to a directory)."
            )
    return found


def _token_text(value: object) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def special_tokens(config: Mapping[str, Any], special_map: Mapping[str, Any]) -> dict[str, str]:
    """The special tokens' texts (``bos_token``...) from ``tokenizer_config.json``, else ``special_tokens_map.json``."""
    out: dict[str, str] = {}
    for key in ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"):
        text = _token_text(config.get(key))
        if text is None:
            text = _token_text(special_map.get(key))
        if text is not None:
            out[key] = text
    return out


def read_json(path: Path | None) -> dict[str, Any]:
    """The JSON object in ``path`` (``{}`` without a path); `ConfigError` when it cannot be read or is no object."""
    if path is None:
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {str(path)!r}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{str(path)!r} must hold a JSON object (got {type(data).__name__}).")
    return data
