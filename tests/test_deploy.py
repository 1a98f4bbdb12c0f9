"""Deployment files checked against the code: docker-compose.yml, the Dockerfile, deploy/**.

No container engine or cluster runs in CI, so these tests read the files the way Compose and
kustomize would and check what can go wrong without one: files that do not parse or do not
exist, ports and endpoints that do not meet, `lightspan` commands with a wrong subcommand, option
or config value (parsed by the real CLI parser and resolved into the real config dataclasses),
``LIGHTSPAN_*`` variables that name no config field, and Kubernetes resources whose selectors,
ports, volumes and claims do not match. The pieces that can run here run for real: the
collector with the compose service's configuration receives a gzip-compressed OTLP/gRPC export
(what the OpenTelemetry Collector's exporter sends), and the loop script the scheduled services
use is executed.
"""

from __future__ import annotations

import copy
import dataclasses
import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from lightspan import cli
from lightspan.core.config import ConfigError, env_name, resolve
from lightspan.rollout import k8s
from lightspan.rollout.runner import RolloutConfig, load_tasks

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
LORA_OVERRIDE = ROOT / "deploy" / "compose" / "lora.yml"
BUCKET_OVERRIDE = ROOT / "deploy" / "compose" / "bucket.yml"
BUCKET_ENV = {"MINIO_ROOT_PASSWORD": "compose-test-minio-secret"}
K8S = ROOT / "deploy" / "k8s"
GPU_OVERLAY = K8S / "overlays" / "gpu"
BUCKET_OVERLAY = K8S / "overlays" / "bucket"
NAMESPACE = "lightspan"

# ---------------------------------------------------------------------------------------------
# Compose: interpolation and merging as `docker compose config` does them
# ---------------------------------------------------------------------------------------------

_VAR = re.compile(r"\$(?:(?P<escaped>\$)|\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}"
                  r"|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))")


def interpolate(value, environ: dict[str, str]):
    """Compose's ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?err}, ${VAR:+alt}, $VAR and $$."""
    if isinstance(value, dict):
        return {k: interpolate(v, environ) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, environ) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m):
        if m.group("escaped"):
            return "$"
        name = m.group("name") or m.group("bare")
        op, arg, val = m.group("op"), m.group("arg") or "", environ.get(name)
        unset_or_empty = val is None or (val == "" and op and op.startswith(":"))
        if op in ("-", ":-"):
            return arg if unset_or_empty else val
        if op in ("?", ":?"):
            if unset_or_empty:
                raise AssertionError(f"compose needs ${name}: {arg}")
            return val
        if op in ("+", ":+"):
            return "" if unset_or_empty else arg
        return val or ""

    return _VAR.sub(sub, value)


