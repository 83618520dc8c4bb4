#!/usr/bin/env bash
# Bring up a real single-node Slurm cluster on this machine for tests and CI:
# munged, (MariaDB + slurmdbd), slurmctld, slurmd, partition `debug`.
# Idempotent: a second run finds the daemons up, re-checks them, exits fast.
# Needs root.  No systemd is assumed (containers): daemons are started directly.
# Stop with scripts/slurm-down.sh.
#
# Accounting: by default a local MariaDB + slurmdbd run too, because submitit
# reads job states with `sacct`.  Without it sacct fails ("accounting storage
# is disabled"), job.state stays UNKNOWN, and job.result() hangs forever for a
# job that died without writing its result pickle (killed, OOM, timeout).
#
# Env: SLURM_UP_TIMEOUT   seconds to wait for each step (default 60)
#      SLURM_UP_ACCOUNTING=0   skip MariaDB/slurmdbd (sacct will not work)
#      SLURM_UP_SKIP_CHECK=1   skip the srun/sbatch smoke test
set -euo pipefail

CONF_DIR=/etc/slurm            # where Debian's slurm (>= 21) reads its config
LOG_DIR=/var/log/slurm
TIMEOUT=${SLURM_UP_TIMEOUT:-60}
ACCT=${SLURM_UP_ACCOUNTING:-1}
NODE=$(hostname -s)

say() { echo "slurm-up: $*"; }
die() {
  echo "slurm-up: ERROR: $*" >&2
  for f in "$LOG_DIR"/slurmctld.log "$LOG_DIR"/slurmd.log "$LOG_DIR"/slurmdbd.log \
           "$LOG_DIR"/mariadb.log /var/log/munge/munged.log; do
    [ -f "$f" ] && { echo "---- tail $f" >&2; tail -n 25 "$f" >&2; }
  done
  exit 1
}
# A daemon counts as running if its pidfile names a live, non-zombie process
# of that name (pidfiles outlive a killed daemon or a container restart).
running() { # name pidfile
  local pid
  pid=$(cat "$2" 2>/dev/null) || return 1
  [ -n "$pid" ] && [ "$(cat /proc/"$pid"/comm 2>/dev/null)" = "$1" ] \
    && ! grep -q '^State:.*Z' /proc/"$pid"/status 2>/dev/null
}
stop() { # name pidfile
  running "$1" "$2" || return 0
  say "stopping $1"; kill "$(cat "$2")"
  for _ in $(seq 100); do running "$1" "$2" || return 0; sleep 0.2; done
}
wait_for() { # description command...
  local what=$1; shift
  local end=$(( SECONDS + TIMEOUT ))
  while [ "$SECONDS" -lt "$end" ]; do "$@" >/dev/null 2>&1 && return 0; sleep 0.5; done
  die "$what not ready after ${TIMEOUT}s"
}
# Install $2 from temp file $1 (mode $3); remember whether anything changed.
CHANGED=0
put_conf() {
  if cmp -s "$1" "$2"; then rm -f "$1"; else mv "$1" "$2"; CHANGED=1; say "wrote $2"; fi
  chmod "$3" "$2"
}

[ "$(id -u)" = 0 ] || die "must run as root"
# Parallel callers (CI, xdist) queue up.  flock -o: the lock fd must not be
# inherited by the daemons, or they would hold the lock forever.
[ -n "${SLURM_UP_LOCKED:-}" ] || SLURM_UP_LOCKED=1 exec flock -o -w 300 /run/slurm-up.lock bash "$0" "$@"

# ---- 1. packages: apt-get update + install only when one is missing --------
PKGS="slurm-wlm munge"; [ "$ACCT" = 1 ] && PKGS="$PKGS slurmdbd mariadb-server"
for p in $PKGS; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed'; then
    say "installing $PKGS"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    # shellcheck disable=SC2086
    apt-get install -y -qq $PKGS >/dev/null || die "apt-get install $PKGS failed"
    break
  fi
done
say "$(slurmd -V)"
mkdir -p "$CONF_DIR" "$LOG_DIR" /var/spool/slurmctld /var/spool/slurmd

# ---- 2. munge: key with the perms munged insists on, then the daemon --------
mkdir -p /etc/munge /var/lib/munge /var/log/munge /run/munge
[ -s /etc/munge/munge.key ] || dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
chown -R munge:munge /etc/munge /var/lib/munge /var/log/munge /run/munge
chmod 700 /etc/munge /var/log/munge; chmod 400 /etc/munge/munge.key
chmod 755 /run/munge   # clients must reach the socket
if ! running munged /run/munge/munged.pid; then
  say "starting munged"
  rm -f /run/munge/munge.socket.2*   # a stale socket/lock stops munged
  runuser -u munge -- /usr/sbin/munged || die "munged failed to start"
fi
wait_for munge bash -c 'timeout 5 munge -n | timeout 5 unmunge'

# ---- 3. configs ---------------------------------------------------------------
CPUS=$(nproc)
MEM_TOTAL=$(free -m | awk '/^Mem:/{print $2}')
MEM=$(( MEM_TOTAL - MEM_TOTAL / 10 ))   # ~10% headroom for the OS
if [ "$ACCT" = 1 ]; then
  ACCT_CONF="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost"
  T=$(mktemp); cat >"$T" <<EOF
