"""One coding rollout: mini-swe-agent (the PyPI package, unchanged) fixes a bug in its own copy of textkit,
then this script grades the copy and emits the reward. Run it under lightspan rollout, in a private mount
namespace of its own (the working copy is a size-limited tmpfs that vanishes with the rollout):

    lightspan rollout --tasks examples/coding/data/val.jsonl --mode process \\
      -- unshare --mount --propagation private python examples/coding/agent.py

1. The working copy: the clean package (textkit/) copied onto a fresh tmpfs of ``SANDBOX_DISK_MB`` ×
   4, the task's one bugged line written into it, owned by a user id of this rollout's own (a lock in
   /tmp/lightspan-coding/uids: two rollouts never share one, so one's processes never count against
   another's limit).
2. The agent: mini-swe-agent's DefaultAgent, LitellmTextbasedModel and BubblewrapEnvironment, built by its
   own config loader from mini.yaml plus this rollout's settings (the documented way to point it at any
   OpenAI-compatible server: ``model_name: openai/<name>`` and ``model_kwargs.api_base``). lightspan's
   instrumentor captures its calls (LiteLLM's openai provider, token ids included). Each command it runs is
   ``prlimit [limits] -- setpriv [rollout uid] -- bwrap [view] bash -c ACTION``: the environment's
   ``executable`` and ``wrapper_args``, no code change: no network, only /usr read-only, the copy
   writable, a small /tmp, CPU / memory / file / process limits, a wall limit, output capped.
3. The reward, after the agent has ended: grade.py runs the copy's code on the tests' inputs and
   held-back inputs in a fresh sandbox and compares with the clean package here; ``emit_reward`` sends it.
   The policy's commands cannot reach this process, the collector or the grader's expected values.

Exit status: 0 when graded (whatever the reward), 75 (EX_TEMPFAIL: lightspan's infrastructure outcome)
when the model server or the sandbox is unavailable: never a reward of 0 for the model then.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONFIG = Path(os.environ.get("CODING_CONFIG", HERE / "mini.yaml"))
"""mini-swe-agent's config file (CODING_CONFIG): mini.yaml, or a smaller one for a tiny model's context."""
BASE = Path(os.environ.get("CODING_WORK_DIR", "/tmp/lightspan-coding"))
UID_POOL = range(200000, 200000 + 4096)
INFRA = 75
# LiteLLM fetches a price list from the internet at import unless told to use its bundled copy; mini-swe-agent
# reads a global .env and prints a banner unless told not to; its model retries 10 times with back-off.
for key, value in {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "MSWEA_SILENT_STARTUP": "1",
                   "MSWEA_COST_TRACKING": "ignore_errors", "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": "2",
                   "SANDBOX_WALL_S": "30", "SANDBOX_CPU_S": "10", "SANDBOX_MEMORY_MB": "512",
                   "SANDBOX_MAX_PROCESSES": "32", "SANDBOX_DISK_MB": "16"}.items():
    os.environ.setdefault(key, value)
sys.path.insert(0, str(HERE))
import grade  # noqa: E402
from grade import SandboxConfig, SandboxUnavailable  # noqa: E402  (examples/sandbox/sandbox.py)
from make_tasks import bugged_copy  # noqa: E402

log = logging.getLogger("coding")


class Unavailable(RuntimeError):
    """The sandbox or the model server cannot be used: an infrastructure failure (exit 75)."""


def claim_uid() -> tuple[int, object]:
    """A user id no other running rollout holds (an flock held until this process ends)."""
    locks = BASE / "uids"
    locks.mkdir(parents=True, exist_ok=True)
    for uid in UID_POOL:
        f = open(locks / f"{uid}.lock", "w")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return uid, f
        except BlockingIOError:
            f.close()
    raise Unavailable(f"all {len(UID_POOL)} sandbox user ids are in use")


def private_mounts() -> bool:
    """Whether this process has a mount namespace of its own, not its parent's (``unshare --mount`` execs
    the agent in the same process, so the parent is whoever started the rollout)."""
    try:
        return os.readlink("/proc/self/ns/mnt") != os.readlink(f"/proc/{os.getppid()}/ns/mnt")
    except OSError:
        return False


def working_copy(task: dict, root: Path, uid: int, size_mb: int) -> Path:
    """The task's bugged copy of textkit on a fresh tmpfs at ``root``, owned by ``uid``."""
    root.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m,mode=0755", "tmpfs", str(root)],
                   check=True, capture_output=True)
    repo = root / "repo"
    shutil.copytree(grade.PRISTINE, repo)
    bugged_copy(repo, Path(task["file"]).name, int(task["line"]), task["original"], task["buggy"])
    for path in [repo, *repo.rglob("*")]:
        os.chown(path, uid, uid)
    return repo