def merge_override(base: dict, override: dict) -> dict:
    """`docker compose -f base -f override`: mappings merge (environment, depends_on, deploy),
    sequences and scalars (command, entrypoint, image) are replaced."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_override(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


COMPOSE_TOKEN = "compose-test-token"   # what a user's .env gives LIGHTSPAN_COLLECTOR_AUTH_TOKEN


def load_compose(*overrides: Path, environ: dict[str, str] | None = None) -> dict:
    doc = yaml.safe_load(COMPOSE.read_text())
    for path in overrides:
        doc = merge_override(doc, yaml.safe_load(path.read_text()))
    return interpolate(doc, {"LIGHTSPAN_COLLECTOR_AUTH_TOKEN": COMPOSE_TOKEN, **(environ or {})})


def env_of(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(e.split("=", 1) if "=" in e else (e, "") for e in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def mounts_of(service: dict) -> list[dict]:
    """Short-syntax volumes as {source, target, bind, read_only}."""
    out = []
    for spec in service.get("volumes") or []:
        assert isinstance(spec, str), f"use the short volume syntax: {spec!r}"
        parts = spec.split(":")
        source, target = parts[0], parts[1]
        out.append({"source": source, "target": target, "bind": source.startswith((".", "/")),
                    "read_only": len(parts) > 2 and "ro" in parts[2].split(",")})
    return out


def published_ports(service: dict) -> list[tuple[str, int, int]]:
    """(host address, host port, container port) of each `ports:` entry."""
    out = []
    for spec in service.get("ports") or []:
        parts = str(spec).split(":")
        assert len(parts) == 3, f"publish on an explicit address (ADDR:HOST:CONTAINER): {spec!r}"
        out.append((parts[0], int(parts[1]), int(parts[2])))
    return out


def command_list(service: dict) -> list[str]:
    command = service.get("command") or []
    assert isinstance(command, list), f"use the exec form (a list) for commands: {command!r}"
    return [str(c) for c in command]


# ---------------------------------------------------------------------------------------------
# `lightspan ...` commands: the real parser, the real config resolution
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Job:
    name: str                 # the subcommand
    argv: list[str]           # after `lightspan`
    config: object            # the resolved config dataclass (None for sql/model)
    args: object              # argparse's namespace


def lightspan_argv(command: list[str]) -> list[str] | None:
    for i, word in enumerate(command):
        if os.path.basename(word) == "lightspan":
            return command[i + 1:]
    return None


def parse_lightspan(argv: list[str], environ: dict[str, str], path_map=lambda v: v) -> Job:
    """Parse ``lightspan ARGV`` with the CLI's own parser and resolve its config from ``environ``
    (the container's LIGHTSPAN_* variables) the way ``lightspan.cli.main`` does. ``path_map``
    turns container paths into the host files mounted there, for configs that check files."""
    try:
        args = cli._parser(argv).parse_args(argv)
    except SystemExit as exc:  # argparse reports the bad option on stderr
        raise AssertionError(f"`lightspan {' '.join(argv)}` does not parse (exit {exc.code})") from None
    job = cli.JOBS[args.job]
    if job.config is None:
        return Job(args.job, argv, None, args)
    cls, section = cli._load(job.config), job.section
    values = {f.name: path_map(getattr(args, f.name, None)) for f in dataclasses.fields(cls)}
    env = {k: path_map(v) for k, v in environ.items() if k.startswith("LIGHTSPAN_")}
    try:
        cfg = resolve(cls, section=section, file=args.config, environ=env, cli=values)
    except ConfigError as exc:
        raise AssertionError(f"`lightspan {' '.join(argv)}` with {env}: {exc}") from None
    return Job(args.job, argv, cfg, args)


def config_env_names() -> dict[str, set[str]]:
    """Every LIGHTSPAN_* variable a job reads: {variable: {sections}}."""
    names: dict[str, set[str]] = {}
    for job in cli.JOBS.values():
        if job.config is None:
            continue
        section = job.section
        for f in dataclasses.fields(cli._load(job.config)):
            for var in (env_name(section, f.name), f.metadata.get("env")):
                if var:
                    names.setdefault(var, set()).add(section)
    return names


def check_env_names(where: str, environ: dict[str, str], job: Job | None) -> None:
    """Each LIGHTSPAN_* variable is a config field of the job this container runs."""
    known = config_env_names()
    section = cli.JOBS[job.name].section or None if job and job.name in cli.JOBS else None
    for var in environ:
        if not var.startswith("LIGHTSPAN_"):
            continue
        assert var in known, f"{where}: {var} is no config field (known: LIGHTSPAN_<SECTION>_<FIELD>)"
        assert section in known[var], (f"{where}: {var} configures {sorted(known[var])}, but this container "
                                       f"runs `lightspan {job.name if job else '?'}`")


def host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url if "://" in url else "//" + url)
    return parts.hostname, parts.port


# ---------------------------------------------------------------------------------------------
# The compose stack, resolved once per variant
# ---------------------------------------------------------------------------------------------

class Stack:
    def __init__(self, *overrides: Path, environ: dict[str, str] | None = None):
        self.doc = load_compose(*overrides, environ=environ)
        self.services: dict[str, dict] = self.doc["services"]
        self.jobs: dict[str, Job] = {}
        for name, service in self.services.items():
            argv = lightspan_argv(command_list(service))
            if argv is not None:
                self.jobs[name] = parse_lightspan(argv, env_of(service), self.path_map(service))

    @staticmethod
    def path_map(service: dict):
        binds = [m for m in mounts_of(service) if m["bind"]]

        def mapped(value):
            if isinstance(value, str):
                for m in binds:
                    if value == m["target"] or value.startswith(m["target"].rstrip("/") + "/"):
                        return str((ROOT / m["source"]).resolve()) + value[len(m["target"]):]
            return value
        return mapped

    def job(self, subcommand: str) -> tuple[str, Job]:
        found = [(n, j) for n, j in self.jobs.items() if j.name == subcommand]
        assert len(found) == 1, f"expected one service running `lightspan {subcommand}`, got {found}"
        return found[0]

    def listening_ports(self, name: str) -> set[int]:
        """The ports the service's process listens on, from its own configuration."""
        service, job = self.services[name], self.jobs.get(name)
        if job is not None and job.name == "collector":
            return {job.config.grpc_port, job.config.http_port, job.config.api_port}
        if job is not None and job.name == "train":
            return {job.config.metrics_port}
        command = command_list(service)
        if "--port" in command:                       # vLLM
            return {int(command[command.index("--port") + 1])}
        if name == "otelcol":
            config = otelcol_config(self)
            ports = {host_port(p["endpoint"])[1] for p in config["receivers"]["otlp"]["protocols"].values()}
            return ports | {host_port(config["extensions"]["health_check"]["endpoint"])[1]}
        if name == "minio":
            command = command_list(service)
            return {host_port(flag(command, "--address"))[1], host_port(flag(command, "--console-address"))[1]}
        return {"prometheus": {9090}, "grafana": {3000}}.get(name, set())

    def vllm_command(self) -> list[str]:
        return [*(self.services["vllm"].get("entrypoint") or []), *command_list(self.services["vllm"])]


def flag(command: list[str], name: str) -> str | None:
    return command[command.index(name) + 1] if name in command else None


def otelcol_config(stack: Stack) -> dict:
    (mount,) = [m for m in mounts_of(stack.services["otelcol"]) if m["bind"]]
    command = command_list(stack.services["otelcol"])
    (config_arg,) = [c for c in command if c.startswith("--config=")]
    assert config_arg.split("=", 1)[1] == mount["target"], "otelcol's --config is not the mounted file"
    return yaml.safe_load((ROOT / mount["source"]).read_text())


@pytest.fixture(scope="module")
def stack() -> Stack:
    return Stack()


@pytest.fixture(scope="module", params=["reload", "lora", "bucket"])
def variant(request) -> Stack:
    """The default stack, the LoRA override (deploy/compose/lora.yml) and the store in a bucket
    (deploy/compose/bucket.yml)."""
    if request.param == "bucket":
        return Stack(BUCKET_OVERRIDE, environ=BUCKET_ENV)
    return Stack() if request.param == "reload" else Stack(LORA_OVERRIDE)


# ---------------------------------------------------------------------------------------------
# Compose tests
# ---------------------------------------------------------------------------------------------

def test_every_service_has_a_health_check_a_restart_policy_and_pinned_images(stack):
    expected = {"collector", "model", "vllm", "agent", "transitions", "trainer", "otelcol", "prometheus", "grafana"}
    assert expected <= set(stack.services)
    for name, service in stack.services.items():
        check = service.get("healthcheck") or {}
        assert not check.get("disable") and check.get("test"), f"{name} has no health check"
        assert check["test"][0] in ("CMD", "CMD-SHELL"), f"{name}: health check test {check['test']!r}"
        assert service.get("restart") in ("unless-stopped", "always", "on-failure"), f"{name}: restart policy"
        image = service.get("image", "")
        assert image and ":" in image.rsplit("/", 1)[-1] and not image.endswith(":latest") or "build" in service, \
            f"{name}: pin the image's tag ({image!r})"
        for dep, cond in (service.get("depends_on") or {}).items():
            assert dep in stack.services, f"{name} depends on unknown service {dep}"
            if cond["condition"] == "service_healthy":
                assert stack.services[dep].get("healthcheck"), f"{name} waits for {dep} to be healthy: it has no check"
            if cond["condition"] == "service_completed_successfully":
                assert stack.services[dep]["restart"] == "on-failure", f"{dep} is one-shot: restart on-failure only"
    assert stack.services["otelcol"].get("profiles") == ["otelcol"], "the OpenTelemetry Collector is optional"
    assert stack.services["minio"].get("profiles") == stack.services["bucket"].get("profiles") == ["bucket"]
    assert all(not s.get("profiles") for n, s in stack.services.items() if n not in ("otelcol", "minio", "bucket"))


def test_referenced_files_exist_and_the_build_context_keeps_them(stack):
    ignore = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    for name, service in stack.services.items():
        build = service.get("build")
        if build:
            context = ROOT / build["context"]
            dockerfile = context / build.get("dockerfile", "Dockerfile")
            assert dockerfile.is_file(), f"{name}: {dockerfile} missing"
            # every COPY source exists and is not excluded from the context by .dockerignore
            for line in dockerfile.read_text().splitlines():
                if line.startswith("COPY ") and "--from" not in line:
                    for src in line.split()[1:-1]:
                        assert (context / src).exists(), f"Dockerfile copies missing {src}"
                        rel = src.rstrip("/")
                        assert not any(fnmatch.fnmatch(rel, pat) or rel == pat.rstrip("/") for pat in ignore), \
                            f".dockerignore excludes {src}, which the Dockerfile copies"
            args = re.findall(r"^ARG (\w+)", dockerfile.read_text(), re.MULTILINE)
            assert set(build.get("args") or {}) <= set(args), f"{name}: build args {build.get('args')} not in {args}"
        for m in mounts_of(service):
            if m["bind"]:
                assert (ROOT / m["source"]).exists(), f"{name}: mounted {m['source']} does not exist"
                assert m["read_only"], f"{name}: mount {m['source']} read-only"
            else:
                assert m["source"] in stack.doc["volumes"], f"{name}: volume {m['source']} is not declared"
    # the tasks the example agent runs: JSON lines with what examples/math_agent.py reads
    _, rollout = stack.job("rollout")
    tasks = load_tasks(rollout.config.tasks)
    assert tasks and all({"question", "answer"} <= set(t) for t in tasks)
    assert {t["id"] for t in tasks} and len({t["id"] for t in tasks}) == len(tasks)


def test_lightspan_commands_are_real_subcommands_with_valid_options(variant):
    jobs = {j.name for j in variant.jobs.values()}
    assert {"collector", "model", "rollout", "transitions", "train"} <= jobs
    for name, job in variant.jobs.items():
        check_env_names(f"compose service {name}", env_of(variant.services[name]), job)
    command = command_list(variant.services["agent"])
    # the scheduled loop runs the real script baked into the image
    assert command[0] == "every" and int(command[1]) > 0
    assert "COPY deploy/compose/every.sh /usr/local/bin/every" in (ROOT / "Dockerfile").read_text()
    _, rollout = variant.job("rollout")
    argv = rollout.args.command[1:] if rollout.args.command[:1] == ["--"] else rollout.args.command
    assert argv[0] == "python" and (ROOT / "examples" / Path(argv[1]).name).is_file()
    assert argv[1] == "/app/examples/" + Path(argv[1]).name, "the Dockerfile copies examples/ to /app/examples"
    _, train = variant.job("train")
    assert train.config.mode == "every" and train.config.every == "30m"


def test_wrong_commands_and_fields_fail_the_checks():
    """The checks above would catch a typo: an unknown option, a bad value, a misplaced variable."""
    with pytest.raises(AssertionError, match="does not parse"):
        parse_lightspan(["train", "--evry", "30m"], {})
    with pytest.raises(AssertionError, match="trainer.every"):
        parse_lightspan(["train", "--mode", "every", "--model", "/m"], {})
    with pytest.raises(AssertionError, match="collector.host"):
        parse_lightspan(["collector"], {"LIGHTSPAN_COLLECTOR_HOST": " "})
    train = parse_lightspan(["train", "--mode", "once", "--model", "/m"], {})
    with pytest.raises(AssertionError, match="no config field"):
        check_env_names("x", {"LIGHTSPAN_TRAINER_VLLM_ULR": "http://vllm:8000"}, train)
    with pytest.raises(AssertionError, match="configures"):
        check_env_names("x", {"LIGHTSPAN_COLLECTOR_HOST": "0.0.0.0"}, train)


def test_services_bind_every_interface_inside_their_containers(stack):
    _, collector = stack.job("collector")
    assert collector.config.host == "0.0.0.0", "the collector's default 127.0.0.1 is unreachable from other containers"
    _, train = stack.job("train")
    assert train.config.metrics_host == "0.0.0.0" and train.config.metrics_port
    assert flag(stack.vllm_command(), "--host") == "0.0.0.0"


def test_published_ports_are_ports_the_services_listen_on_and_stay_on_loopback(stack):
    seen = set()
    for name, service in stack.services.items():
        for addr, host, container in published_ports(service):
            assert addr == "127.0.0.1", f"{name}: publish on loopback by default (dev-mode vLLM, no token)"
            assert container in stack.listening_ports(name), f"{name}: publishes {container}, listens on {stack.listening_ports(name)}"
            assert host not in seen, f"{name}: host port {host} published twice"
            seen.add(host)
    exposed = load_compose(environ={"PUBLISH_ADDR": "0.0.0.0"})
    assert {p[0] for s in exposed["services"].values() for p in published_ports(s)} == {"0.0.0.0"}


def test_agents_export_to_the_collector_and_call_the_served_policy(variant):
    _, collector = variant.job("collector")
    agent_name, rollout = variant.job("rollout")
    assert host_port(rollout.config.otlp_endpoint) == ("collector", collector.config.http_port)
    assert variant.services["agent"]["depends_on"]["collector"]["condition"] == "service_healthy"
    vllm = variant.vllm_command()
    assert host_port(rollout.config.openai_base_url) == ("vllm", int(flag(vllm, "--port")))
    assert urlsplit(rollout.config.openai_base_url).path == "/v1"
    _, train = variant.job("train")
    # the agent asks for the name the trainer keeps pointing at the newest policy
    assert env_of(variant.services[agent_name])["AGENT_MODEL"] == train.config.served_model_name
    assert 'os.environ.get("AGENT_MODEL"' in (ROOT / "lightspan" / "agents" / "math_agent.py").read_text()
    # and with the OpenTelemetry Collector in front, to the Collector's OTLP/HTTP receiver
    via = Stack(environ={"AGENT_OTLP_ENDPOINT": "http://otelcol:4318"})
    host, port = host_port(via.job("rollout")[1].config.otlp_endpoint)
    assert host == "otelcol" and port in via.listening_ports("otelcol")


def test_vllm_runs_with_the_flags_rl_needs_and_sees_the_trainers_checkpoints(variant):
    vllm, service = variant.vllm_command(), variant.services["vllm"]
    assert service["image"].startswith("vllm/vllm-openai:")
    assert vllm[:3] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    assert flag(vllm, "--logprobs-mode") == "processed_logprobs"
    assert flag(vllm, "--dtype") == "float32", "the trainer's weights are float32"
    env = env_of(service)
    _, train = variant.job("train")
    assert host_port(train.config.vllm_url) == ("vllm", int(flag(vllm, "--port")))
    assert flag(vllm, "--model") == train.config.model, "vLLM serves the trainer's version 0"
    if train.config.sync == "reload":
        assert env.get("VLLM_SERVER_DEV_MODE") == "1"
        assert flag(vllm, "--served-model-name") == train.config.served_model_name
    elif train.config.sync == "lora":
        assert "--enable-lora" in vllm and env.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING") == "1"
        assert int(flag(vllm, "--max-lora-rank")) >= train.config.lora_r
        assert flag(vllm, "--served-model-name") != train.config.served_model_name, \
            "with LoRA the adapter takes the served name; the base model needs another"
    else:
        pytest.fail(f"unexpected sync {train.config.sync}")
    # reload_weights / load_lora_adapter read the trainer's checkpoint path: the same volume at
    # the same path, and the initial model likewise
    trainer_mounts = {m["target"]: m["source"] for m in mounts_of(variant.services["trainer"])}
    vllm_mounts = {m["target"]: m["source"] for m in mounts_of(service)}
    checkpoints = Path(train.config.output_dir or Path(train.config.data_dir) / "checkpoints")
    model = Path(train.config.model)
    for path in (checkpoints, model):
        owners = [t for t in trainer_mounts if path.is_relative_to(t)]
        assert owners and owners[0] in vllm_mounts and vllm_mounts[owners[0]] == trainer_mounts[owners[0]], \
            f"{path} is not on a volume both the trainer and vLLM mount at the same place"
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert variant.services["trainer"]["deploy"]["resources"]["reservations"]["devices"][0]["driver"] == "nvidia"


def test_every_job_shares_the_data_volume_at_its_data_dir(stack):
    _, collector = stack.job("collector")
    volume = {m["target"]: m for m in mounts_of(stack.services["collector"])}[collector.config.data_dir]
    assert not volume["bind"], "the collector's data lives on a named volume"
    for name, job in stack.jobs.items():
        if job.config is not None and hasattr(job.config, "data_dir"):
            mounts = {m["target"]: m for m in mounts_of(stack.services[name])}
            assert mounts.get(job.config.data_dir, {}).get("source") == volume["source"], \
                f"{name} reads {job.config.data_dir}, which is not the collector's volume"
            assert not mounts[job.config.data_dir]["read_only"]


def test_the_bucket_override_puts_every_jobs_data_in_the_bucket_the_stack_creates():
    stack = Stack(BUCKET_OVERRIDE, environ=BUCKET_ENV)
    locations = {name: job.config.data_dir for name, job in stack.jobs.items()
                 if job.config is not None and hasattr(job.config, "data_dir")}
    assert set(locations) >= {"collector", "agent", "transitions", "trainer"}
    (location,) = set(locations.values())
    assert location.startswith("s3://")
    bucket = location[len("s3://"):].split("/", 1)[0]
    creates = " ".join(command_list(stack.services["bucket"]))
    assert f"mc mb --ignore-existing store/{bucket}" in creates and "http://minio:9000" in creates
    for name in locations:
        env = env_of(stack.services[name])
        assert host_port(env["AWS_ENDPOINT_URL"]) == ("minio", 9000) and 9000 in stack.listening_ports("minio")
        assert env["AWS_ACCESS_KEY_ID"] == env_of(stack.services["minio"])["MINIO_ROOT_USER"]
        assert env["AWS_SECRET_ACCESS_KEY"] == BUCKET_ENV["MINIO_ROOT_PASSWORD"] == env_of(stack.services["minio"])["MINIO_ROOT_PASSWORD"]
    _, collector = stack.job("collector")
    assert collector.config.collector_id and collector.config.wal_dir
    wal = [m for m in mounts_of(stack.services["collector"]) if Path(collector.config.wal_dir).is_relative_to(m["target"])]
    assert wal and not wal[0]["bind"] and not wal[0]["read_only"], "the WAL is on the collector's own volume"
    assert stack.services["collector"]["depends_on"]["bucket"]["condition"] == "service_completed_successfully"
    assert stack.services["bucket"]["depends_on"]["minio"]["condition"] == "service_healthy"
    _, rollout = stack.job("rollout")
    assert rollout.config.logs_dir


def test_otel_collector_profile_forwards_otlp_to_lightspan_in_batches(stack):
    config = otelcol_config(stack)
    _, collector = stack.job("collector")
    for protocol in config["receivers"]["otlp"]["protocols"].values():
        assert host_port(protocol["endpoint"])[0] == "0.0.0.0", "Collector receivers bind localhost by default"
    grpc_limit = config["receivers"]["otlp"]["protocols"]["grpc"]["max_recv_msg_size_mib"] * (1 << 20)
    assert grpc_limit <= collector.config.grpc_max_receive_bytes
    exporters = config["exporters"]
    pipelines = config["service"]["pipelines"]
    assert {"traces", "logs"} <= set(pipelines)
    for pipeline in pipelines.values():
        assert pipeline["receivers"] == ["otlp"] and "batch" in pipeline["processors"]
        assert set(pipeline["processors"]) <= set(config["processors"])
        for exporter in pipeline["exporters"]:
            assert exporter.split("/")[0] == "otlp", "the gRPC OTLP exporter"
            assert host_port(exporters[exporter]["endpoint"]) == ("collector", collector.config.grpc_port)
            assert exporters[exporter]["tls"]["insecure"] is (not collector.config.tls_cert_file)
    assert set(config["service"]["extensions"]) <= set(config["extensions"])


def test_prometheus_scrapes_ports_the_services_serve_metrics_on(stack):
    (mount,) = [m for m in mounts_of(stack.services["prometheus"]) if m["bind"]]
    assert f"--config.file={mount['target']}" in command_list(stack.services["prometheus"])
    config = yaml.safe_load((ROOT / mount["source"]).read_text())
    targets = {t: job.get("metrics_path", "/metrics") for job in config["scrape_configs"]
               for sc in job["static_configs"] for t in sc["targets"]}
    _, collector = stack.job("collector")
    _, train = stack.job("train")
    assert targets == {f"collector:{collector.config.api_port}": "/metrics",
                       f"trainer:{train.config.metrics_port}": "/metrics"}
    for target in targets:
        host, port = host_port(target)
        assert host in stack.services and port in stack.listening_ports(host)


def test_grafana_is_provisioned_with_the_prometheus_datasource_and_the_dashboards(stack):
    grafana = {m["target"]: m for m in mounts_of(stack.services["grafana"])}
    provisioning = ROOT / grafana["/etc/grafana/provisioning"]["source"]
    dashboards_mount = grafana["/var/lib/grafana/dashboards"]
    assert dashboards_mount["source"] == "./dashboards/grafana"
    assert provisioning == ROOT / "dashboards" / "grafana" / "provisioning"
    sources = [d for f in sorted((provisioning / "datasources").glob("*.y*ml"))
               for d in yaml.safe_load(f.read_text())["datasources"]]
    (prom,) = [d for d in sources if d["type"] == "prometheus"]
    host, port = host_port(prom["url"])
    assert host == "prometheus" and port in stack.listening_ports("prometheus")
    providers = [p for f in sorted((provisioning / "dashboards").glob("*.y*ml"))
                 for p in yaml.safe_load(f.read_text())["providers"]]
    assert providers and all(p["options"]["path"] == dashboards_mount["target"] for p in providers)
    boards = sorted((ROOT / "dashboards" / "grafana").glob("*.json"))
    assert boards and all(json.loads(b.read_text()).get("panels") for b in boards)


def test_the_collector_as_configured_for_compose_accepts_a_gzip_otlp_export(stack, tmp_path):
    """The OpenTelemetry Collector's OTLP exporter compresses with gzip by default: a real
    collector, configured like the compose service (on loopback and free ports here), takes it."""
    from lightspan import store
    from lightspan.collector.server import Collector
    from opentelemetry.exporter.otlp.proto.grpc.exporter import Compression
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
        InMemorySpanExporter,
    )

    _, job = stack.job("collector")
    cfg = dataclasses.replace(job.config, host="127.0.0.1", grpc_port=0, http_port=0, api_port=0,
                              data_dir=str(tmp_path / "data"))
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "via-otelcol"}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    with provider.get_tracer("t").start_as_current_span("root"):
        for i in range(3):
            with provider.get_tracer("t").start_as_current_span(f"child-{i}"):
                pass
    collector = Collector(cfg).start()
    try:
        exporter = OTLPSpanExporter(endpoint=f"127.0.0.1:{collector.grpc_port}", insecure=True,
                                    compression=Compression.Gzip, timeout=10,
                                    headers={"authorization": f"Bearer {COMPOSE_TOKEN}"})
        assert exporter.export(memory.get_finished_spans()) == SpanExportResult.SUCCESS
        exporter.shutdown()
        collector.flush()
        deadline = time.monotonic() + 10
        while True:
            count = store.connect(cfg.data_dir).execute(
                "SELECT count(*) FROM spans WHERE service_name = 'via-otelcol'").fetchall()[0][0]
            if count == 4 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert count == 4
    finally:
        collector.stop()


