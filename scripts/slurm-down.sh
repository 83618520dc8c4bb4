#!/usr/bin/env bash
# Stop the single-node Slurm started by scripts/slurm-up.sh: slurmd, slurmctld,
# slurmdbd, MariaDB, munged.  Kills only the pids named in the daemons' own
# pidfiles; idempotent.  State (/var/spool/slurm*, /var/lib/mysql) is kept,
# so slurm-up.sh resumes with the same job ids and accounting history.
set -uo pipefail

stop() { # name pidfile
  local pid
  pid=$(cat "$2" 2>/dev/null) || return 0
  [ "$(cat /proc/"$pid"/comm 2>/dev/null)" = "$1" ] || { rm -f "$2"; return 0; }
  echo "slurm-down: stopping $1 ($pid)"
  kill "$pid"
  for _ in $(seq 150); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
  kill -0 "$pid" 2>/dev/null && { echo "slurm-down: $1 hangs, SIGKILL"; kill -9 "$pid"; }
  rm -f "$2"
}
# Node daemon first (so it does not retry a vanished controller), the
# database last (slurmctld/slurmdbd flush to it when stopping).
stop slurmd /run/slurmd.pid
stop slurmctld /run/slurmctld.pid
stop slurmdbd /run/slurmdbd.pid
stop mariadbd /run/mysqld/mysqld.pid
stop munged /run/munge/munged.pid
echo "slurm-down: done"
