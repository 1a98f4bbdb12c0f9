"""Run untrusted Python in a bubblewrap sandbox: no network, its own filesystem view, resource limits.

    box = Sandbox(SandboxConfig.from_env())
    box.check()                       # SandboxUnavailable if bubblewrap cannot run here
    result = box.run("print(sum(range(10)))")
    result.stdout, result.exit_code, result.limit      # '45\\n', 0, None

What the program sees (each line is a bubblewrap option or a limit set before it starts):

- **no network**: its own network namespace (``--unshare-net``), holding only a loopback interface of
  its own: nothing on the host, its loopback included, can be reached;
- **its own filesystem view**: ``/usr`` (and the ``/bin``, ``/lib`` links into it) read-only, a fresh
  ``/proc`` of its own PID namespace, a minimal ``/dev``, and one private tmpfs as its work directory
  ``/sandbox`` (``/tmp`` points there), of ``disk_mb``. Nothing else of the host exists inside: not
  ``/etc``, ``/root``, ``/home``, nor the repository;
- **no privileges**: its own user, PID, IPC, UTS and cgroup namespaces (``--unshare-all``), no further
  user namespaces (``--disable-userns``), a new terminal session (``--new-session``: no TIOCSTI into
  the caller's terminal), an empty environment (``--clearenv``); run by root, the agent drops to
  ``nobody`` (uid 65534) before starting bubblewrap;
- **limits** (``prlimit``, applied to bubblewrap and inherited by everything it starts): CPU seconds
  per process (``cpu_s``, then SIGKILL), address space (``memory_mb``: a memory hog gets MemoryError),
  processes of the sandbox's user (``max_processes`` on top of those it has already: a fork bomb's
  forks fail), file size (``disk_mb``) and open files; a wall-clock limit (``wall_s``) after which the
  sandbox is killed. The program is PID 1 of its own PID namespace (``--as-pid-1``), so when it ends,
  or bubblewrap is killed (``--die-with-parent``), every process it started ends with it, before
  :meth:`Sandbox.run` returns;
- **bounded output**: the first ``output_bytes`` of stdout and of stderr are kept, the rest is read
  and dropped.

An error in the sandbox itself (bubblewrap or prlimit missing, namespaces refused) raises
:class:`SandboxUnavailable`, which is an infrastructure failure, never the program's: bubblewrap's
``--json-status-fd`` says whether the program was started at all.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import selectors
import shutil
import subprocess
import time
from pathlib import Path

log = logging.getLogger(__name__)

WORK_DIR = "/sandbox"
NOBODY = 65534
ENV_PREFIX = "SANDBOX_"


class SandboxUnavailable(RuntimeError):
    """The sandbox could not be started (bubblewrap missing or refused): an infrastructure failure."""


@dataclasses.dataclass(frozen=True)
class SandboxConfig:
    """How the sandbox runs; each field is also the environment variable ``SANDBOX_<FIELD>``."""

    bwrap: str = "bwrap"
    """bubblewrap: a path, or a name looked up on ``PATH`` (Debian's package ``bubblewrap``)."""
    prlimit: str = "prlimit"
    """util-linux's ``prlimit``, which sets the limits before bubblewrap starts."""
    python: str = "/usr/bin/python3"
    """The interpreter inside the sandbox; it must live under one of ``ro_binds``."""
    ro_binds: tuple[str, ...] = ("/usr",)
    """Host directories visible read-only inside (``SANDBOX_RO_BINDS``: colon-separated)."""
    cpu_s: int = 5
    """CPU seconds per process (RLIMIT_CPU); the process is killed past it."""
    wall_s: float = 10.0
    """Wall-clock seconds before the whole sandbox is killed."""
    memory_mb: int = 256
    """Address space per process (RLIMIT_AS), MiB."""
    max_processes: int = 16
    """Processes the program may add (RLIMIT_NPROC, over the sandbox user's count at start)."""
    disk_mb: int = 16
    """Size of the work directory's tmpfs and the largest file (RLIMIT_FSIZE), MiB."""
    output_bytes: int = 4096
    """Bytes of stdout, and of stderr, kept; the rest is dropped."""

    def __post_init__(self):
        for name in ("cpu_s", "wall_s", "memory_mb", "max_processes", "disk_mb", "output_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"sandbox {name} must be positive, got {getattr(self, name)!r}: "
                                 f"set {ENV_PREFIX}{name.upper()} to a number above 0")
        if not os.path.isabs(self.python):
            raise ValueError(f"sandbox python must be an absolute path inside ro_binds, got {self.python!r}: "
                             f"set {ENV_PREFIX}PYTHON, e.g. /usr/bin/python3")

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "SandboxConfig":
        """Defaults overridden by ``SANDBOX_<FIELD>`` variables; a bad value is a ValueError naming it."""
        env = os.environ if env is None else env
        values = {}
        for field in dataclasses.fields(cls):
            name = ENV_PREFIX + field.name.upper()
            if name not in env:
                continue
            raw = env[name]
            try:
                if field.name == "ro_binds":
                    values[field.name] = tuple(p for p in raw.split(":") if p)
                elif isinstance(field.default, (int, float)):
                    values[field.name] = type(field.default)(raw)
                else:
                    values[field.name] = raw
            except ValueError:
                raise ValueError(f"{name}={raw!r} is not a {type(field.default).__name__}: "
                                 f"give a number, e.g. {name}={field.default}") from None
        return cls(**values)


@dataclasses.dataclass
class Result:
    """What a program did in the sandbox."""

    stdout: str
    stderr: str
    exit_code: int | None
    """The program's exit status (128 + N when signal N ended it); None when the wall limit killed it."""
    limit: str | None = None
    """The limit that stopped it, when one did: ``wall``, ``cpu`` (killed at RLIMIT_CPU: SIGKILL, as the
    program is its namespace's PID 1 and so ignores SIGXCPU), ``memory`` (MemoryError)."""
    truncated: bool = False
    """Some of stdout or stderr was dropped (``output_bytes``)."""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


class Sandbox:
    """Runs Python source in a fresh bubblewrap sandbox per call (nothing persists between calls)."""

    def __init__(self, config: SandboxConfig | None = None):
        self.config = config or SandboxConfig()

    def check(self) -> None:
        """Start one empty program; raises :class:`SandboxUnavailable` with the reason if it cannot."""
        result = self.run("pass")
        if not result.ok:
            raise SandboxUnavailable(f"the sandbox's probe program failed (exit {result.exit_code}, limit "
                                     f"{result.limit}): {result.stderr.strip()[-300:]}")

    def command(self, status_fd: int | None = None) -> list[str]:
        """The command line: prlimit's limits, then bubblewrap's view, then the interpreter; with
        ``status_fd``, bubblewrap writes its JSON status (the program's pid once started, its exit code) there."""
        cfg = self.config
        bwrap, prlimit = _binary(cfg.bwrap, "BWRAP", "bubblewrap"), _binary(cfg.prlimit, "PRLIMIT", "util-linux")
        disk = cfg.disk_mb * 2**20
        # the program is PID 1 of its namespace (--as-pid-1), which ignores SIGXCPU: the hard limit's SIGKILL ends it
        limits = [f"--cpu={cfg.cpu_s}", f"--as={cfg.memory_mb * 2**20}", f"--fsize={disk}", "--nofile=64",
                  f"--nproc={_processes_of(self._uid()) + cfg.max_processes}", "--core=0"]
        view = []
        for path in cfg.ro_binds:
            view += ["--ro-bind", path, path]
        for top in ("bin", "sbin", "lib", "lib32", "lib64"):   # merged /usr: links; otherwise the directories
            host = Path("/") / top
            if host.is_symlink():
                view += ["--symlink", os.readlink(host), str(host)]
            elif host.is_dir() and "/usr" in cfg.ro_binds:
                view += ["--ro-bind", str(host), str(host)]
        status = [] if status_fd is None else ["--json-status-fd", str(status_fd)]
        return [prlimit, *limits, "--", bwrap, *status,
                "--unshare-all", "--unshare-user", "--disable-userns", "--as-pid-1", "--die-with-parent",
                "--new-session", "--cap-drop", "ALL", "--hostname", "sandbox", *view, "--proc", "/proc", "--dev", "/dev",
                "--size", str(disk), "--tmpfs", WORK_DIR, "--symlink", WORK_DIR, "/tmp",
                "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", WORK_DIR,   # only the work dir is writable
                "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", WORK_DIR,
                "--setenv", "TMPDIR", WORK_DIR, "--setenv", "LANG", "C.UTF-8",
                cfg.python, "-I", "-"]

    def run(self, code: str) -> Result:
        """Run ``code`` (Python source, fed on stdin) in a new sandbox; raises :class:`SandboxUnavailable`
        when the sandbox, not the program, failed."""
        cfg = self.config
        status_r, status_w = os.pipe()
        try:
            command = self.command(status_w)
        except SandboxUnavailable:
            os.close(status_r)
            os.close(status_w)
            raise
        uid = self._uid()
        start = time.monotonic()
        try:
            proc = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(status_w,),
                env={"PATH": "/usr/bin:/bin"}, start_new_session=True,
                **({"user": uid, "group": uid, "extra_groups": []} if uid != os.geteuid() else {}))
        except OSError as e:
            os.close(status_r)
            raise SandboxUnavailable(f"could not start the sandbox ({command[0]}): {e}") from e
        finally:
            os.close(status_w)
        try:
            try:
                proc.stdin.write(code.encode())
                proc.stdin.close()
            except BrokenPipeError:   # it died before reading the program: its status says why
                pass
            out, err, status, timed_out, truncated = _collect(proc, status_r, start + cfg.wall_s, cfg.output_bytes)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            os.close(status_r)
        if "child-pid" not in status:   # bubblewrap never started the program: the sandbox failed
            raise SandboxUnavailable(f"bubblewrap did not start the program (exit {proc.returncode}): "
                                     f"{err.decode(errors='replace').strip()[-500:] or 'no message'}; "
                                     "is bubblewrap installed (apt-get install bubblewrap) and are user "
                                     "namespaces allowed?")
        code_ = None if timed_out else status.get("exit-code", proc.returncode)
        stderr = err.decode(errors="replace")
        limit = ("wall" if timed_out else "cpu" if code_ in (128 + 9, 128 + 24) else
                 "memory" if code_ and "MemoryError" in stderr else None)
        return Result(out.decode(errors="replace"), stderr, code_, limit, truncated, time.monotonic() - start)

    def _uid(self) -> int:
        """Who runs the sandbox: this user, or ``nobody`` when this is root (bubblewrap then runs
        unprivileged, as it is meant to, and the process limit counts only sandboxes)."""
        return NOBODY if os.geteuid() == 0 else os.geteuid()


