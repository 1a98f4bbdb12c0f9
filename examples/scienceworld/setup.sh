#!/usr/bin/env bash
# The ScienceWorld example's system package: a Java runtime for the game's engine (a jar inside the
# scienceworld wheel, started by py4j): Debian's default-jre-headless, installed with apt-get where no
# `java` is on PATH; a clear message where it cannot be (the example's tests are then skipped).
set -uo pipefail
if ! command -v java >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=""
    if [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1; then SUDO="sudo"; fi
    echo "setup: installing Debian's default-jre-headless (examples/scienceworld)"
    { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends default-jre-headless >/dev/null; } \
      || echo "setup: could not install default-jre-headless; examples/scienceworld and its tests will be skipped"
  else
    echo "setup: no apt-get; install a Java runtime (8 or later) by hand, or examples/scienceworld's tests will be skipped"
  fi
fi
# the game itself: start the engine once and load a task (the wheel comes from the 'scienceworld' extra)
python="$(dirname "$0")/../../.venv/bin/python"
[ -x "$python" ] || python=python3
if command -v java >/dev/null 2>&1 && ! "$python" -c '
from scienceworld import ScienceWorldEnv
env = ScienceWorldEnv("")
env.load("find-non-living-thing", 0, "easy")
env.close()' >/dev/null 2>&1; then
  echo "setup: the ScienceWorld engine does not start here (pip install -e '.[scienceworld]'?); examples/scienceworld's tests will be skipped"
fi
exit 0
