"""LoRA training with peft: adapters on the base model, the base frozen.

LoRA: Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models" (arXiv:2106.09685).
Each targeted linear layer W gets W + (alpha / r) B A with A (r x in) random and B (out x r)
zero, so version 0 is exactly the base model; only A and B are trained.

What this means for the rest of the trainer:
1. A checkpoint holds the adapter only (peft's ``adapter_config.json`` +
   ``adapter_model.safetensors``, the export format vLLM and ``PeftModel.from_pretrained``
   read), besides the tokenizer and the resume state; the base is always ``config.model``.
2. The KL reference is the base model itself, run with the adapters disabled
   (``disable_adapter()``): no second copy of the weights.
3. The optimizer holds the trainable (adapter) parameters only, in ``named_parameters`` order,
   so a resumed optimizer state lines up with the same parameters.
4. Several policies (trainer/policies.py) are several named adapters on one peft model over the
   one base: ``set_adapter(name)`` makes one the active and only trainable one (peft sets
   ``requires_grad`` for it alone), so each policy's forward, optimizer and checkpoint see only
   its own adapter, and the base is held once.
5. With sync 'reload' vLLM serves the adapter merged: each published version also writes
   ``merged/`` in its checkpoint, the base with W + (alpha / r) B A in every adapted layer, as a
   full safetensors model that vLLM reloads in place (:func:`save_merged`). vLLM then decodes
   without an active adapter, which on CPU costs a quarter of the CPU (bench/README.md, "Serving a
   LoRA adapter merged"); the checkpoint itself still holds the adapter only (1.).
"""

from __future__ import annotations

from collections.abc import Iterator
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

import torch

ADAPTER_CONFIG = "adapter_config.json"
MERGED = "merged"
"""The subdirectory of a LoRA checkpoint that holds the base with its adapter merged (5.)."""
_WEIGHT_FILES = (".safetensors", ".bin", ".index.json", ".pt")


def target_modules(spec: str) -> list[str] | str:
    """``"q_proj,v_proj"`` -> ["q_proj", "v_proj"]; ``"all-linear"`` stays peft's keyword."""
    names = [m.strip() for m in spec.split(",") if m.strip()]
    return "all-linear" if names == ["all-linear"] else names


def with_lora(model, *, r: int, alpha: float, dropout: float, targets: str, seed: int,
              adapter_dir: str | Path | None = None, adapter_name: str = "default"):
    """``model`` wrapped in a trainable peft LoRA model: a new adapter (A initialised from
    ``seed``, B zero), or the one saved in ``adapter_dir`` (resume), named ``adapter_name``.
    ``model`` may be a peft model already, with other policies' adapters (4.): the adapter is added."""
    from peft import LoraConfig, PeftModel, get_peft_model

    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules(targets),
                        bias="none", task_type="CAUSAL_LM")
    if isinstance(model, PeftModel):
        if adapter_dir is not None:
            model.load_adapter(str(adapter_dir), adapter_name=adapter_name, is_trainable=True)
        else:
            torch.manual_seed(seed)
            model.add_adapter(adapter_name, config)
        return model
    if adapter_dir is not None:
        return PeftModel.from_pretrained(model, str(adapter_dir), adapter_name=adapter_name, is_trainable=True)
    torch.manual_seed(seed)          # A's initialisation: the same seed gives the same run
    return get_peft_model(model, config, adapter_name=adapter_name)


def is_adapter(path: str | Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def trainable_parameters(model) -> list[torch.nn.Parameter]:
    """The parameters the optimizer updates: all of them for full fine-tuning, the adapters' with LoRA."""
    return [p for p in model.parameters() if p.requires_grad]


@contextmanager
def reference(model, ref_model=None) -> Iterator[torch.nn.Module]:
    """The KL reference policy: ``ref_model`` if given, else ``model`` with its adapters disabled."""
    if ref_model is not None:
        yield ref_model
        return
    with model.disable_adapter():
        yield model


def merged_state_dict(model, adapter: str = "default") -> dict[str, torch.Tensor]:
    """The base model's weights under their own names (as the base's checkpoint has them), with
    ``adapter`` merged into every layer it adapts: W + (alpha / r) B A (peft's ``get_delta_weight``).
    The model is left as it is (no ``merge_and_unload``)."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    with torch.no_grad():
        state = {name.replace(".base_layer.", "."): tensor for name, tensor in base.state_dict().items()
                 if ".lora_" not in name}
        for name, module in base.named_modules():
            if isinstance(module, LoraLayer) and adapter in module.lora_A:
                state[f"{name}.weight"] = module.base_layer.weight + module.get_delta_weight(adapter)
    return {name: tensor.detach().contiguous() for name, tensor in state.items()}


def save_merged(model, adapter: str, out: Path, base_dir: Path) -> Path:
    """Write ``out``: :func:`merged_state_dict` as ``model.safetensors`` and the base's other files
    (config, tokenizer) from ``base_dir``; a directory that exists is complete (it is renamed into
    place), and is returned as it is."""
    from safetensors.torch import save_file

    if out.is_dir():
        return out
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(merged_state_dict(model, adapter), tmp / "model.safetensors", metadata={"format": "pt"})
    for f in base_dir.iterdir():
        if f.is_file() and not f.name.endswith(_WEIGHT_FILES):
            shutil.copy2(f, tmp / f.name)
    os.replace(tmp, out)
    return out
