"""The warm parent of worker-mode rollouts: one interpreter that pays once for start-up, the
OpenTelemetry auto-instrumentation and the agent's imports, then forks one child per rollout.

Run by the agent's own interpreter, by path (``python .../zygote.py FD_IN FD_OUT SPEC``); it
imports only the standard library and OpenTelemetry, so it runs in any environment that can run
the agent under ``opentelemetry-instrument``. ``rollout/worker.py`` starts and drives it.

Warm-up, once:
1. ``opentelemetry-instrument``'s own steps (its ``_load`` module): the distro, then every
   instrumentor, with **no tracer provider set yet**: the instrumentations hold proxy tracers,
   which bind to the first provider a process sets, and the SDK's pieces (exporters, resource
   detectors, the configurator) are imported and their entry points cached;
2. the agent's imports: the modules the script (and the local modules it imports, recursively)
   imports at its top level, outside the script's own folder;
3. ``gc.freeze()``, so that the children's garbage collections do not copy the warm heap.

Then it learns from its children: each reports the modules it imported that the zygote lacked
(``learnable``), which the zygote imports before the next fork; once ``QUIET_CHILDREN`` children in
a row reported none, the next ones report nothing (the report touches every module object, each
a page the child must copy: bench/README.md, "Rollout overhead").

Per rollout, in a forked child (the parent stays single-threaded, so a fork is safe):
1. its own session and process group (a timeout kills it and whatever it started), its own
   stdout/stderr log file, stdin from /dev/null, the rollout's environment as ``os.environ``
   (``OTEL_RESOURCE_ATTRIBUTES`` with its rollout, task, split; the policy version; the task);
2. the SDK configured from that environment, as ``opentelemetry-instrument`` does at start-up:
   a fresh tracer provider whose resource carries the rollout's attributes, so every span has
   its rollout's ids, exactly as in a process of its own; the proxy tracers bind to it;
3. the script run unchanged as ``__main__`` (``runpy``), ``sys.argv`` and ``sys.path[0]`` as
   ``python script.py`` sets them; then the exit handlers (the provider's shutdown flushes its
   spans) and ``os._exit`` with the script's exit status.

Protocol, one JSON object per line: requests on FD_IN (``{"op": "run", "id", "env", "log",
"argv"}``, ``{"op": "kill", "id"}``), events on FD_OUT (``ready``, ``started`` with the pid,
``exit`` with the return code: negative for a signal, as ``subprocess`` reports it). EOF on
FD_IN stops the zygote after killing its children.
"""

from __future__ import annotations

import ast
import gc
import importlib
import importlib.util
import json
import os
import runpy
import selectors
import shutil
import signal
import sys
import tempfile
import threading
import traceback
from pathlib import Path

_AUTO_DIR = None  # opentelemetry's auto_instrumentation folder (its sitecustomize), set by warm_up


def top_level_imports(path: Path, folder: Path, seen: set[Path] | None = None) -> list[str]:
    """Modules ``path`` imports at its top level (in ``try``/``if`` blocks too; ``from X import Y``
    gives ``X`` and ``X.Y``, which may be a submodule), following the local modules of ``folder``
    it imports; the local ones themselves are left out."""
    seen = set() if seen is None else seen
    if path in seen:
        return []
    seen.add(path)
    try:
        tree = ast.parse(path.read_text(), str(path))
    except (OSError, SyntaxError, ValueError):
        return []
    names: list[str] = []
    body = list(tree.body)
    while body:
        node = body.pop(0)
        if isinstance(node, (ast.Try, ast.If)):
            body[:0] = [*node.body, *node.orelse, *[s for h in getattr(node, "handlers", []) for s in h.body]]
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names += [node.module, *(f"{node.module}.{a.name}" for a in node.names if a.name != "*")]
    out: list[str] = []
    for name in names:
        top = name.split(".")[0]
        init = next((f for f in (folder / f"{top}.py", folder / top / "__init__.py") if f.is_file()), None)
        if init is not None:
            out += [n for n in top_level_imports(init, folder, seen) if n not in out]
        elif name not in out:
            out.append(name)
    return out


