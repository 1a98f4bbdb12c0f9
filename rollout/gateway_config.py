"""``lightspan gateway``'s configuration (rollout/gateway.py): one frozen dataclass, checked at start-up."""

from __future__ import annotations

import math
from dataclasses import dataclass
from urllib.parse import urlsplit

from lightspan.core.config import ConfigError, is_loopback, option
from lightspan.store.layout import DATA_DIR_ENV, DEFAULT_DATA_DIR
from lightspan.store.policies import POLICIES_ENV
from lightspan.store.policies import load as load_policies


@dataclass(frozen=True)
class GatewayConfig:
    upstream: str = option("http://127.0.0.1:8000", "Base URL of the vLLM server (without /v1).")
    upstreams: tuple[str, ...] = option(
        (), "Several vLLM replicas instead of upstream, comma-separated base URLs (dns+http://NAME:PORT: every "
            "address of NAME, a Kubernetes headless Service). A rollout's calls all go to one replica (its prefix "
            "cache), rollouts spread over them; replicas the trainer's last sync took out of rotation "
            "(DATA_DIR/replicas.json) get none.")
    replica_down_s: float = option(
        10.0, "With upstreams: a replica that refuses or resets a connection gets no call for this long; its "
              "rollouts go to the next replica (their prefix cache is lost) and come back once it is up.")
    host: str = option("127.0.0.1", "Bind address. Off loopback the admin routes need admin_token.")
    port: int = option(8100, "HTTP port agents call (their OPENAI_BASE_URL is http://HOST:PORT/v1).")
    otlp_endpoint: str = option("http://127.0.0.1:4317", "Collector OTLP/gRPC endpoint the spans go to.")
    collector_api_url: str = option(
        "http://127.0.0.1:8321", "The collector's API (its api_port): POST /rollouts/{id}/reward is posted to its "
                                 "POST /v1/rewards as the agent's reward (rollout/rewards.py).")
    collector_token: str = option(
        "", "The collector's auth_token, if it has one, sent with each reward the gateway posts. Never its "
            "reward_token: a session reward is the agent's own.", env="LIGHTSPAN_COLLECTOR_AUTH_TOKEN")
    service_name: str = option("lightspan-gateway", "service.name of the gateway's spans.")
    data_dir: str = option(DEFAULT_DATA_DIR, "Data directory; its policy.json gives the served policy version.",
                           env=DATA_DIR_ENV)
    strip_capture_fields: bool = option(
        True, "Answer with the fields the caller asked for: token ids and logprobs the gateway added are set "
              "back to null. Off: callers also get them.")
    policies: str = option(
        "", "A TOML file of [[policies]] (lightspan/store/policies.py): a call whose caller names its agent "
            "(the x-lightspan-agent header) goes to the model of the policy that owns that agent, whatever model "
            "it asked for. With or without it, a call to a policy's model name records that policy and its "
            "version (policy.json).", env=POLICIES_ENV)
    capture_content: bool = option(True, "Record prompts and completions as gen_ai.input/output.messages.")
    max_in_flight: int = option(256, "Generation requests proxied at once; past it, 429 with Retry-After.")
    retry_after_s: int = option(1, "Retry-After (seconds) of a 429 while paused or full.")
    drain_timeout_s: float = option(120.0, "How long POST /admin/pause waits for in-flight requests.")
    upstream_timeout_s: float = option(600.0, "Read timeout for vLLM's answer (between stream chunks).")
    max_body_bytes: int = option(16 << 20, "Largest request body accepted (413 past it).")
    admin_token: str = option("", "When set, /admin/* needs 'Authorization: Bearer TOKEN'.")
    allow_no_admin_token: bool = option(
        False, "Let the gateway bind a non-loopback host without admin_token (anyone who reaches it can pause "
               "inference and set the recorded policy version). Without it such a start fails.")
    allowed_hosts: tuple[str, ...] = option(
        (), "Host names the gateway answers to besides IP addresses and localhost, comma-separated (e.g. its "
            "service name); a request naming another host gets 403 (a DNS-rebinding guard). \"*\": any.")
    max_connections: int = option(1024, "Open connections; past it a new one gets 503 + Retry-After.")
    read_timeout_s: float = option(30.0, "Time a request's head and body have to arrive, from its first byte "
                                         "(408 past it; the connection is closed).")

    def __post_init__(self):
        if not urlsplit(self.collector_api_url).scheme.startswith("http"):
            raise ConfigError("gateway", "collector_api_url", f"{self.collector_api_url!r} is not an http(s) URL",
                              "pass --collector-api-url http://HOST:PORT (the collector's API port)")
        if not urlsplit(self.upstream).scheme.startswith("http"):
            raise ConfigError("gateway", "upstream", f"{self.upstream!r} is not an http(s) URL",
                              "pass --upstream http://HOST:PORT (the vLLM server)")
        for target in self.upstreams:
            if not urlsplit(target.removeprefix("dns+")).scheme.startswith("http"):
                raise ConfigError("gateway", "upstreams", f"{target!r} is not an http(s) URL",
                                  "pass --upstreams http://HOST:PORT,... or dns+http://NAME:PORT")
        for name in ("max_in_flight", "max_body_bytes", "max_connections"):
            if getattr(self, name) < 1:
                raise ConfigError("gateway", name, "must be at least 1", f"pass --{name.replace('_', '-')} 1 or more")
        if not (math.isfinite(self.replica_down_s) and self.replica_down_s >= 0):
            raise ConfigError("gateway", "replica_down_s", "must be a number of seconds >= 0", "pass e.g. 10")
        if not (math.isfinite(self.read_timeout_s) and self.read_timeout_s > 0):
            raise ConfigError("gateway", "read_timeout_s", "must be a positive number of seconds", "pass e.g. 30")
        if not is_loopback(self.host) and not self.admin_token and not self.allow_no_admin_token:
            raise ConfigError("gateway", "admin_token", f"host {self.host!r} exposes /admin/pause and /admin/resume "
                              "beyond this machine without a token",
                              "set gateway.admin_token (LIGHTSPAN_GATEWAY_ADMIN_TOKEN), bind 127.0.0.1, or set "
                              "gateway.allow_no_admin_token = true to run without one on purpose")
        object.__setattr__(self, "_policies", load_policies(self.policies) if self.policies else ())

    @property
    def policy_configs(self):
        """The policies file's policies, validated at start-up; () without one."""
        return self._policies