def reachable(path: Path) -> bool:
    """Whether another user can open ``path`` by its name: every directory above it world-traversable."""
    return all(p.stat().st_mode & 0o001 for p in path.parents)


def staged(src: Path) -> Path:
    """``src``, where the sandbox's own user id can read it: ``src`` itself when it is reachable, else a
    copy under BASE/runtime (a checkout in a private directory, e.g. under /root or a ``mktemp -d``
    folder, is closed to that user), keyed by the source's path and modification time, made once."""
    if reachable(src):
        return src
    key = hashlib.sha1(f"{src}:{src.stat().st_mtime_ns}".encode()).hexdigest()[:16]
    dst = BASE / "runtime" / key / src.name
    if not dst.exists():
        dst.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(dst.parent, 0o755)
        tmp = dst.with_name(f"{src.name}.{os.getpid()}.tmp")
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, tmp)
        try:
            os.rename(tmp, dst)               # atomic: a rollout beside this one may have made it first
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)
    return dst


def sandbox_command(cfg: SandboxConfig, uid: int) -> tuple[str, list[str]]:
    """mini-swe-agent's BubblewrapEnvironment runs ``[executable, *wrapper_args, --bind CWD CWD, --chdir CWD,
    bash, -c, ACTION]``: this is its executable and wrapper_args."""
    disk = cfg.disk_mb * 2**20
    limits = [f"--cpu={cfg.cpu_s}", f"--as={cfg.memory_mb * 2**20}", f"--fsize={disk}", "--nofile=256",
              f"--nproc={grade.sandbox._processes_of(uid) + cfg.max_processes}", "--core=0", "--"]
    drop = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"] if os.geteuid() == 0 else []
    view = ["--ro-bind", "/usr", "/usr"]
    for top in ("bin", "sbin", "lib", "lib32", "lib64"):   # merged /usr: links
        host = Path("/") / top
        if host.is_symlink():
            view += ["--symlink", os.readlink(host), str(host)]
    import pytest  # the agent runs the tests: pytest and what it imports, read-only, for the system python3
    site = Path(pytest.__file__).resolve().parent.parent
    for name in ("pytest", "_pytest", "pluggy", "iniconfig", "packaging", "py.py"):
        if (site / name).exists():
            view += ["--ro-bind", str(staged(site / name)), f"/opt/coding/lib/{name}"]
    bwrap = [shutil.which(cfg.bwrap) or cfg.bwrap, "--unshare-all", "--unshare-user", "--disable-userns",
             "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--hostname", "sandbox", *view,
             "--ro-bind", str(staged(HERE / "sandbox_bin")), "/opt/coding/bin", "--proc", "/proc", "--dev", "/dev",
             "--size", str(disk), "--tmpfs", "/tmp", "--remount-ro", "/", "--clearenv",
             "--setenv", "PATH", "/opt/coding/bin:/usr/bin:/bin", "--setenv", "HOME", "/tmp",
             "--setenv", "TMPDIR", "/tmp", "--setenv", "PYTHONPATH", "/opt/coding/lib",
             "--setenv", "PYTHONDONTWRITEBYTECODE", "1", "--setenv", "LANG", "C.UTF-8", "--setenv", "PAGER", "cat"]
    prlimit = shutil.which(cfg.prlimit)
    if prlimit is None or shutil.which(cfg.bwrap) is None:
        raise Unavailable("bubblewrap or prlimit not found: bash examples/sandbox/setup.sh installs them")
    return prlimit, [*limits, *drop, *bwrap]