def _preload(name: str) -> bool:
    """Import ``name``; False when it is ``X.Y`` for a ``Y`` that is a name in ``X``, not a module."""
    parent, _, child = name.rpartition(".")
    if parent and parent in sys.modules and hasattr(sys.modules[parent], child):
        return False
    if parent and importlib.util.find_spec(name) is None:
        return False
    importlib.import_module(name)
    return True


def warm_up(spec: dict) -> dict:
    """Load the instrumentation and the agent's imports; what was preloaded and what failed."""
    global _AUTO_DIR
    from opentelemetry.instrumentation.auto_instrumentation import _load
    import opentelemetry.instrumentation.auto_instrumentation as auto

    _AUTO_DIR = str(Path(auto.__file__).resolve().parent)
    distro = _load._load_distro()
    distro.configure()
    _load._load_instrumentors(distro)
    # the SDK's configuration path, imported (and its entry points cached) here, run per child
    import opentelemetry.sdk._configuration  # noqa: F401
    import opentelemetry.sdk.trace.export  # noqa: F401
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.util._importlib_metadata import entry_points

    Resource.create({})
    for group in ("opentelemetry_configurator", "opentelemetry_traces_exporter", "opentelemetry_id_generator"):
        for ep in entry_points(group=group):
            if group != "opentelemetry_traces_exporter" or ep.name == "otlp_proto_" + _protocol():
                try:
                    loaded = ep.load()
                    if group == "opentelemetry_traces_exporter":
                        loaded().shutdown()      # its transport's imports happen on construction
                except Exception:  # noqa: BLE001 (an exporter this environment lacks: its rollouts fail as they would)
                    pass
    preloaded, failed = [], []
    found = importlib.util.find_spec(spec["module"]) if spec.get("module") else None
    script = Path(spec["script"]).resolve() if spec.get("script") else Path(found.origin) if found and found.origin \
        else None
    if script is not None and script.suffix == ".py":
        for name in top_level_imports(script, Path(_agent_folder(spec))):
            try:
                if _preload(name):
                    preloaded.append(name)
            except BaseException as e:  # noqa: BLE001 (the agent's own run meets it again, in its log)
                failed.append(f"{name}: {type(e).__name__}: {e}")
    gc.collect()
    gc.freeze()
    from opentelemetry import trace

    # a tracer provider set by now (a library that sets its own at import) would be every child's,
    # with the zygote's resource: the runner then falls back to a process per rollout
    return {"preloaded": preloaded, "failed": failed,
            "provider_set": not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider),
            "threads": [t.name for t in threading.enumerate() if t is not threading.main_thread()]}


QUIET_CHILDREN = 16
"""Children in a row that imported nothing the zygote lacked, after which the zygote stops asking."""


def learnable(before: set[str], folder: str) -> list[str]:
    """Modules this process imported since ``before`` that a zygote may import too: from files,
    outside the agent's own ``folder`` (its local modules run per rollout, as its script does)."""
    out = []
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if name in before or name in ("__main__", "__mp_main__") or not isinstance(file, str):
            continue
        top = os.path.join(folder, name.split(".")[0])
        file = os.path.abspath(file)
        if file != top + ".py" and not file.startswith(top + os.sep):
            out.append(name)
    return sorted(out, key=lambda n: n.count("."))


def learn(names: list[str]) -> str | None:
    """Import what a rollout imported lazily, so the next children start with it; the reason the
    zygote can no longer fork safely, if importing started a thread or set a tracer provider."""
    from opentelemetry import trace

    for name in names:
        if name not in sys.modules:
            try:
                importlib.import_module(name)
            except BaseException:  # noqa: BLE001 (a rollout imported it; here it need not work)
                pass
    gc.freeze()
    threads = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    if threads:
        return f"importing what a rollout imported started threads {threads}"
    if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        return "importing what a rollout imported set a tracer provider"
    return None


def _protocol() -> str:
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    return "http" if protocol.startswith("http") else "grpc"