# Written by scripts/slurm-up.sh.  Local test DB, fixed password on purpose.
AuthType=auth/munge
DbdHost=localhost
DbdAddr=127.0.0.1
SlurmUser=root
LogFile=$LOG_DIR/slurmdbd.log
PidFile=/run/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
EOF
  put_conf "$T" $CONF_DIR/slurmdbd.conf 600   # slurmdbd refuses a readable one
else
  ACCT_CONF="AccountingStorageType=accounting_storage/none"
fi
T=$(mktemp); cat >"$T" <<EOF
# Written by scripts/slurm-up.sh -- single-node test cluster.
ClusterName=gnsweep
# 127.0.0.1 as address: the short hostname may not resolve in containers.
SlurmctldHost=$NODE(127.0.0.1)
# Daemons run as root: no ownership dance for spool dirs in containers.
SlurmUser=root
AuthType=auth/munge
# A requeued job waits cred_expire + 1 s before it may start again (default 120 s): 20 s is
# ample for a job step's credential on one node, and a requeue no longer idles two minutes.
AuthInfo=cred_expire=20
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
MailProg=/bin/true
# No cgroups in containers: track processes via /proc, no task binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
# Cores are the consumable resource: two 1-CPU jobs share a 2-core node.
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
$ACCT_CONF
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
# Node returns by itself after a restart; trust the CPUs/memory given below
# even if the container reports other hardware.
ReturnToService=2
SlurmdParameters=config_overrides
SlurmctldTimeout=30
SlurmdTimeout=60
InactiveLimit=0
KillWait=5
# Finished jobs stay visible in squeue/scontrol for 10 minutes.
MinJobAge=600
# Schedule pending jobs within ~2 s (the default main loop is 60 s).
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2,sched_min_interval=100000
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
put_conf "$T" $CONF_DIR/slurm.conf 644

# ---- 4. daemons (all Slurm daemons restart when a config changed) ------------
if [ "$CHANGED" = 1 ]; then
  stop slurmd /run/slurmd.pid; stop slurmctld /run/slurmctld.pid; stop slurmdbd /run/slurmdbd.pid
fi
if [ "$ACCT" = 1 ]; then
  if ! running mariadbd /run/mysqld/mysqld.pid; then
    say "starting mariadb"
    mkdir -p /run/mysqld; chown mysql:root /run/mysqld
    [ -d /var/lib/mysql/mysql ] || mariadb-install-db --user=mysql >/dev/null
    # lock wait timeout as slurmdbd recommends; setsid: detach from this shell
    setsid /usr/sbin/mariadbd --user=mysql --innodb-lock-wait-timeout=900 \
      </dev/null >>"$LOG_DIR"/mariadb.log 2>&1 &
  fi
  wait_for mariadb timeout 10 mariadb-admin ping
  mariadb -e "CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurm';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';" || die "mariadb setup failed"
  if ! running slurmdbd /run/slurmdbd.pid; then
    say "starting slurmdbd"; slurmdbd || die "slurmdbd failed to start"
  fi
  wait_for slurmdbd timeout 10 sacctmgr -n list cluster
fi
if ! running slurmctld /run/slurmctld.pid; then
  say "starting slurmctld"; slurmctld || die "slurmctld failed to start"
fi
wait_for slurmctld bash -c 'timeout 10 scontrol ping | grep -q UP'
if ! running slurmd /run/slurmd.pid; then
  say "starting slurmd"; slurmd || die "slurmd failed to start"
fi

# ---- 5. wait for the node to be usable ----------------------------------------
state=""; i=0; end=$(( SECONDS + TIMEOUT ))
while [ "$SECONDS" -lt "$end" ]; do
  i=$(( i + 1 ))
  state=$(sinfo -h -n "$NODE" -o %T 2>/dev/null | head -1)
  case "$state" in
    idle|mixed|allocated|completing) break ;;
    down*|drain*|fail*)   # e.g. stale state saved by an earlier run
      [ $(( i % 5 )) = 1 ] && scontrol update nodename="$NODE" state=resume 2>/dev/null || true ;;
  esac
  sleep 1
done
case "$state" in idle|mixed|allocated|completing) ;; *)
  die "node $NODE is '$state' after ${TIMEOUT}s: $(sinfo -h -R 2>/dev/null)" ;; esac
if [ "$ACCT" = 1 ]; then   # slurmctld registers the cluster in slurmdbd itself
  wait_for "cluster registration" bash -c 'sacctmgr -n -P list cluster format=cluster | grep -qx gnsweep'
fi
say "node $NODE is $state"

# ---- 6. smoke test: one interactive step and one batch job ----------------------
if [ "${SLURM_UP_SKIP_CHECK:-0}" != 1 ]; then
  out=$(timeout "$TIMEOUT" srun -N1 -n1 hostname 2>&1) || die "srun failed: $out"
  out=$(cd /tmp && timeout "$TIMEOUT" sbatch --wait -o /dev/null -J slurm-up-check --wrap true 2>&1) \
    || die "sbatch job failed: $out"
  say "srun and sbatch work"
fi
say "Slurm is up (partition debug, node $NODE, accounting=$ACCT)"