def test_the_collector_needs_its_token_and_every_client_of_it_sends_it(stack):
    """Bound to 0.0.0.0 inside the network, the collector refuses to start without a token: compose
    refuses to run without one, and the agents, the OpenTelemetry Collector and Prometheus send it."""
    with pytest.raises(AssertionError, match="LIGHTSPAN_COLLECTOR_AUTH_TOKEN"):
        load_compose(environ={"LIGHTSPAN_COLLECTOR_AUTH_TOKEN": ""})
    _, collector = stack.job("collector")
    assert collector.config.auth_token == COMPOSE_TOKEN and collector.config.host == "0.0.0.0"
    with pytest.raises(ConfigError, match="collector.auth_token"):
        dataclasses.replace(collector.config, auth_token="")
    agent, _ = stack.job("rollout")
    assert env_of(stack.services[agent])["OTEL_EXPORTER_OTLP_HEADERS"] == f"authorization=Bearer%20{COMPOSE_TOKEN}"
    otelcol = otelcol_config(stack)["exporters"]["otlp/lightspan"]["headers"]["authorization"]
    variable = re.fullmatch(r"Bearer \$\{env:(\w+)\}", otelcol).group(1)
    assert env_of(stack.services["otelcol"])[variable] == COMPOSE_TOKEN
    (mount,) = [m for m in mounts_of(stack.services["prometheus"]) if m["bind"]]
    scrape = {j["job_name"]: j for j in yaml.safe_load((ROOT / mount["source"]).read_text())["scrape_configs"]}
    auth = scrape["lightspan-collector"]["authorization"]
    secret = Path(auth["credentials_file"])
    assert auth["type"] == "Bearer" and secret.parent == Path("/run/secrets")
    assert secret.name in stack.services["prometheus"]["secrets"]
    assert stack.doc["secrets"][secret.name]["environment"] == "LIGHTSPAN_COLLECTOR_AUTH_TOKEN"
    # Prometheus names the collector by its service name: the Host allowlist holds it
    assert host_port(scrape["lightspan-collector"]["static_configs"][0]["targets"][0])[0] in collector.config.allowed_hosts