def _subprocess_pythonpath(env: dict, cwd: str) -> str:
    """PYTHONPATH as ``opentelemetry-instrument`` leaves it, so that Python subprocesses the agent
    starts are instrumented too: its sitecustomize folder, the working directory, the rest."""
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if cwd not in parts:
        parts.insert(0, cwd)
    return os.pathsep.join([_AUTO_DIR, *[p for p in parts if p != _AUTO_DIR]])


def _agent_folder(spec: dict) -> str:
    """Where the agent's own modules are: the script's folder, or the working directory (``-m``)."""
    return str(Path(spec["script"]).resolve().parent) if spec.get("script") else os.getcwd()


def _child(request: dict, spec: dict, closing: list[int], before: set[str], learn_dir: str | None) -> None:
    """The forked child: becomes the rollout, never returns. With ``learn_dir``, it leaves there the
    names of the modules it imported that the zygote lacked (``learnable``)."""
    code = 1
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in closing:
            os.close(fd)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        env = dict(request["env"])
        cwd = request.get("cwd") or os.getcwd()
        env["PYTHONPATH"] = _subprocess_pythonpath(env, cwd)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        if "numpy" in sys.modules:  # random's own generator is reseeded at fork; numpy's is not
            sys.modules["numpy"].random.seed()
        code = _run_agent(request, spec)
    except BaseException:  # noqa: BLE001 (whatever happens, the child ends here)
        traceback.print_exc()
    finally:
        try:
            import atexit

            atexit._run_exitfuncs()  # the agent's exit handlers, the tracer provider's shutdown (flush)
            if learn_dir:
                names = learnable(before, _agent_folder(spec))
                with open(os.path.join(learn_dir, f"{os.getpid()}.json"), "w") as f:
                    json.dump(names, f)
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError):
                    pass
            os._exit(code)


def _run_agent(request: dict, spec: dict) -> int:
    """Configure the SDK from the rollout's environment, then run the agent as ``__main__``."""
    from opentelemetry.instrumentation.auto_instrumentation import _load

    _load._load_distro().configure()
    _load._load_configurators()
    instrumentor = sys.modules.get("lightspan.tracing.instrumentor")
    if instrumentor is not None:  # its processors on this rollout's SDK provider: LLM spans' nesting, and
        instrumentor.attach()     # the span spool of this rollout (LIGHTSPAN_SPOOL, read from its environment)
    report = sys.modules.get("lightspan.tracing.report")
    if report is not None:  # this rollout's capture counts, written where its LIGHTSPAN_CAPTURE_REPORT says
        report.restart()
    argv = request.get("argv") or []
    try:
        if spec.get("script"):
            script = str(Path(spec["script"]).resolve())
            sys.argv = [spec["script"], *argv]
            sys.path.insert(0, str(Path(script).parent))
            runpy.run_path(script, run_name="__main__")
        else:
            sys.argv = [spec["module"], *argv]
            sys.path.insert(0, os.getcwd())
            runpy.run_module(spec["module"], run_name="__main__", alter_sys=True)
        return 0
    except SystemExit as e:
        if e.code is None:
            return 0
        if isinstance(e.code, int):
            return e.code & 0xFF
        sys.stderr.write(f"{e.code}\n")
        return 1
    except BaseException as e:  # noqa: BLE001 (as the interpreter does: sys.last_*, the hook, status 1)
        _uncaught(e)
        return 130 if isinstance(e, KeyboardInterrupt) else 1


def _uncaught(e: BaseException) -> None:
    """As the interpreter does with an exception that ends ``__main__``: ``sys.last_*`` (read at exit by
    the span spool, tracing/spool.py), then ``sys.excepthook`` (the traceback, or the agent's hook)."""
    sys.last_type, sys.last_value, sys.last_traceback = type(e), e, e.__traceback__
    if sys.version_info >= (3, 12):
        sys.last_exc = e
    try:
        sys.excepthook(type(e), e, e.__traceback__)
    except BaseException:  # noqa: BLE001 (a hook that fails: the traceback, as the interpreter prints it)
        traceback.print_exception(e)


def _status(raw: int) -> int:
    return -os.WTERMSIG(raw) if os.WIFSIGNALED(raw) else os.WEXITSTATUS(raw)


