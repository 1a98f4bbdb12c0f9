#!/usr/bin/env bash
# The sandbox example's system packages: Debian's bubblewrap (the sandbox) and util-linux's prlimit (its
# limits), installed with apt-get where missing; a clear message where they cannot be (the tests skip).
set -uo pipefail
missing=()
command -v bwrap >/dev/null 2>&1 || missing+=(bubblewrap)
command -v prlimit >/dev/null 2>&1 || missing+=(util-linux)
if [ ${#missing[@]} -gt 0 ]; then
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=""
    if [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1; then SUDO="sudo"; fi
    echo "setup: installing Debian's ${missing[*]} (examples/sandbox)"
    { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; } \
      || echo "setup: could not install ${missing[*]}; examples/sandbox and its tests will be skipped"
  else
    echo "setup: no apt-get; install bubblewrap and prlimit by hand, or examples/sandbox's tests will be skipped"
  fi
fi
# a probe program in the sandbox: it needs unprivileged user namespaces (bubblewrap is not setuid on Debian)
python="$(dirname "$0")/../../.venv/bin/python"
[ -x "$python" ] || python=python3
if command -v bwrap >/dev/null 2>&1 && ! "$python" "$(dirname "$0")/sandbox.py" >/dev/null; then
  echo "setup: the sandbox cannot run here (above); examples/sandbox's tests will be skipped"
fi
exit 0
