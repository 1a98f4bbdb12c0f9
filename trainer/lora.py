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
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

ADAPTER_CONFIG = "adapter_config.json"


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
