"""Helpers of the post-training CLI tests (``megaloop rl`` / ``distill-prefill`` input checks)."""

from __future__ import annotations

import json
from pathlib import Path


def fake_hf(path: Path, weights: bool = True) -> Path:
    """An HF-looking folder (config.json of model_type megaloop, and a weights file unless
    ``weights=False``) that passes the model-path check and is never loaded."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "megaloop"}))
    if weights:
        (path / "model.safetensors").write_bytes(b"weights")
    return path


def one_error_line(capsys) -> str:
    """The single non-blank stderr line captured so far (asserts there is exactly one)."""
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1, err
    return err[0]


def replace_weights(model_dir: Path, seed: int = 7) -> None:
    """Overwrite the HF model in ``model_dir`` in place with other weights of the same shape."""
    import torch

    from megaloop.hf.modeling_megaloop import MegaloopForCausalLM

    other = MegaloopForCausalLM.from_pretrained(str(model_dir))
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p))
    other.save_pretrained(str(model_dir))