def test_several_collectors_parquet_reads_as_one_deduplicated_store(tmp_path):
    """The scale-out layout of docs/deployment.md: each collector writes its own data directory;
    their spans/ trees, copied under spans/collector=<n>/ of one directory (or bucket prefix),
    read as one store. A batch retried to another collector is stored twice and read once."""
    from lightspan import store
    from lightspan.collector.server import Collector
    from lightspan.lightningrl.builder import run as build
    from lightspan.lightningrl.config import TransitionsConfig
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import SpanExportResult

    from tests.collector.helpers import agent_run, build_provider, config

    batches = []
    for rollout in ("r1", "r2"):
        provider, memory = build_provider(rollout)
        agent_run(provider, calls=2)
        batches.append(memory.get_finished_spans())
    # collector a gets r1; collector b gets r2 and, as if retried after a timeout, r1 again
    for name, sent in (("a", [batches[0]]), ("b", [batches[1], batches[0]])):
        collector = Collector(config(tmp_path / name)).start()
        try:
            exporter = OTLPSpanExporter(endpoint=f"127.0.0.1:{collector.grpc_port}", insecure=True, timeout=10)
            assert all(exporter.export(spans) == SpanExportResult.SUCCESS for spans in sent)
            exporter.shutdown()
            collector.flush()
        finally:
            collector.stop()
        shutil.copytree(tmp_path / name / "spans", tmp_path / "all" / "spans" / f"collector={name}")
    per_rollout = len(batches[0])
    con = store.connect(tmp_path / "all")
    assert con.execute("SELECT count(*) FROM spans").fetchall()[0][0] == 2 * per_rollout
    assert sorted(r[0] for r in con.execute("SELECT rollout_key FROM rollouts").fetchall()) == ["r1", "r2"]
    built = build(TransitionsConfig(data_dir=str(tmp_path / "all"), grace_s=0, min_group_size=1))
    assert built["transitions/spans_read"] == 3 * per_rollout
    assert built["transitions/duplicate_spans"] == per_rollout


