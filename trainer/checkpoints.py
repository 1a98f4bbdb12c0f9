"""The trainer's checkpoints: output_dir/v{version:06d}/, one new directory per policy version.

A checkpoint is the model as ``save_pretrained`` writes it (safetensors, untied: :func:`untie`),
the model directory's other files (the tokenizer's), :data:`STATE_FILE` (everything resume needs:
:data:`RESUME_STATE`) and :data:`CONFIG_FILE` (the trainer's config). It is written to a temp
directory and renamed, so a directory with its final name is complete. The optimizer state is
saved as ``optimizer.state_dict()`` numbers it, whatever the launch; under FSDP it is gathered
keyed by parameter name and renumbered (:func:`numbered_optimizer_state`, and back:
:func:`named_optimizer_state`).
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from pathlib import Path

import torch

from lightspan.core.config import to_dict

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.pt"
CONFIG_FILE = "trainer_config.json"       # config.json is the model's: vLLM reads it
RESUME_STATE = ("version", "cursor", "run_id", "optimizer", "rng")
_CHECKPOINT = re.compile(r"v(\d{6,})")
# model files save_pretrained writes itself; everything else in the model dir is copied along
_MODEL_FILES = re.compile(r"(config\.json|generation_config\.json|adapter_config\.json|.*\.safetensors|.*\.bin|.*\.index\.json|"
                          r".*\.gguf|.*\.pt|.*\.pth)")


def checkpoints(output_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints in ``output_dir``, oldest first."""
    if not output_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in output_dir.iterdir()
             if (m := _CHECKPOINT.fullmatch(p.name)) and (p / STATE_FILE).is_file()]
    return sorted(found)


def read_state(checkpoint: Path, *, mmap: bool = False) -> dict:
    """A checkpoint's resume state (:data:`RESUME_STATE`); ``mmap`` leaves the tensors on disk."""
    state = torch.load(checkpoint / STATE_FILE, weights_only=True, mmap=mmap)
    missing = [k for k in RESUME_STATE if k not in state]
    if missing:
        raise ValueError(f"{checkpoint / STATE_FILE} lacks {missing}: not a lightspan checkpoint")
    return state


def resume_state(version: int, cursor: tuple[int, str], run_id: str, optimizer: dict) -> dict:
    """The resume state of ``version``, with this process's RNG states now."""
    rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return {"version": version, "cursor": cursor, "run_id": run_id, "optimizer": optimizer, "rng": rng}


def set_rng(rng: dict) -> None:
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def save(output_dir: Path, version: int, model, *, model_source: Path, state: dict, config,
         model_state: dict | None = None, adapter: str | None = None) -> Path:
    """Write output_dir/v{version:06d}/: a new directory, complete once it has its name.
    ``model_state``: the state dict to save instead of ``model``'s own (under FSDP, the gathered one);
    ``adapter``: the one named LoRA adapter of a model that holds several (trainer/lora.py, 4.)."""
    final = output_dir / f"v{version:06d}"
    if final.exists():
        raise FileExistsError(f"{final} exists: every version gets a new directory")
    tmp = output_dir / f".{final.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    untie(model)
    if adapter is None:
        model.save_pretrained(tmp, safe_serialization=True, state_dict=model_state)
    else:       # peft writes a named adapter into a subdirectory of its name: move it up
        model.save_pretrained(tmp, safe_serialization=True, state_dict=model_state, selected_adapters=[adapter])
        for f in (tmp / adapter).iterdir():
            os.replace(f, tmp / f.name)
        (tmp / adapter).rmdir()
    for f in model_source.iterdir():
        if f.is_file() and not _MODEL_FILES.fullmatch(f.name) and f.name != CONFIG_FILE:
            shutil.copy2(f, tmp / f.name)
    torch.save(state, tmp / STATE_FILE)
    (tmp / CONFIG_FILE).write_text(json.dumps(to_dict(config), indent=2) + "\n")
    os.replace(tmp, final)
    return final


def load_model(path: Path):
    """The model saved in ``path``, in float32 and untied (:func:`untie`)."""
    from transformers import AutoModelForCausalLM

    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no model at {path} (config.json missing): pass --model DIR")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    untie(model)
    return model


def prune(output_dir: Path, keep: int, protect: set[Path] = frozenset()) -> None:
    """Delete all but the newest ``keep`` checkpoints, and those in ``protect`` (resolved paths)."""
    for _, old in checkpoints(output_dir)[:-keep]:
        if old.resolve() in protect:
            continue
        shutil.rmtree(old, ignore_errors=True)
        log.debug("deleted checkpoint %s", old)


def untie(model) -> None:
    """vLLM's in-place reload leaves a tied lm_head stale (docs/architecture.md, "Weight sync"):
    give it its own copy."""
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None:
        return
    if head.weight is embed.weight:
        log.warning("untying the model's embeddings: lm_head gets its own copy of embed_tokens")
        head.weight = torch.nn.Parameter(embed.weight.detach().clone())
    model.config.tie_word_embeddings = False      # or save_pretrained would drop lm_head.weight


def numbered_optimizer_state(state: dict, names: list[str]) -> dict:
    """An optimizer state keyed by parameter name (torch.distributed.checkpoint's full state dict)
    -> the same numbered as ``optimizer.state_dict()`` numbers it: the i-th parameter of ``names``."""
    index = {name: i for i, name in enumerate(names)}
    return {"state": {index[name]: value for name, value in state["state"].items()},
            "param_groups": [{**group, "params": [index[name] for name in group["params"]]}
                             for group in state["param_groups"]]}


def named_optimizer_state(state: dict, names: list[str]) -> dict:
    """The inverse of :func:`numbered_optimizer_state`."""
    if len({p for group in state["param_groups"] for p in group["params"]}) != len(names):
        raise ValueError(f"the checkpoint's optimizer holds {sum(len(g['params']) for g in state['param_groups'])} "
                         f"parameters, the model trains {len(names)}: not this model's checkpoint")
    return {"state": {names[i]: value for i, value in state["state"].items()},
            "param_groups": [{**group, "params": [names[i] for i in group["params"]]}
                             for group in state["param_groups"]]}
