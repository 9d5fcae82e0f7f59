#!/usr/bin/env bash
# A throw-away one-node SLURM cluster on this machine, for the tests of tests/slurm/ (issue 4).
#
#   bash tests/slurm/cluster.sh start     install if missing, configure, start, wait until the node is idle
#   eval "$(bash tests/slurm/cluster.sh env)"   export SLURM_CONF, which sbatch/squeue/scontrol need
#   bash tests/slurm/cluster.sh status    sinfo and squeue; exit 1 when the cluster is not up
#   bash tests/slurm/cluster.sh stop      cancel its jobs, then stop the daemons that `start` started
#
# Debian's slurm (22.05, packages slurm-wlm slurmctld slurmd slurm-client) and munge, run as root with
# no systemd and no cgroups: munged, slurmctld and slurmd run in the foreground under setsid, with their
# config, munge key and socket, spool, logs and PIDs all in one state directory. `start` is idempotent
# (a running cluster is left alone) and always begins from a fresh state directory otherwise, so no job
# state survives from an earlier run. Each daemon's PID is recorded with its /proc starttime; `stop`
# signals only those processes (a recycled PID is never signalled, nothing is killed by name).
#
# Settings that matter for the tests (measured; see shared/slurm/REPORT.md):
#   cred_expire=5     a requeued job is held until now + cred_expire + 1 s; the default (120) holds it
#                     for ~2 minutes, 5 is the smallest value slurm accepts
#   bf_interval=1, sched_interval=2   the held job starts a second or so after that, not at the next
#                     default pass (30 s, 60 s): `scontrol requeue` -> restart takes about 7 s
#   KillWait          seconds between SIGTERM and SIGKILL on scancel, time limit or requeue
#   proctrack/pgid, task/none   no cgroups needed; pgid also kills a child orphaned by its batch shell
#   CR_CPU, config_overrides    the node advertises CPUs=$TRAINFSM_SLURM_CPUS whatever nproc says
#
# Environment:
#   TRAINFSM_SLURM_DIR       state directory                                  [/tmp/trainfsm-slurm]
#   TRAINFSM_SLURM_CPUS      CPUs of the default partition, debug             [4]
#   TRAINFSM_SLURM_KILLWAIT  KillWait, in seconds                             [10]
#   TRAINFSM_SLURM_PORT      slurmctld's port; slurmd uses the next one       [6817]
#   TRAINFSM_SLURM_TIMEOUT   seconds `start` waits for the node to be idle    [60]
#   TRAINFSM_SLURM_GRACE     GraceTime of the preemptible partitions, seconds [30]
#   TRAINFSM_SLURM_USER_SIGNAL  1: SlurmctldParameters=preempt_send_user_signal [0]
#
# Preemption (issue 47): PreemptType=preempt/partition_prio. A job in `high` (PriorityTier=2, never
# preempted) that needs CPUs a job of a lower tier holds preempts it:
#   low          PreemptMode=REQUEUE GraceTime=$TRAINFSM_SLURM_GRACE
#   low-cancel   PreemptMode=CANCEL  GraceTime=$TRAINFSM_SLURM_GRACE
#   low-nograce  PreemptMode=REQUEUE GraceTime=0
#   debug        the default partition, PreemptMode=OFF: the other tests' jobs are never preempted
# The node advertises TRAINFSM_SLURM_CPUS + 6 CPUs; debug's jobs may use TRAINFSM_SLURM_CPUS of them, the
# other partitions' 6 (MaxCPUsPerNode). A preemption test's low job asks for 5 CPUs and its high job
# for 6: the high job fits only once the low one is gone, whatever the debug jobs use meanwhile.
# Without preempt_send_user_signal SLURM signals a preempted job's steps only (SIGCONT+SIGTERM) at
# the start of its grace time, and the batch script (an `exec python` job) nothing until the grace
# time is over; with it, the job's --signal too, at once. `bash cluster.sh user-signal on|off`
# changes it on a running cluster (slurm.conf, then `scontrol reconfigure`).
set -euo pipefail

