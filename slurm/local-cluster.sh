#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, for tests and demos of `memfit sweep --launcher slurm`.
#
#   slurm/local-cluster.sh start    install (Debian slurmctld/slurmd 22.05) if missing, configure, start, wait idle
#   slurm/local-cluster.sh stop     cancel this cluster's jobs, stop both daemons by their PIDs
#   slurm/local-cluster.sh status   daemons, node state, queue
#   slurm/local-cluster.sh env      print `export SLURM_CONF=...` for client commands (sbatch, squeue, ...)
#   slurm/local-cluster.sh conf     print the slurm.conf and gres.conf that start would write (changes nothing)
#
# No munge and no systemd: AuthType=auth/none, CredType=cred/none, daemons run in the foreground (-D) in
# the background of this shell, everything (config, state, spool, logs, PIDs) lives under
# $MEMFIT_SLURM_DIR (default /tmp/memfit-slurm). Client commands find the config through SLURM_CONF; if
# /etc/slurm/slurm.conf does not exist it is linked to ours so that a bare `sinfo` works too.
# Start is idempotent (a running cluster is left as it is); the node gets this machine's CPUs and 90 %
# of its memory, and its GPUs as generic resources (GresTypes=gpu, Gres=gpu:N, gres.conf with one
# /dev/nvidiaI file per GPU) when nvidia-smi lists any, so sweeps that ask for GPUs (--gpus-per-task,
# --gres=gpu:N) are scheduled instead of rejected. MEMFIT_SLURM_GPUS=N overrides the count (0 = none).
set -euo pipefail

DIR="${MEMFIT_SLURM_DIR:-/tmp/memfit-slurm}"
CONF="$DIR/slurm.conf"
HOST="$(hostname -s)"
PARTITION="${MEMFIT_SLURM_PARTITION:-debug}"
export SLURM_CONF="$CONF"

log() { echo "local-cluster: $*" >&2; }

