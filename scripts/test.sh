#!/usr/bin/env bash
# Set everything up, then run the whole test suite (real collector, real vLLM, tiny model).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# headless Chromium for the web UI's browser tests: Debian's package, never a downloaded browser
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  SUDO=""
  if [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1; then SUDO="sudo"; fi
  echo "setup: installing Debian's chromium (browser tests of the web UI)"
  { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends chromium >/dev/null; } \
    || echo "setup: could not install chromium; the browser tests will be skipped"
fi
# bubblewrap (and prlimit) for examples/sandbox: Debian's packages where missing, its tests skip otherwise
bash examples/sandbox/setup.sh
# a Java runtime for examples/scienceworld's game engine: Debian's default-jre-headless where missing
bash examples/scienceworld/setup.sh
exec .venv/bin/python -m pytest "$@"
