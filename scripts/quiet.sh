#!/usr/bin/env bash
# Run a timing command on a quieter machine: pause this project's background training runs (SIGSTOP to every
# `drc_core.training.train` process), run the command, and resume them (SIGCONT) however the command ends.
#   scripts/quiet.sh .venv/bin/python bench/adaptive_speed.py --quick
# Other load (tests, browsers) is not paused: check `uptime` before trusting absolute timings.
set -uo pipefail
pids=$(pgrep -f "drc_core.training.train" || true)
resume() { [ -n "$pids" ] && kill -CONT $pids 2>/dev/null; }
trap resume EXIT INT TERM
[ -n "$pids" ] && kill -STOP $pids
echo "quiet.sh: paused training pids: ${pids:-none}; load $(cut -d' ' -f1-3 /proc/loadavg)" >&2
"$@"