def _binary(name: str, field: str, package: str) -> str:
    found = shutil.which(name)
    if found is None:
        raise SandboxUnavailable(f"{name!r} not found: install Debian's {package} package "
                                 f"(apt-get install {package}), or set {ENV_PREFIX}{field} to where it is")
    return found


def _processes_of(uid: int) -> int:
    """How many processes ``uid`` has now (RLIMIT_NPROC counts them all, the sandbox's among them)."""
    n = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                n += entry.stat().st_uid == uid
            except OSError:   # it ended meanwhile
                pass
    return n


def _collect(proc: subprocess.Popen, status_fd: int, deadline: float, keep: int):
    """Read stdout, stderr and bubblewrap's JSON status until the process ends or ``deadline`` passes
    (then kill it); keep the first ``keep`` bytes of each stream."""
    sel = selectors.DefaultSelector()
    bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray(), status_fd: bytearray()}
    for fd in bufs:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    timed_out = truncated = False
    while sel.get_map():
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            proc.kill()   # bubblewrap; its PID namespace (every process in the sandbox) dies with it
            break
        for key, _ in sel.select(timeout=min(left, 1.0)):
            try:
                chunk = os.read(key.fd, 65536)
            except BlockingIOError:
                continue
            if not chunk:
                sel.unregister(key.fd)
                continue
            buf = bufs[key.fd]
            room = keep - len(buf) if key.fd != status_fd else len(chunk)
            truncated |= room < len(chunk)
            buf += chunk[:max(room, 0)]
    sel.close()
    proc.wait()
    if timed_out:   # what the status pipe holds already (the child's pid was written at its start)
        try:
            bufs[status_fd] += os.read(status_fd, 65536)
        except (BlockingIOError, OSError):
            pass
    status = {}
    decoder, text, i = json.JSONDecoder(), bufs[status_fd].decode(errors="replace"), 0
    while i < len(text):
        if text[i].isspace():
            i += 1
            continue
        try:
            doc, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            break
        if isinstance(doc, dict):
            status.update(doc)
    return bytes(bufs[proc.stdout.fileno()]), bytes(bufs[proc.stderr.fileno()]), status, timed_out, truncated


if __name__ == "__main__":   # python examples/sandbox/sandbox.py ['PROGRAM']: check the sandbox, run a program
    import sys

    try:
        box = Sandbox(SandboxConfig.from_env())
        box.check()
        print(json.dumps(dataclasses.asdict(box.run(sys.argv[1] if len(sys.argv) > 1 else "print('sandbox ok')"))))
    except (SandboxUnavailable, ValueError) as e:
        sys.exit(f"sandbox unavailable: {e}")