S=${TRAINFSM_SLURM_DIR:-/tmp/trainfsm-slurm}
CPUS=${TRAINFSM_SLURM_CPUS:-4}
KILLWAIT=${TRAINFSM_SLURM_KILLWAIT:-10}
PORT=${TRAINFSM_SLURM_PORT:-6817}
TIMEOUT=${TRAINFSM_SLURM_TIMEOUT:-60}
GRACE=${TRAINFSM_SLURM_GRACE:-30}
USER_SIGNAL=${TRAINFSM_SLURM_USER_SIGNAL:-0}
CONF=$S/etc/slurm.conf
SOCK=$S/munge/munge.sock
NODE=$(hostname -s 2>/dev/null || cat /proc/sys/kernel/hostname)
DAEMONS=(munged slurmctld slurmd)  # in start order
export PATH=$PATH:/usr/sbin:/sbin  # the daemons live in sbin, which a non-login PATH may lack

log() { printf 'cluster.sh %s: %s\n' "$(date +%T)" "$*" >&2; }
T0=$(date +%s.%N)
elapsed() { awk -v a="$T0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }
field() { awk -v n="$2" '{ print $n }' "/proc/$1/stat" 2>/dev/null; }  # field of /proc/PID/stat; 3 state, 22 starttime

# pid_of NAME: print the PID recorded in run/NAME.pid if that very process still runs (same starttime;
# a zombie, which PID 1 may take seconds to reap, counts as gone).
pid_of() {
  local pid start
  read -r pid start 2>/dev/null <"$S/run/$1.pid" || return 1
  [ -n "$pid" ] && [ -n "$start" ] && [ "$(field "$pid" 22)" = "$start" ] && [ "$(field "$pid" 3)" != Z ] || return 1
  echo "$pid"
}
alive() { pid_of "$1" >/dev/null; }
up() { alive munged && alive slurmctld && alive slurmd && SLURM_CONF=$CONF timeout 10 sinfo -h >/dev/null 2>&1; }

usage() {
  cat <<EOF
SLURM is up: node $NODE, $((CPUS + 6)) CPUs, partitions debug ($CPUS CPUs), low, low-cancel, low-nograce, high (state directory $S).
  export SLURM_CONF=$CONF    # or: eval "\$(bash $0 env)"
  sbatch --parsable job.sh; squeue; scontrol show job JOBID
  logs: $S/log/    stop: bash $0 stop
EOF
}

install_if_missing() {
  local missing=0 cmd
  for cmd in slurmctld slurmd sbatch scontrol munged mungekey; do command -v "$cmd" >/dev/null || missing=1; done
  [ "$missing" = 1 ] || return 0
  local pkgs=(slurm-wlm slurmctld slurmd slurm-client munge) apt_log=$S/apt.log policy=/usr/sbin/policy-rc.d
  command -v apt-get >/dev/null || { log "slurm is not installed and there is no apt-get"; return 1; }
  log "installing ${pkgs[*]} (apt-get; log in $apt_log)"
  # A policy-rc.d that says 101 keeps the packages' postinst from starting system daemons (Docker
  # images ship one; add it for the install only where there is none).
  local own_policy=0
  if [ ! -e "$policy" ]; then printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 755 "$policy" && own_policy=1; fi
  local rc=0
  {
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q || log "apt-get update failed; trying the install with the lists there are"
    apt-get install -y -q --no-install-recommends -o Dpkg::Options::=--force-confdef \
      -o Dpkg::Options::=--force-confold "${pkgs[@]}"
  } </dev/null >"$apt_log" 2>&1 || rc=$?
  [ "$own_policy" = 0 ] || rm -f "$policy"
  if [ "$rc" != 0 ]; then log "apt-get failed (rc $rc):" && tail -n 20 "$apt_log" >&2; return 1; fi
  log "installed in $(elapsed)s"
}

write_config() {
  rm -rf "$S/etc" "$S/spool" "$S/run" "$S/log" "$S/munge"
  mkdir -p "$S/etc" "$S/spool/ctld" "$S/spool/d" "$S/run" "$S/log" "$S/munge"
  chmod 755 "$S" "$S/munge"  # munged refuses a socket directory that is not o+x
  mungekey --create --keyfile="$S/munge/munge.key" 2>/dev/null \
    || dd if=/dev/urandom of="$S/munge/munge.key" bs=1024 count=1 status=none
  chmod 400 "$S/munge/munge.key"
  : >"$S/etc/plugstack.conf"
  local mem_mb
  mem_mb=$(awk '/^MemTotal:/ { printf "%d", $2 / 1024 * 0.9 }' /proc/meminfo)
  cat >"$CONF" <<EOF
# Written by tests/slurm/cluster.sh; regenerated by every start.
ClusterName=trainfsm
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire also holds a requeued job: BeginTime = now + cred_expire + 1 (5 is the minimum)
AuthInfo=socket=$SOCK,cred_expire=5
StateSaveLocation=$S/spool/ctld
SlurmdSpoolDir=$S/spool/d
SlurmctldPidFile=$S/run/slurmctld.daemon.pid
SlurmdPidFile=$S/run/slurmd.daemon.pid
SlurmctldLogFile=$S/log/slurmctld.log
SlurmdLogFile=$S/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
PlugStackConfig=$S/etc/plugstack.conf
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=2
SlurmdParameters=config_overrides
ReturnToService=2
# batch jobs may be requeued (scontrol requeue, --requeue); a test session never has 1000 job records
JobRequeue=1
MaxJobCount=1000
KillWait=$KILLWAIT
# no accounting, so sacct does not work: scontrol show job keeps finished jobs for MinJobAge seconds
MinJobAge=300
InactiveLimit=0
Waittime=0
SlurmctldTimeout=30
SlurmdTimeout=30
# Preemption by partition priority: see the header. GraceTime, PreemptMode are per partition.
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
$(user_signal_line "$USER_SIGNAL")
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$((CPUS + 6)) RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP PreemptMode=OFF MaxCPUsPerNode=$CPUS
PartitionName=low Nodes=ALL MaxTime=INFINITE State=UP MaxCPUsPerNode=6 PriorityTier=1 PreemptMode=REQUEUE GraceTime=$GRACE
PartitionName=low-cancel Nodes=ALL MaxTime=INFINITE State=UP MaxCPUsPerNode=6 PriorityTier=1 PreemptMode=CANCEL GraceTime=$GRACE
PartitionName=low-nograce Nodes=ALL MaxTime=INFINITE State=UP MaxCPUsPerNode=6 PriorityTier=1 PreemptMode=REQUEUE GraceTime=0
PartitionName=high Nodes=ALL MaxTime=INFINITE State=UP MaxCPUsPerNode=6 PriorityTier=2 PreemptMode=OFF
EOF
}

# user_signal_line 0|1: slurm.conf's line for SLURM 22.05's preempt_send_user_signal (a comment when 0).
user_signal_line() {
  if [ "$1" = 1 ]; then echo "SlurmctldParameters=preempt_send_user_signal"; else echo "#SlurmctldParameters="; fi
}

# user-signal on|off: preempt_send_user_signal on the running cluster (slurm.conf, then reconfigure).
cmd_user_signal() {
  local value
  case ${1:-} in on) value=1 ;; off) value=0 ;; *) log "usage: cluster.sh user-signal on|off" && exit 2 ;; esac
  up || { log "the cluster is not up"; exit 1; }
  sed -i "s/^#\\{0,1\\}SlurmctldParameters=.*/$(user_signal_line "$value")/" "$CONF"
  SLURM_CONF=$CONF timeout 30 scontrol reconfigure
  log "preempt_send_user_signal $1"
}