def run_healthcheck(service: dict, replace: dict[str, str]) -> int:
    """Run a compose health check here, as Docker would in the container: CMD-SHELL through
    ``sh -c``, CMD as an argv; ``replace`` moves container addresses and paths to local ones."""
    kind, *rest = service["healthcheck"]["test"]
    def local(text: str) -> str:
        for old, new in replace.items():
            text = text.replace(old, new)
        return text
    argv = ["sh", "-c", local(rest[0])] if kind == "CMD-SHELL" else [local(a) for a in rest]
    python_dir = str(Path(sys.executable).parent)   # `python` of the image: this interpreter
    env = {**os.environ, "PATH": python_dir + os.pathsep + os.environ.get("PATH", "")}
    return subprocess.run(argv, env=env, capture_output=True, timeout=30, check=False).returncode


def test_health_checks_pass_on_a_live_service_and_fail_on_a_dead_one(stack, tmp_path):
    from lightspan.collector.server import Collector
    from lightspan.trainer.metrics import MetricsServer, TrainerMetrics

    _, job = stack.job("collector")
    collector = Collector(dataclasses.replace(job.config, host="127.0.0.1", grpc_port=0, http_port=0,
                                              api_port=0, data_dir=str(tmp_path / "data"))).start()
    moved = {f"127.0.0.1:{job.config.api_port}": f"127.0.0.1:{collector.api_port}"}
    try:
        assert run_healthcheck(stack.services["collector"], moved) == 0
    finally:
        collector.stop()
    assert run_healthcheck(stack.services["collector"], moved) != 0

    _, train = stack.job("train")
    server = MetricsServer(TrainerMetrics(), "127.0.0.1", 0)
    moved = {f"127.0.0.1:{train.config.metrics_port}": f"127.0.0.1:{server.port}"}
    try:
        assert run_healthcheck(stack.services["trainer"], moved) == 0
    finally:
        server.stop()
    assert run_healthcheck(stack.services["trainer"], moved) != 0

    # the scheduled loops: healthy while the heartbeat of a successful pass is recent
    heartbeat = tmp_path / "heartbeat"
    for name in ("agent", "transitions"):
        moved = {"/tmp/lightspan-heartbeat": str(heartbeat)}
        heartbeat.unlink(missing_ok=True)
        assert run_healthcheck(stack.services[name], moved) != 0          # no pass finished yet
        heartbeat.touch()
        assert run_healthcheck(stack.services[name], moved) == 0
        old = time.time() - 3 * 3600
        os.utime(heartbeat, (old, old))
        assert run_healthcheck(stack.services[name], moved) != 0          # the loop is stuck

    model = tmp_path / "models" / "policy"
    moved = {"/models/policy": str(model)}
    assert run_healthcheck(stack.services["model"], moved) != 0
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    assert run_healthcheck(stack.services["model"], moved) == 0