def serve(fd_in: int, fd_out: int, spec: dict) -> None:
    """The zygote's loop: fork on ``run``, kill on ``kill``, report exits, learn what the children
    imported; single-threaded."""
    out = os.fdopen(fd_out, "w", buffering=1)
    running: dict[int, str] = {}             # pid -> rollout id
    pids: dict[str, int] = {}                # rollout id -> pid
    learn_dir = tempfile.mkdtemp(prefix="lightspan-zygote-") if spec.get("learn", True) else None
    quiet = 0                                # children in a row that reported nothing to learn
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the selector through the wakeup fd
    sel = selectors.DefaultSelector()
    sel.register(fd_in, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    buffer = b""

    def send(doc: dict) -> None:
        out.write(json.dumps(doc) + "\n")

    def reap() -> None:
        nonlocal learn_dir, quiet
        while running:
            try:
                pid, raw, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            rid = running.pop(pid, None)
            if rid is not None:
                pids.pop(rid, None)
                send({"event": "exit", "id": rid, "code": _status(raw),
                      "cpu_s": round(usage.ru_utime + usage.ru_stime, 4)})
            learnt, unsafe = _learn_from(learn_dir, pid) if learn_dir else (False, None)
            quiet = 0 if learnt else quiet + 1
            if unsafe:                       # no more forks from here: the runner starts a new zygote
                send({"event": "unsafe", "why": unsafe})
                shutil.rmtree(learn_dir, ignore_errors=True)
                learn_dir = None

    try:
        while True:
            for key, _ in sel.select(timeout=1.0):
                if key.fd == wake_r:
                    try:
                        os.read(wake_r, 4096)
                    except BlockingIOError:
                        pass
                    continue
                chunk = os.read(fd_in, 1 << 16)
                if not chunk:                     # the runner is gone: so are its rollouts
                    for pid in running:
                        _kill(pid)
                    return
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    request = json.loads(line)
                    if request["op"] == "kill":
                        if request["id"] in pids:
                            _kill(pids[request["id"]])
                        continue
                    for stream in (out, sys.stdout, sys.stderr):
                        stream.flush()
                    asking = learn_dir if quiet < QUIET_CHILDREN else None   # (what the child reports to)
                    before = set(sys.modules) if asking else set()
                    pid = os.fork()
                    if pid == 0:
                        _child(request, spec, [fd_in, fd_out, wake_r, wake_w], before, asking)
                    running[pid], pids[request["id"]] = request["id"], pid
                    send({"event": "started", "id": request["id"], "pid": pid})
            reap()
    finally:
        if learn_dir:
            shutil.rmtree(learn_dir, ignore_errors=True)


def _learn_from(learn_dir: str, pid: int) -> tuple[bool, str | None]:
    """Import what child ``pid`` reported importing (``learn``): (whether it reported a module the
    zygote still lacked, why forking is unsafe now if it is); a child that reported nothing (none to
    report, or not asked) or only what an earlier child did taught nothing."""
    path = os.path.join(learn_dir, f"{pid}.json")
    try:
        with open(path) as f:
            names = json.load(f)
        os.unlink(path)
    except (OSError, ValueError):
        return False, None
    names = [name for name in names if name not in sys.modules]
    return bool(names), learn(names) if names else None


def _kill(pid: int) -> None:
    """SIGKILL the rollout's process group (the child leads it); the child is not reaped yet, so
    its pid (and group id) cannot have been reused."""
    for kill in (os.killpg, os.kill):     # the group, and the child itself should it not lead one yet
        try:
            kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def main(argv: list[str]) -> None:
    fd_in, fd_out, spec = int(argv[1]), int(argv[2]), json.loads(argv[3])
    if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
        sys.path.pop(0)                       # this file's folder is not the agent's
    info = warm_up(spec)
    os.write(fd_out, (json.dumps({"event": "ready", "pid": os.getpid(), **info}) + "\n").encode())
    serve(fd_in, fd_out, spec)


if __name__ == "__main__":
    main(sys.argv)