# start_daemon NAME CMD...: run CMD detached (own session; stdin, stdout and stderr on files, so no
# caller's pipe is held open) and record "PID STARTTIME" in run/NAME.pid. setsid execs in place here
# (a background child of a script is no process-group leader), so $! is the daemon itself.
start_daemon() {
  local name=$1 pid comm=""
  shift
  setsid "$@" </dev/null >"$S/log/$name.out" 2>&1 &
  pid=$!
  for _ in $(seq 100); do
    comm=$(cat "/proc/$pid/comm" 2>/dev/null || true)
    [ "$comm" = "$name" ] || [ ! -e "/proc/$pid" ] && break
    sleep 0.02
  done
  echo "$pid $(field "$pid" 22)" >"$S/run/$name.pid"
  [ "$comm" = "$name" ] || { log "$name ${comm:+is $comm, not a daemon}${comm:-exited at once} (PID $pid)"; return 1; }
}

# fail MESSAGE: print the message and the daemons' logs, stop what was started, repeat the message, exit 1.
fail() {
  log "$*"
  local f
  for f in "$S"/log/*; do
    [ -s "$f" ] && { echo "---- $f (last 20 lines)"; tail -n 20 "$f"; } >&2
  done
  log "stopping what was started"
  cmd_stop || true
  log "$* (logs in $S/log)"  # the reason again, last, for callers that show one line
  exit 1
}

port_busy() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

cmd_start() {
  [ "$(id -u)" = 0 ] || { log "must run as root (apt-get, and the daemons run as SlurmUser=root)"; exit 1; }
  if up; then log "already running"; usage; return 0; fi
  local d
  for d in "${DAEMONS[@]}"; do
    if alive "$d"; then log "a partial cluster is left over ($d runs): stopping it first"; cmd_stop; break; fi
  done
  mkdir -p "$S"
  install_if_missing || exit 1
  for d in "$PORT" "$((PORT + 1))"; do
    ! port_busy "$d" || { log "port $d is in use (another slurm?); set TRAINFSM_SLURM_PORT"; exit 1; }
  done
  write_config
  cd "$S"  # the daemons keep this as their working directory

  start_daemon munged munged -F --socket="$SOCK" --key-file="$S/munge/munge.key" \
    --pid-file="$S/run/munged.daemon.pid" --seed-file="$S/munge/munged.seed" --log-file="$S/log/munged.log" \
    || fail "munged did not start"
  local ok=0
  for _ in $(seq 100); do
    if munge -n -S "$SOCK" 2>/dev/null | unmunge -S "$SOCK" >/dev/null 2>&1; then ok=1 && break; fi
    sleep 0.1
  done
  [ "$ok" = 1 ] || fail "munged does not answer on $SOCK"
  start_daemon slurmctld slurmctld -D -f "$CONF" || fail "slurmctld did not start"
  start_daemon slurmd slurmd -D -f "$CONF" -N "$NODE" || fail "slurmd did not start"

  local state="" deadline=$((SECONDS + TIMEOUT))
  while [ "$SECONDS" -lt "$deadline" ]; do
    alive slurmctld || fail "slurmctld exited"
    alive slurmd || fail "slurmd exited"
    state=$(SLURM_CONF=$CONF timeout 10 sinfo -h -n "$NODE" -o %t 2>/dev/null || true)
    [ "$state" = idle ] && break
    sleep 0.2
  done
  [ "$state" = idle ] || fail "node $NODE is not idle after ${TIMEOUT}s (state '${state:-no answer}')"
  log "cluster up in $(elapsed)s"
  usage
}

cmd_stop() {
  export SLURM_CONF=$CONF
  # 1. Cancel the jobs and wait until they are gone: killing slurmd would leave their slurmstepd running.
  if alive slurmctld && ! alive slurmd; then
    log "slurmd is gone: its jobs cannot be cancelled, their slurmstepd processes may be left running"
  elif alive slurmctld; then
    local jobs
    jobs=$(timeout 10 squeue -h -o %i 2>/dev/null | tr '\n' ' ' || true)
    if [ -n "${jobs// /}" ]; then
      log "cancelling jobs $jobs"
      # shellcheck disable=SC2086  # one argument per job id
      timeout 10 scancel $jobs 2>/dev/null || true
      local deadline=$((SECONDS + KILLWAIT + 20))
      while [ -n "$(timeout 10 squeue -h -o %i 2>/dev/null || true)" ] && [ "$SECONDS" -lt "$deadline" ]; do
        sleep 0.2
      done
      jobs=$(timeout 10 squeue -h -o '%i %T' 2>/dev/null || true)
      [ -z "$jobs" ] || log "jobs still there, their processes may outlive slurmd: $(echo $jobs)"
    fi
  fi
  # 2. SIGTERM each recorded daemon, the last started first; SIGKILL after 10 s.
  local i d pid
  for ((i = ${#DAEMONS[@]} - 1; i >= 0; i--)); do
    d=${DAEMONS[i]}
    pid=$(pid_of "$d") || continue
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 100); do alive "$d" || break; sleep 0.1; done
    if alive "$d"; then log "$d ($pid) ignored SIGTERM: SIGKILL" && kill -KILL "$pid" 2>/dev/null || true; fi
    log "$d ($pid) stopped"
  done
  rm -f "$S"/run/*.pid
}

cmd_status() {
  local d pid rc=0
  for d in "${DAEMONS[@]}"; do
    if pid=$(pid_of "$d"); then echo "$d: running (PID $pid)"; else echo "$d: not running" && rc=1; fi
  done
  [ "$rc" = 0 ] || return 1
  export SLURM_CONF=$CONF
  timeout 10 sinfo && timeout 10 squeue
}

case ${1:-} in
  start) cmd_start ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  user-signal) cmd_user_signal "${2:-}" ;;
  env) printf 'export SLURM_CONF=%q\n' "$CONF" ;;
  *) sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//' >&2 && exit 2 ;;
esac