def test_the_loop_script_repeats_and_stops_on_the_first_failure(tmp_path):
    script = ROOT / "deploy" / "compose" / "every.sh"
    assert os.access(script, os.X_OK)
    counter, heartbeat = tmp_path / "runs", tmp_path / "heartbeat"
    body = f'n=$(cat {counter} 2>/dev/null || echo 0); n=$((n+1)); echo $n > {counter}; [ $n -lt 3 ]'
    done = subprocess.run([str(script), "0", "sh", "-c", body], env={**os.environ, "HEARTBEAT": str(heartbeat)},
                          capture_output=True, timeout=30, check=False)
    assert done.returncode == 1 and counter.read_text().strip() == "3"   # ran, ran, failed: stopped
    assert heartbeat.is_file()                                          # touched after each success
    usage = subprocess.run([str(script), "5"], capture_output=True, timeout=30, check=False)
    assert usage.returncode == 2 and b"usage" in usage.stderr


# ---------------------------------------------------------------------------------------------
# Kubernetes: a small kustomize (resources, patches, namespace, labels, images)
# ---------------------------------------------------------------------------------------------

CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume", "StorageClass"}
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "Job", "CronJob", "Pod"}
# strategic-merge keys of the lists our patches touch (others are replaced, as kustomize does)
MERGE_KEYS = {"containers": "name", "initContainers": "name", "env": "name", "volumes": "name",
              "volumeMounts": "mountPath", "ports": "containerPort"}


def strategic_merge(base: dict, patch: dict) -> None:
    for key, value in patch.items():
        if value is None:
            base.pop(key, None)
        elif isinstance(value, dict) and isinstance(base.get(key), dict):
            strategic_merge(base[key], value)
        elif (isinstance(value, list) and isinstance(base.get(key), list) and key in MERGE_KEYS
              and all(isinstance(v, dict) and MERGE_KEYS[key] in v for v in value)):
            for item in value:
                same = [b for b in base[key] if b.get(MERGE_KEYS[key]) == item[MERGE_KEYS[key]]]
                if same:
                    strategic_merge(same[0], item)
                else:
                    base[key].append(copy.deepcopy(item))
        else:
            base[key] = copy.deepcopy(value)