def run_agent(task: dict, repo: Path, executable: str, wrapper_args: list[str], cfg: SandboxConfig) -> dict:
    """mini-swe-agent on the task, as its ``mini`` command builds it from a config file; returns its exit
    status and model calls."""
    from minisweagent.agents import get_agent
    from minisweagent.config import get_config_from_spec
    from minisweagent.environments import get_environment
    from minisweagent.models import get_model
    from minisweagent.utils.serialize import recursive_merge

    model_kwargs = {"api_base": os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1"),
                    "api_key": os.environ.get("OPENAI_API_KEY", "lightspan")}
    for key in ("temperature", "max_tokens"):
        if key in task:
            model_kwargs[key] = task[key]
    config = recursive_merge(get_config_from_spec(str(CONFIG)), {
        "model": {"model_name": "openai/" + os.environ.get("AGENT_MODEL", "policy"), "model_kwargs": model_kwargs},
        "environment": {"cwd": str(repo), "executable": executable, "wrapper_args": wrapper_args,
                        "timeout": int(cfg.wall_s)},
        "agent": {"step_limit": int(task.get("step_limit", 0)) or get_config_from_spec(str(CONFIG))["agent"]["step_limit"]},
    })
    model = get_model(config=config["model"])
    env = get_environment(config["environment"], default_type="local")
    agent = get_agent(model, env, config["agent"], default_type="default")
    import litellm

    try:
        info = agent.run(task["statement"])
        status = info.get("exit_status", "")
    except (litellm.exceptions.APIConnectionError, litellm.exceptions.ServiceUnavailableError,
            litellm.exceptions.InternalServerError, litellm.exceptions.Timeout) as e:
        raise Unavailable(f"the model server at {model_kwargs['api_base']} failed: {e}") from e
    except litellm.exceptions.BadRequestError as e:   # e.g. the history outgrew the context: graded as it is
        status = f"BadRequest: {str(e)[:200]}"
    return {"exit_status": status, "turns": agent.n_calls}


def probe(executable: str, wrapper_args: list[str], repo: Path) -> None:
    """One empty command through the sandbox, as the agent's will run."""
    out = subprocess.run([executable, *wrapper_args, "--bind", str(repo), str(repo), "--chdir", str(repo),
                          "bash", "-c", "test -w . && echo ok"], capture_output=True, text=True, timeout=60)
    if out.returncode != 0 or out.stdout.strip() != "ok":
        raise Unavailable(f"the sandbox cannot run here (exit {out.returncode}): {out.stderr.strip()[-300:]}")


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    log.setLevel(logging.INFO)   # this script's lines; LiteLLM's own INFO lines (two per call) stay out of the log
    task = json.loads(os.environ["LIGHTSPAN_TASK"])
    for field in ("id", "file", "line", "original", "buggy", "statement"):
        if field not in task:
            log.error("task %s has no %r: make tasks with examples/coding/make_tasks.py", task.get("id"), field)
            return 2
    if os.geteuid() != 0 or not private_mounts():
        log.error("run as root in a private mount namespace: `unshare --mount --propagation private python "
                  "examples/coding/agent.py` (the working copy is a tmpfs mounted there)")
        return INFRA
    cfg = SandboxConfig.from_env()
    BASE.mkdir(parents=True, exist_ok=True)
    closed = [str(p) for p in [BASE, *BASE.parents] if not p.stat().st_mode & 0o001]
    if closed:   # the sandbox's own user id opens the copy by its path under BASE
        log.error("CODING_WORK_DIR %s is not reachable by other users (%s): use a directory whose parents "
                  "are all world-traversable (chmod o+x), e.g. the default /tmp/lightspan-coding", BASE, closed[0])
        return INFRA
    root = Path(tempfile.mkdtemp(prefix=f"{task['id']}-", dir=BASE))
    try:
        uid, _lock = claim_uid()
        repo = working_copy(task, root, uid, cfg.disk_mb * 4)
        os.environ["MSWEA_GLOBAL_CONFIG_DIR"] = str(root / "mini-config")   # no global .env from the host
        tempfile.tempdir = str(root)   # BubblewrapEnvironment's scratch directory: on the rollout's tmpfs
        executable, wrapper_args = sandbox_command(cfg, uid)
        probe(executable, wrapper_args, repo)
        episode = run_agent(task, repo, executable, wrapper_args, cfg)
        result = grade.grade(repo)
    except (Unavailable, SandboxUnavailable) as e:
        log.error("%s", e)
        return INFRA
    finally:
        subprocess.run(["umount", "-l", str(root)], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)
    reward = 1.0 if result["passed"] else 0.0
    from lightspan.tracing import emit_reward

    emit_reward(reward)
    import resource

    cpu = sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
              for f in ("ru_utime", "ru_stime"))   # this process and its sandboxes (vLLM's share is not here)
    print(json.dumps({"task": task["id"], "tier": task.get("tier"), **episode, "reward": reward,
                      "failed_cases": result["failed"], "cases": result["cases"], "cpu_s": round(cpu, 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