alive() {  # alive PIDFILE: the process recorded there is running
    [[ -f "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null
}

node_state() {
    timeout 5 sinfo -h -o %T 2>/dev/null | head -n1 || true
}

install_if_missing() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null; then
        return
    fi
    if [[ "$(id -u)" != 0 ]]; then
        log "slurmctld/slurmd/sbatch missing and not root: apt-get install -y slurmctld slurmd slurm-client"
        exit 1
    fi
    log "installing slurmctld slurmd slurm-client (apt-get)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurmctld slurmd slurm-client >/dev/null
}

gpu_count() {
    if [[ -n "${MEMFIT_SLURM_GPUS:-}" ]]; then
        echo "$MEMFIT_SLURM_GPUS"
    elif command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | grep -c . || true
    else
        echo 0
    fi
}

gres_conf() {  # gres_conf N: one line per GPU device file
    local i
    echo "# written by slurm/local-cluster.sh: this node's GPUs"
    for (( i = 0; i < $1; i++ )); do
        echo "NodeName=$HOST Name=gpu File=/dev/nvidia$i"
    done
}

slurm_conf() {  # slurm_conf CPUS MEM_MB GPUS
    local node_gres="" gres_types="# no GPUs: no generic resources"
    if (( $3 > 0 )); then
        gres_types="GresTypes=gpu"
        node_gres=" Gres=gpu:$3"
    fi
    cat <<EOF
# written by slurm/local-cluster.sh; one node, no munge, no accounting
ClusterName=memfit-local
SlurmctldHost=$HOST(127.0.0.1)
AuthType=auth/none
CredType=cred/none
SlurmUser=$(id -un)
SlurmdUser=root
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/run/slurmctld.daemon.pid
SlurmdPidFile=$DIR/run/slurmd.daemon.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
# a cancelled task's processes get SIGTERM, then SIGKILL after this many seconds
KillWait=5
$gres_types
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$1 RealMemory=$2$node_gres State=UNKNOWN
PartitionName=$PARTITION Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
}

node_resources() {  # CPUS MEM_MB GPUS of this machine
    # slurmd drains a node whose real memory is below the configured amount: leave a margin
    echo "$(nproc) $(free -m | awk '/^Mem:/ {print int($2 * 0.9)}') $(gpu_count)"
}

write_conf() {
    local cpus mem_mb gpus
    read -r cpus mem_mb gpus <<<"$(node_resources)"
    mkdir -p "$DIR/state" "$DIR/spool" "$DIR/log" "$DIR/run"
    slurm_conf "$cpus" "$mem_mb" "$gpus" >"$CONF"
    if (( gpus > 0 )); then
        gres_conf "$gpus" >"$(dirname "$CONF")/gres.conf"
    else
        rm -f "$(dirname "$CONF")/gres.conf"
    fi
    if [[ ! -e /etc/slurm/slurm.conf && -w /etc/slurm ]]; then
        ln -s "$CONF" /etc/slurm/slurm.conf
    fi
}

start() {
    install_if_missing
    if alive "$DIR/run/slurmctld.pid" && alive "$DIR/run/slurmd.pid"; then
        log "already running (config $CONF)"
    else
        # half-started leftovers: stop what is there before a clean start
        stop_daemons
        write_conf
        # -i: ignore saved state, every start is a fresh cluster
        nohup slurmctld -D -i -f "$CONF" >>"$DIR/log/slurmctld.out" 2>&1 &
        echo $! >"$DIR/run/slurmctld.pid"
        nohup slurmd -D -f "$CONF" >>"$DIR/log/slurmd.out" 2>&1 &
        echo $! >"$DIR/run/slurmd.pid"
    fi
    local state=""
    for _ in $(seq 1 120); do
        state="$(node_state)"
        if [[ "$state" == idle || "$state" == mixed || "$state" == allocated ]]; then
            log "node $HOST is $state (partition $PARTITION, $(nproc) CPUs); export SLURM_CONF=$CONF"
            return 0
        fi
        if ! alive "$DIR/run/slurmctld.pid" || ! alive "$DIR/run/slurmd.pid"; then
            break
        fi
        sleep 0.5
    done
    log "cluster did not come up (node state '${state}'); last log lines:"
    tail -n 20 "$DIR/log/slurmctld.log" "$DIR/log/slurmd.log" >&2 2>/dev/null || true
    exit 1
}

stop_daemons() {
    local name pidfile pid
    for name in slurmd slurmctld; do
        pidfile="$DIR/run/$name.pid"
        if alive "$pidfile"; then
            pid="$(cat "$pidfile")"
            kill "$pid" 2>/dev/null || true
            for _ in $(seq 1 40); do
                kill -0 "$pid" 2>/dev/null || break
                sleep 0.25
            done
            kill -0 "$pid" 2>/dev/null && kill -9 "$pid" 2>/dev/null || true
            log "stopped $name (pid $pid)"
        fi
        rm -f "$pidfile"
    done
}

stop() {
    if alive "$DIR/run/slurmctld.pid"; then
        # jobs of this cluster only; their processes are children of our slurmd's step daemons
        local jobs
        jobs="$(timeout 5 squeue -h -o %A 2>/dev/null || true)"
        if [[ -n "$jobs" ]]; then
            # shellcheck disable=SC2086
            timeout 10 scancel $jobs 2>/dev/null || true
            for _ in $(seq 1 40); do
                [[ -z "$(timeout 5 squeue -h -o %A 2>/dev/null || true)" ]] && break
                sleep 0.25
            done
        fi
    fi
    stop_daemons
}

status() {
    local name
    for name in slurmctld slurmd; do
        if alive "$DIR/run/$name.pid"; then
            echo "$name: running (pid $(cat "$DIR/run/$name.pid"))"
        else
            echo "$name: stopped"
        fi
    done
    if alive "$DIR/run/slurmctld.pid"; then
        timeout 5 sinfo || true
        timeout 5 squeue || true
    fi
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    status) status ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    conf)
        read -r cpus mem_mb gpus <<<"$(node_resources)"
        echo "# $CONF"
        slurm_conf "$cpus" "$mem_mb" "$gpus"
        if (( gpus > 0 )); then echo "# $(dirname "$CONF")/gres.conf"; gres_conf "$gpus"; fi
        ;;
    *) echo "usage: $0 start|stop|status|env|conf   (state under \$MEMFIT_SLURM_DIR, default /tmp/memfit-slurm)" >&2; exit 2 ;;
esac