def pod_spec(doc: dict) -> dict | None:
    if doc["kind"] == "CronJob":
        return doc["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    if doc["kind"] == "Pod":
        return doc["spec"]
    if doc["kind"] in WORKLOADS:
        return doc["spec"]["template"]["spec"]
    return None


def pod_labels(doc: dict) -> dict:
    if doc["kind"] == "CronJob":
        return doc["spec"]["jobTemplate"]["spec"]["template"]["metadata"].get("labels", {})
    return doc["spec"]["template"]["metadata"].get("labels", {})


def containers(doc: dict) -> list[dict]:
    spec = pod_spec(doc) or {}
    return [*spec.get("initContainers", []), *spec.get("containers", [])]


def kustomize(directory: Path) -> list[dict]:
    """What `kubectl kustomize DIRECTORY` prints, for the features these manifests use."""
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(k) - {"apiVersion", "kind", "namespace", "labels", "resources", "patches", "images"}
    assert not unknown, f"{directory}: the test's renderer does not know {unknown}"
    docs: list[dict] = []
    for res in k.get("resources", []):
        path = (directory / res).resolve()
        assert path.exists(), f"{directory}: resource {res} does not exist"
        docs += kustomize(path) if path.is_dir() else [d for d in yaml.safe_load_all(path.read_text()) if d]
    for patch in k.get("patches", []):
        assert set(patch) <= {"path", "target"}, f"unsupported patch form {patch}"
        body = yaml.safe_load((directory / patch["path"]).read_text())
        assert isinstance(body, dict), "strategic-merge patches only"
        target = patch.get("target") or {"kind": body["kind"], "name": body["metadata"]["name"]}
        hits = [d for d in docs if d["kind"] == target["kind"] and d["metadata"]["name"] == target["name"]]
        assert len(hits) == 1, f"{directory}: patch {patch['path']} matches {len(hits)} resources"
        strategic_merge(hits[0], {k: v for k, v in body.items() if k not in ("apiVersion", "kind")})
    for doc in docs:
        if k.get("namespace") and doc["kind"] not in CLUSTER_SCOPED:
            doc["metadata"]["namespace"] = k["namespace"]
        for entry in k.get("labels", []):
            doc["metadata"].setdefault("labels", {}).update(entry["pairs"])
        for image in k.get("images", []):
            for c in containers(doc):
                name = re.split(r"[:@]", c["image"].rsplit("/", 1)[-1])[0]
                name = c["image"].rsplit("/", 1)[0] + "/" + name if "/" in c["image"] else name
                if name == image["name"]:
                    c["image"] = f"{image.get('newName', name)}:{image['newTag']}" if "newTag" in image \
                        else image.get("newName", name) + c["image"][len(name):]
    return docs


@pytest.fixture(scope="module", params=["base", "gpu", "bucket"])
def rendered(request) -> list[dict]:
    return kustomize({"base": K8S, "gpu": GPU_OVERLAY, "bucket": BUCKET_OVERLAY}[request.param])


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def test_kustomize_output_is_a_set_of_valid_looking_resources(rendered):
    kinds = {d["kind"] for d in rendered}
    assert {"Namespace", "StatefulSet", "Deployment", "Job", "CronJob", "Service"} <= kinds
    seen = set()
    for doc in rendered:
        assert doc.get("apiVersion") and doc.get("kind"), doc
        name = doc["metadata"]["name"]
        assert DNS_LABEL.fullmatch(name), f"{doc['kind']} name {name!r} is not a DNS label"
        assert (doc["kind"], name) not in seen, f"two {doc['kind']}s named {name}"
        seen.add((doc["kind"], name))
        if doc["kind"] not in CLUSTER_SCOPED:
            assert doc["metadata"]["namespace"] == NAMESPACE
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "lightspan"
        if doc["kind"] in WORKLOADS:
            for c in containers(doc):
                assert c["name"] and re.fullmatch(r"[\w./-]+:[\w.-]+", c["image"]), \
                    f"{name}/{c['name']}: image {c['image']!r} has no tag"
                assert c["image"].split(":")[0] in ("lightspan", "vllm/vllm-openai", "minio/minio", "minio/mc")
            if doc["kind"] in ("Deployment", "StatefulSet"):
                selector = doc["spec"]["selector"]["matchLabels"]
                assert selector.items() <= pod_labels(doc).items(), f"{name}: selector does not match its pods"
    assert not any("${" in json.dumps(d) for d in rendered), "a placeholder reached the kustomize output"


def test_services_select_workloads_and_target_their_container_ports(rendered):
    workloads = [d for d in rendered if d["kind"] in WORKLOADS]
    for name, svc in by_kind(rendered, "Service").items():
        selected = [w for w in workloads if svc["spec"]["selector"].items() <= pod_labels(w).items()]
        assert selected, f"Service {name} selects no workload"
        for port in svc["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            for w in selected:
                ports = [p for c in pod_spec(w)["containers"] for p in c.get("ports", [])]
                assert any(target in (p.get("name"), p["containerPort"]) for p in ports), \
                    f"Service {name} targets {target!r}, which {w['kind']} {w['metadata']['name']} does not expose"
    for name, sts in by_kind(rendered, "StatefulSet").items():
        assert sts["spec"]["serviceName"] in by_kind(rendered, "Service")


def test_probes_volumes_and_claims_resolve(rendered):
    claims = {f"{t['metadata']['name']}-{s['metadata']['name']}-{i}"
              for s in by_kind(rendered, "StatefulSet").values()
              for t in s["spec"].get("volumeClaimTemplates", []) for i in range(s["spec"].get("replicas", 1))}
    claims |= set(by_kind(rendered, "PersistentVolumeClaim"))
    for doc in rendered:
        spec = pod_spec(doc)
        if spec is None:
            continue
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        if doc["kind"] == "StatefulSet":
            volumes |= {t["metadata"]["name"]: t for t in doc["spec"].get("volumeClaimTemplates", [])}
        for v in volumes.values():
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in claims, f"{doc['metadata']['name']}: unknown claim"
        for c in containers(doc):
            for m in c.get("volumeMounts", []):
                assert m["name"] in volumes, f"{doc['metadata']['name']}/{c['name']} mounts unknown volume {m['name']}"
            named = {p.get("name") for p in c.get("ports", [])} | {p["containerPort"] for p in c.get("ports", [])}
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                if probe in c:
                    assert c[probe]["httpGet"]["port"] in named, f"{c['name']}.{probe} port is not a container port"
        if doc["kind"] in ("Job", "CronJob"):
            assert spec["restartPolicy"] in ("Never", "OnFailure")


SECRET_VALUE = "from-the-secret"     # a value Kubernetes takes from a Secret when the pod starts


def k8s_env(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value", SECRET_VALUE if "secretKeyRef" in e.get("valueFrom", {}) else "")
            for e in container.get("env", [])}


def k8s_jobs(rendered) -> dict[tuple[str, str], Job]:
    """Each container that runs `lightspan ...`, parsed and resolved; keyed by (resource, container)."""
    out = {}
    for doc in rendered:
        for c in containers(doc):
            argv = lightspan_argv([*c.get("command", []), *c.get("args", [])])
            if argv is not None:
                job = parse_lightspan(argv, {k: v for k, v in k8s_env(c).items() if v})
                check_env_names(f"{doc['kind']} {doc['metadata']['name']}/{c['name']}", k8s_env(c), job)
                out[(f"{doc['kind']}/{doc['metadata']['name']}", c["name"])] = job
    return out


def resolve_service(rendered, url: str) -> set[int]:
    """The ports of the Service a cluster URL (http://NAME[.NAMESPACE[.svc...]]:PORT) names."""
    host, port = host_port(url)
    name, *rest = host.split(".")
    assert not rest or rest[0] == NAMESPACE, f"{url}: another namespace"
    service = by_kind(rendered, "Service").get(name)
    assert service is not None, f"{url}: no Service {name}"
    ports = {p["port"] for p in service["spec"]["ports"]}
    assert port in ports, f"{url}: Service {name} has ports {ports}"
    return ports


def test_lightspan_containers_run_real_commands_that_reach_the_services(rendered):
    jobs = k8s_jobs(rendered)
    assert {j.name for j in jobs.values()} == {"collector", "model", "transitions", "train"}
    vllm = by_kind(rendered, "Deployment")["vllm"]
    (server,) = pod_spec(vllm)["containers"]
    command = [*server["command"], *server["args"]]
    assert command[:3] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    assert flag(command, "--logprobs-mode") == "processed_logprobs" and flag(command, "--host") == "0.0.0.0"
    assert k8s_env(server)["VLLM_SERVER_DEV_MODE"] == "1"
    (model,) = [j for j in jobs.values() if j.name == "model"]
    for job in jobs.values():
        if job.name == "collector":
            assert job.config.host == "0.0.0.0" and job.config.data_dir in ("/data", "s3://lightspan/data")
        if job.name == "train":
            assert job.config.mode == "once" and job.config.sync == "reload"
            assert job.config.metrics_host == "0.0.0.0"
            resolve_service(rendered, job.config.vllm_url)
            assert int(flag(command, "--port")) in {p["containerPort"] for p in server["ports"]}
            assert flag(command, "--served-model-name") == job.config.served_model_name
            assert flag(command, "--model") == job.config.model == model.args.out
    # each lightspan server listens on the ports its container declares (and its Service targets)
    for doc in rendered:
        for c in containers(doc):
            job = jobs.get((f"{doc['kind']}/{doc['metadata']['name']}", c["name"]))
            declared = {p["containerPort"] for p in c.get("ports", [])}
            if job is not None and job.name == "collector":
                assert declared == {job.config.grpc_port, job.config.http_port, job.config.api_port}
            if job is not None and job.name == "train":
                assert declared == {job.config.metrics_port}
    # the trainer's Job and CronJob run the same pod
    job, cron = by_kind(rendered, "Job")["lightspan-train"], by_kind(rendered, "CronJob")["lightspan-train"]
    assert pod_spec(job) == pod_spec(cron) and pod_labels(job) == pod_labels(cron)
    assert cron["spec"]["concurrencyPolicy"] == "Forbid"


def test_gpu_overlay_schedules_gpu_pods_on_gpu_nodes_and_keeps_the_base():
    base, gpu = kustomize(K8S), kustomize(GPU_OVERLAY)
    assert [(d["kind"], d["metadata"]["name"]) for d in base] == [(d["kind"], d["metadata"]["name"]) for d in gpu]
    for doc in gpu:
        spec = pod_spec(doc)
        if spec is None:
            continue
        wants_gpu = any("nvidia.com/gpu" in c.get("resources", {}).get("limits", {}) for c in spec["containers"])
        if wants_gpu or doc["kind"] == "StatefulSet":   # the collector shares their ReadWriteOnce volume
            assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}, doc["metadata"]["name"]
            assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    base_jobs, gpu_jobs = k8s_jobs(base), k8s_jobs(gpu)
    assert base_jobs.keys() == gpu_jobs.keys()
    for key in base_jobs:     # the patches merged into the containers, they did not replace them
        assert base_jobs[key].argv == gpu_jobs[key].argv
    for kind in ("Job", "CronJob"):
        (trainer,) = [c for c in pod_spec(by_kind(gpu, kind)["lightspan-train"])["containers"] if c["name"] == "trainer"]
        assert trainer["image"].endswith("-cu128") and trainer["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert trainer["resources"]["requests"] == pod_spec(by_kind(base, kind)["lightspan-train"])["containers"][0]["resources"]["requests"]
    assert "nvidia.com/gpu" in pod_spec(by_kind(gpu, "Deployment")["vllm"])["containers"][0]["resources"]["limits"]


def test_the_trainer_syncs_every_vllm_replica_and_the_gpu_overlay_runs_several():
    for directory in (K8S, GPU_OVERLAY):
        docs = kustomize(directory)
        vllm = by_kind(docs, "Deployment")["vllm"]
        headless = by_kind(docs, "Service")["vllm-replicas"]
        assert headless["spec"]["clusterIP"] == "None", "one address per replica: a headless Service"
        assert headless["spec"]["selector"].items() <= pod_labels(vllm).items()
        for job in k8s_jobs(docs).values():
            if job.name == "train":
                (target,) = job.config.vllm_replicas
                assert target.startswith("dns+http://")
                assert resolve_service(docs, target[len("dns+"):]) == {8000}
        if directory == GPU_OVERLAY:
            assert vllm["spec"]["replicas"] >= 2


def test_the_bucket_overlay_puts_every_jobs_data_in_the_bucket_it_creates():
    docs = kustomize(BUCKET_OVERLAY)
    jobs = k8s_jobs(docs)
    locations = {key: job.config.data_dir for key, job in jobs.items() if hasattr(job.config, "data_dir")}
    assert {j.name for k, j in jobs.items() if k in locations} == {"collector", "transitions", "train"}
    (location,) = set(locations.values())
    bucket = location[len("s3://"):].split("/", 1)[0]
    (mc,) = containers(by_kind(docs, "Job")["lightspan-bucket"])
    assert f"mc mb --ignore-existing store/{bucket}" in " ".join(mc["args"])
    minio = by_kind(docs, "StatefulSet")["minio"]
    (server,) = containers(minio)
    secrets = {e["name"]: e["valueFrom"]["secretKeyRef"]["name"] for e in server["env"]}
    for doc in docs:
        for c in containers(doc):
            env = {e["name"]: e for e in c.get("env", [])}
            if "LIGHTSPAN_DATA_DIR" in env and env["LIGHTSPAN_DATA_DIR"].get("value", "").startswith("s3://"):
                resolve_service(docs, env["AWS_ENDPOINT_URL"]["value"])
                assert env["AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"]["name"] == secrets["MINIO_ROOT_USER"]
    for key, job in jobs.items():
        if job.name == "collector":
            assert job.config.wal_dir.startswith("/data/")
            (collector,) = [c for c in containers(by_kind(docs, "StatefulSet")["lightspan-collector"]) if c["name"] == key[1]]
            (cid,) = [e for e in collector["env"] if e["name"] == "LIGHTSPAN_COLLECTOR_COLLECTOR_ID"]
            assert cid["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name", "one prefix per replica"
        if job.name == "train":
            assert job.config.output_dir.startswith("/data/"), "checkpoints on the volume vLLM mounts"


def test_the_collector_manifest_requires_its_token_and_the_agents_send_it(rendered, tmp_path):
    (collector,) = containers(by_kind(rendered, "StatefulSet")["lightspan-collector"])
    (token,) = [e for e in collector["env"] if e["name"] == "LIGHTSPAN_COLLECTOR_AUTH_TOKEN"]
    ref = token["valueFrom"]["secretKeyRef"]
    assert ref["optional"] is False, "without the Secret the pod must not start tokenless"
    (job,) = [j for j in k8s_jobs(rendered).values() if j.name == "collector"]
    assert job.config.auth_token == SECRET_VALUE and "lightspan-collector.lightspan" in job.config.allowed_hosts
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"id": "t1"}\n')
    cfg = k8s.JobsConfig(tasks=str(tasks), data_dir=str(tmp_path), image="agent:1", namespace=NAMESPACE, samples=1)
    (doc,) = [yaml.safe_load(d) for d in k8s.render_jobs(cfg, ["python", "agent.py"])]
    (agent,) = doc["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in agent["env"]}
    secret = env["COLLECTOR_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert (secret["name"], secret["key"]) == (ref["name"], ref["key"])
    assert env["OTEL_EXPORTER_OTLP_HEADERS"]["value"] == "authorization=Bearer%20$(COLLECTOR_AUTH_TOKEN)"


def test_the_rollout_job_template_renders_against_the_stack(tmp_path):
    """The Job template ships in the package (rollout/rollout-job.yaml); it is not a kustomize resource."""
    for kustomization in K8S.rglob("kustomization.yaml"):
        assert not any("rollout-job" in r for r in yaml.safe_load(kustomization.read_text())["resources"])
    assert k8s.DEFAULT_TEMPLATE == ROOT / "rollout" / "rollout-job.yaml"
    rendered = kustomize(K8S)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text((ROOT / "deploy" / "compose" / "math-tasks.jsonl").read_text())
    cfg = k8s.JobsConfig(tasks=str(tasks), data_dir=str(tmp_path), samples=2, image="lightspan:0.1.0",
                         namespace=NAMESPACE,
                        otlp_endpoint=f"http://lightspan-collector.{NAMESPACE}:4318",
                        openai_base_url=f"http://vllm.{NAMESPACE}:8000/v1")
    docs = [yaml.safe_load(d) for d in k8s.render_jobs(cfg, ["python", "/app/examples/math_agent.py"])]
    assert len(docs) == 2 * len(load_tasks(tasks))
    for job in docs:
        (agent,) = job["spec"]["template"]["spec"]["containers"]
        env = k8s_env(agent)
        http = {p["port"] for p in by_kind(rendered, "Service")["lightspan-collector"]["spec"]["ports"]
                if p["name"] == "otlp-http"}
        assert host_port(env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"])[1] in http
        assert urlsplit(env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]).path == "/v1/traces"
        assert env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"
        resolve_service(rendered, env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"])
        resolve_service(rendered, env["OPENAI_BASE_URL"])
        assert agent["command"][:2] == ["opentelemetry-instrument", "python"]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
@pytest.mark.parametrize("directory", [K8S, GPU_OVERLAY], ids=["base", "gpu"])
def test_kubectl_kustomize_agrees_with_the_python_renderer(directory):
    out = subprocess.run(["kubectl", "kustomize", str(directory)], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    real = [d for d in yaml.safe_load_all(out.stdout) if d]
    ours = kustomize(directory)
    key = lambda d: (d["kind"], d["metadata"]["name"])
    assert sorted(map(key, real)) == sorted(map(key, ours))
    for theirs in real:
        (mine,) = [d for d in ours if key(d) == key(theirs)]
        assert theirs["metadata"] == mine["metadata"]
        assert theirs.get("spec") == mine.get("spec")
