"""deploy/accelerate/*.yaml load through accelerate's own launch path and name valid fields.

``accelerate launch`` silently ignores an ``fsdp_config`` key it does not know, so each key is
checked against the launcher's arguments, and the FSDP plugin is built from the environment the
launcher would give the training processes.
"""

import os
from pathlib import Path
from unittest import mock

import pytest
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from accelerate.utils.launch import prepare_multi_gpu_env

CONFIGS = Path(__file__).resolve().parents[2] / "deploy" / "accelerate"


def launch_env(name: str, *extra: str) -> tuple[object, dict]:
    parser = launch_command_parser()
    args = parser.parse_args(["--config_file", str(CONFIGS / name), *extra, "-m", "lightspan.cli", "train"])
    args, _, _ = _validate_launch_command(args)
    return args, prepare_multi_gpu_env(args)


@pytest.mark.parametrize("name", ["ddp.yaml", "fsdp.yaml"])
def test_config_loads_and_every_key_is_known(name):
    config = load_config_from_file(str(CONFIGS / name))      # raises on unknown top-level keys
    assert config.mixed_precision == "bf16" and config.use_cpu is False
    launcher_args = {action.dest for action in launch_command_parser()._actions}
    unknown = [key for key in (config.fsdp_config or {}) if key not in launcher_args]
    assert not unknown, f"accelerate launch would ignore {unknown}"


def test_ddp_config_launches_one_process_per_gpu_with_bf16():
    args, env = launch_env("ddp.yaml", "--num_processes", "4")
    assert load_config_from_file(str(CONFIGS / "ddp.yaml")).distributed_type == DistributedType.MULTI_GPU
    assert args.multi_gpu and not args.use_fsdp and args.num_processes == 4      # the CLI overrides the file
    assert env["ACCELERATE_MIXED_PRECISION"] == "bf16" and "ACCELERATE_USE_FSDP" not in env


def test_fsdp_config_shards_decoder_layers():
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    args, env = launch_env("fsdp.yaml")
    assert args.use_fsdp and env["ACCELERATE_USE_FSDP"] == "true"
    with mock.patch.dict(os.environ, env):
        plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
    assert plugin.state_dict_type.name == "FULL_STATE_DICT" and not plugin.cpu_ram_efficient_loading
    small = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=2)
    for cls, config, layer in ((LlamaForCausalLM, LlamaConfig(**small), "LlamaDecoderLayer"),
                               (Qwen2ForCausalLM, Qwen2Config(**small), "Qwen2DecoderLayer")):
        with mock.patch.dict(os.environ, env):
            plugin = FullyShardedDataParallelPlugin()
        plugin.set_auto_wrap_policy(cls(config))
        wrapped = {c.__name__ for c in plugin.auto_wrap_policy.keywords["transformer_layer_cls"]}
        assert wrapped == {layer}
