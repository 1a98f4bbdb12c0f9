#!/bin/sh
# every SECONDS COMMAND [ARGS...]: run COMMAND, then again SECONDS after it ends, for ever.
#
# For jobs that have no schedule of their own (`lightspan rollout`, `lightspan transitions build`;
# `lightspan train` has --mode every). A failing run ends the loop with its exit status, so the
# container's restart policy restarts it and `docker compose ps` shows the restarts. Each
# successful run touches $HEARTBEAT (default /tmp/lightspan-heartbeat): the health check reads
# its age.
set -eu
if [ "$#" -lt 2 ]; then
    echo "usage: every SECONDS COMMAND [ARGS...]" >&2
    exit 2
fi
interval="$1"
shift
heartbeat="${HEARTBEAT:-/tmp/lightspan-heartbeat}"
while :; do
    "$@"
    touch "$heartbeat"
    sleep "$interval"
done
