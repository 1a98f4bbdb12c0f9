"""How many padded tokens one forward/backward pass may hold, from the memory the trainer may use.

A pass over a micro-batch of B rows padded to L tokens (trainer/batches.py's ``pack``) holds, on
top of what the process holds already (weights, optimizer moments once they exist, the batch):

- each decoder layer's activations for the backward pass, per token about ``ACTIVATION_FLOATS``
  x hidden size floats (the layer's inputs, norms, q/k/v, attention output, the MLP's gate, up
  and product, at float32);
- the logits of the completion positions and what the loss makes of them (tempered logits, the
  log-softmax, the entropy's softmax, their gradients): ``LOGIT_FLOATS`` x vocabulary floats per
  token, counted for every padded token (the prompt's positions hold none; an overestimate);
- the gradients (one float per trainable parameter, from the first backward on) and, before the
  first optimizer step, AdamW's two moments: ``reserve_bytes``.

``bytes_per_token`` is that estimate. The constants are counted from the architecture (float32
tensors a Llama-style layer and the loss keep for the backward pass), rounded up, not yet fitted to
a measurement: bench/trainer_memory.py measures the peak (bench/README.md, "Long transitions and
the token budget"). The budget (:func:`token_budget`) is what is left of the limit after the process's resident
memory and the reserve, over the bytes per token; a pass of one row longer than it still runs
(batches.pack), so a budget is a bound on the pass's size, not a refusal.
"""

from __future__ import annotations

import os
import resource

ACTIVATION_FLOATS = 40      # per token, per layer, x hidden size (float32)
LOGIT_FLOATS = 8            # per token, x vocabulary size (float32)
FLOAT_BYTES = 4
AVAILABLE_SHARE = 0.8       # of the machine's available memory, when no limit is set
MIN_TOKENS = 64             # never a budget below this: a pass that small still runs


def bytes_per_token(*, num_layers: int, hidden_size: int, vocab_size: int) -> int:
    """The estimated bytes one padded token costs a forward/backward pass (module docstring)."""
    return FLOAT_BYTES * (ACTIVATION_FLOATS * num_layers * hidden_size + LOGIT_FLOATS * vocab_size)


def reserve_bytes(trainable_parameters: int, *, optimizer_started: bool) -> int:
    """Memory the step will allocate besides its passes: gradients, and AdamW's moments the first time."""
    return FLOAT_BYTES * trainable_parameters * (1 if optimizer_started else 3)


def token_budget(*, limit_bytes: int, resident_bytes: int, reserve: int, per_token: int) -> int:
    """Padded tokens per pass: what the limit leaves after the resident memory and the reserve."""
    return max(MIN_TOKENS, (limit_bytes - resident_bytes - reserve) // max(per_token, 1))


def available_bytes() -> int:
    """The machine's available memory (``MemAvailable``: free plus reclaimable cache), in bytes."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) << 10
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def resident_bytes() -> int:
    """This process's resident memory now, in bytes (its peak where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10


def step_budget(max_memory_gb: float, model, optimizer) -> int:
    """The token budget of a step of ``model`` (unwrapped) with ``optimizer``: under ``max_memory_gb``
    (GiB), or, with 0, under the resident memory plus ``AVAILABLE_SHARE`` of what is available."""
    config = model.config
    config = getattr(config, "text_config", None) or config
    per_token = bytes_per_token(num_layers=config.num_hidden_layers, hidden_size=config.hidden_size,
                                vocab_size=config.vocab_size)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    reserve = reserve_bytes(trainable, optimizer_started=bool(optimizer.state))
    resident = resident_bytes()
    limit = int(max_memory_gb * 2**30) if max_memory_gb else resident + int(AVAILABLE_SHARE * available_bytes())
    return token_budget(limit_bytes=limit, resident_bytes=resident, reserve=reserve, per_token=per_token)
