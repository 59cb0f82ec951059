#!/usr/bin/env bash
# A real Slurm cluster on one machine, for tests and for trying oobleck_hpc without a cluster.
#
#   slurm/dev-cluster.sh up            install (apt, once) and start: munged, mariadb, slurmdbd,
#                                      slurmctld and four slurmd (nodes n1..n4); idempotent: starts
#                                      only what is not running (so `up` also revives a killed node)
#   slurm/dev-cluster.sh down          cancel all jobs, stop every daemon this script started (pid files)
#   slurm/dev-cluster.sh status        daemons, nodes (sinfo) and jobs (squeue)
#   slurm/dev-cluster.sh env           print `export SLURM_CONF=...` (use: eval "$(... env)")
#   slurm/dev-cluster.sh kill-node N.. simulate the death of node N (or of several at the same
#                                      moment): SIGKILL its slurmd and every process of the job
#                                      steps running on it
#   slurm/dev-cluster.sh freeze-node N SIGSTOP the same set (a hung node); thaw-node N: SIGCONT
#   slurm/dev-cluster.sh pids N        the pids kill-node/freeze-node would signal
#
# Everything lives under one directory, $OOBLECK_SLURM_DIR (default slurm/.cluster, git-ignored):
# configuration, munge key and socket, database, spool, state, logs and pid files. Nothing is
# written to /etc and no systemd unit is used; clients find the cluster through SLURM_CONF.
#
# How four "nodes" share one host (Debian's slurm-wlm 22.05 supports it): every node has
# NodeAddr=127.0.0.1 and its own slurmd port, and is started as `slurmd -N nX` with per-node spool,
# pid and log files (%n). SlurmdParameters=config_overrides lets a node declare more CPUs than the
# host has; proctrack/linuxproc and task/none need no cgroups. SlurmdTimeout=5/MessageTimeout=2
# make the controller mark a dead node DOWN in ~10 s (defaults: ~20 s). cred_expire=10 lets a
# requeued job start again after 10 s instead of 120 s. slurmdbd + mariadb provide sacct, which
# submitit needs to see a job that ended without writing its result.
#
# A node "dies" by kill-node: its slurmd, its slurmstepd processes and all their tasks are
# SIGSTOPped, then SIGKILLed descendants first (none of them runs between the first kill and the
# last, and the kernel wakes none of them: see cmd_kill_node). The step
# processes are found with `scontrol listpids '*' N` (the pids the node's slurmstepds track)
# plus their slurmstepd parents. Only pids found this way, and daemons
# listed in our pid files, are ever signalled.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
D="${OOBLECK_SLURM_DIR:-$ROOT/slurm/.cluster}"
NODES=(n1 n2 n3 n4)
CPUS_PER_NODE="${OOBLECK_SLURM_CPUS:-4}"   # 2-3 workers + the agent per node
CTLD_PORT=16817
DBD_PORT=16819
DB_PORT=16306
SLURMD_PORT0=17001                        # n1 -> 17001 ... n4 -> 17004
HOST="$(hostname -s)"
MUNGE_SOCKET="$D/munge/munge.socket.2"
export SLURM_CONF="$D/etc/slurm.conf"
export PATH="$PATH:/usr/sbin:/sbin"       # the daemons live there; a non-login shell may lack it

log() { echo "dev-cluster: $*" >&2; }
die() { log "error: $*"; exit 1; }

# ------------------------------------------------------------------------------------------ install
install_packages() {
    local missing=()
    command -v slurmctld >/dev/null || missing+=(slurm-wlm)
    command -v munged >/dev/null || missing+=(munge)
    command -v slurmdbd >/dev/null || missing+=(slurmdbd)
    command -v mariadbd >/dev/null || missing+=(mariadb-server)
    # libpmix2: Slurm's PMIx plugin (srun --mpi=pmix) for MPI libraries that speak PMIx.
    [ -e /usr/lib/x86_64-linux-gnu/libpmix.so.2 ] || [ "$(uname -m)" != x86_64 ] || missing+=(libpmix2)
    if [ ${#missing[@]} -gt 0 ]; then
        [ "$(id -u)" = 0 ] || die "packages ${missing[*]} are missing; install them as root: apt-get install -y --no-install-recommends ${missing[*]}"
        log "installing ${missing[*]} (apt, ~15 s)"
        DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            "${missing[@]}" >/dev/null
    fi
    # Slurm's PMIx plugin dlopens libpmix.so from Debian's pmix2 directory, which ships only
    # libpmix.so.2: without this link `srun --mpi=pmix` fails ("can not load PMIx library").
    local pmix=/usr/lib/x86_64-linux-gnu/pmix2/lib
    if [ -e "$pmix/libpmix.so.2" ] && [ ! -e "$pmix/libpmix.so" ] && [ "$(id -u)" = 0 ]; then
        ln -s libpmix.so.2 "$pmix/libpmix.so"
    fi
}

# ------------------------------------------------------------------------------------------ config
write_config() {
    mkdir -p "$D"/{etc,munge,run,log,state,db,tmp} "$D"/spool
    chmod 755 "$D" "$D/munge"   # munged refuses a socket directory writable by others
    for n in "${NODES[@]}"; do mkdir -p "$D/spool/$n" "$D/tmp/$n"; done
    if [ ! -s "$D/munge/munge.key" ]; then
        dd if=/dev/urandom of="$D/munge/munge.key" bs=1024 count=1 status=none
        chmod 600 "$D/munge/munge.key"
    fi
    local last=$((SLURMD_PORT0 + ${#NODES[@]} - 1)) n_first="${NODES[0]#n}" n_last="${NODES[-1]#n}"
    cat >"$D/etc/slurm.conf" <<EOF
# Generated by slurm/dev-cluster.sh -- a one-host development cluster. Do not copy to production.
ClusterName=oobleck
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE_SOCKET,cred_expire=10
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool/%n
SlurmctldPidFile=$D/run/slurmctld.pid
SlurmdPidFile=$D/run/slurmd-%n.pid
SlurmctldLogFile=$D/log/slurmctld.log
SlurmdLogFile=$D/log/slurmd-%n.log
TmpFS=$D/tmp/%n
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
SlurmdTimeout=5
MessageTimeout=2
KillWait=5
InactiveLimit=0
MinJobAge=300
JobRequeue=1
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$DBD_PORT
# slurmctld -> slurmdbd authenticates with this munge socket (AuthInfo's socket is not used there)
AccountingStoragePass=$MUNGE_SOCKET
NodeName=n[$n_first-$n_last] NodeAddr=127.0.0.1 Port=[$SLURMD_PORT0-$last] CPUs=$CPUS_PER_NODE RealMemory=2048 State=UNKNOWN
PartitionName=debug Nodes=n[$n_first-$n_last] Default=YES MaxTime=INFINITE State=UP
EOF
    cat >"$D/etc/slurmdbd.conf" <<EOF
# Generated by slurm/dev-cluster.sh
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCKET
DbdHost=$HOST
DbdAddr=127.0.0.1
DbdPort=$DBD_PORT
SlurmUser=root
PidFile=$D/run/slurmdbd.pid
LogFile=$D/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=root
StorageLoc=oobleck_slurm_acct
EOF
    chmod 600 "$D/etc/slurmdbd.conf"
}

# ------------------------------------------------------------------------------------------ daemons
alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

wait_for() {  # wait_for SECONDS WHAT CMD...
    local deadline=$((SECONDS + $1)) what=$2; shift 2
    until "$@" >/dev/null 2>&1; do
        [ $SECONDS -lt $deadline ] || die "$what did not come up; see $D/log/"
        sleep 0.2
    done
}

start_munge() {
    alive "$D/run/munged.pid" && return
    munged --force --socket="$MUNGE_SOCKET" --key-file="$D/munge/munge.key" \
        --pid-file="$D/run/munged.pid" --log-file="$D/log/munged.log" \
        --seed-file="$D/munge/munged.seed"
    wait_for 10 munged munge -n -S "$MUNGE_SOCKET"
}

start_db() {
    alive "$D/run/mariadb.pid" && return
    if [ ! -d "$D/db/mysql" ]; then
        mariadb-install-db --no-defaults --datadir="$D/db" --user=root --skip-test-db \
            --auth-root-authentication-method=normal >"$D/log/mariadb-install.log" 2>&1 \
            || die "mariadb-install-db failed; see $D/log/mariadb-install.log"
    fi
    # Grant tables are skipped: the database listens on 127.0.0.1 only and holds only this
    # dev cluster's accounting.
    setsid mariadbd --no-defaults --datadir="$D/db" --user=root --skip-grant-tables \
        --bind-address=127.0.0.1 --port=$DB_PORT --socket="$D/run/mariadb.sock" \
        --pid-file="$D/run/mariadb.pid" --log-error="$D/log/mariadb.log" \
        </dev/null >/dev/null 2>&1 &
    wait_for 30 mariadb mariadb-admin --no-defaults --protocol=tcp -h 127.0.0.1 -P $DB_PORT -u root ping
}

start_slurmdbd() {
    alive "$D/run/slurmdbd.pid" && return
    SLURM_CONF="$D/etc/slurm.conf" slurmdbd
    wait_for 30 slurmdbd bash -c "exec 3<>/dev/tcp/127.0.0.1/$DBD_PORT"
}

start_slurmctld() {
    alive "$D/run/slurmctld.pid" && return
    slurmctld -f "$SLURM_CONF"
    wait_for 20 slurmctld scontrol ping
}

start_slurmd() {
    local n=$1
    alive "$D/run/slurmd-$n.pid" && return
    slurmd -f "$SLURM_CONF" -N "$n"
}

all_nodes_up() {
    local states
    states="$(sinfo -h -N -o '%N %t' 2>/dev/null)" || return 1
    [ "$(grep -cE ' (idle|mix|alloc)$' <<<"$states")" -eq ${#NODES[@]} ]
}

cmd_up() {
    install_packages
    write_config
    start_munge
    start_db
    start_slurmdbd
    start_slurmctld
    for n in "${NODES[@]}"; do start_slurmd "$n"; done
    wait_for 60 "the ${#NODES[@]} nodes" all_nodes_up
    log "up: ${#NODES[@]} nodes; export SLURM_CONF=$SLURM_CONF"
}

stop_pidfile() {  # stop_pidfile NAME: SIGTERM, wait up to 10 s, then SIGKILL
    local f="$D/run/$1.pid" pid
    [ -s "$f" ] || return 0
    pid="$(cat "$f")"
    if kill -0 "$pid" 2>/dev/null; then
        kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
        kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null || true
    fi
    rm -f "$f"
}

cmd_down() {
    [ -d "$D" ] || return 0
    # Cancel every job first: a --requeue job recovered by the next `up` would run again.
    if alive "$D/run/slurmctld.pid"; then
        local jobs; jobs="$(squeue -h -o %i 2>/dev/null | tr '\n' ' ')"
        [ -z "${jobs// /}" ] || scancel $jobs 2>/dev/null || true
    fi
    # Job steps first (their tasks are not daemons and hold no pid file), then the daemons.
    for n in "${NODES[@]}"; do
        if alive "$D/run/slurmd-$n.pid"; then
            local pids; pids="$(node_step_pids "$n")"
            [ -z "$pids" ] || kill -KILL $pids 2>/dev/null || true
        fi
        [ -s "$D/run/frozen-$n.pids" ] && { kill -CONT $(cat "$D/run/frozen-$n.pids") 2>/dev/null || true; rm -f "$D/run/frozen-$n.pids"; }
        stop_pidfile "slurmd-$n"
    done
    stop_pidfile slurmctld
    stop_pidfile slurmdbd
    stop_pidfile mariadb
    stop_pidfile munged
    log "down"
}

cmd_status() {
    for f in munged mariadb slurmdbd slurmctld "${NODES[@]/#/slurmd-}"; do
        if alive "$D/run/$f.pid"; then echo "$f: running (pid $(cat "$D/run/$f.pid"))"
        else echo "$f: stopped"; fi
    done
    if alive "$D/run/slurmctld.pid"; then sinfo -N; squeue; fi
}

# ------------------------------------------------------------------------------------------ faults
node_step_pids() {  # pids of every job-step process on node $1, plus their slurmstepd parents
    local n=$1 pids ppid comm
    pids="$(scontrol listpids '*' "$n" 2>/dev/null | awk 'NR > 1 && $1 ~ /^[0-9]+$/ {print $1}')" || true
    local out=()
    for p in $pids; do
        out+=("$p")
        ppid="$(awk '{print $4}' "/proc/$p/stat" 2>/dev/null)" || continue
        comm="$(cat "/proc/$ppid/comm" 2>/dev/null)" || continue
        [ "$comm" = slurmstepd ] && out+=("$ppid")
    done
    # slurmstepds of steps with no task left: the ones holding a socket in the node's spool dir
    local inodes=" " s inode
    for s in "$D/spool/$n"/*_*.*; do
        [ -S "$s" ] || continue
        inode="$(awk -v path="$s" '$NF == path {print $7}' /proc/net/unix | head -1)"
        [ -n "$inode" ] && inodes+="socket:[$inode] "
    done
    if [ "$inodes" != " " ]; then
        for p in $(grep -lx slurmstepd /proc/[0-9]*/comm 2>/dev/null | cut -d/ -f3); do
            for fd in /proc/"$p"/fd/*; do
                [[ "$inodes" == *" $(readlink "$fd" 2>/dev/null) "* ]] && { out+=("$p"); break; }
            done
        done
    fi
    # Never this script, its caller or init (a guard: these are not step processes anyway).
    printf '%s\n' "${out[@]}" | sort -un | awk -v me=$$ -v parent=$PPID \
        '$1 > 1 && $1 != me && $1 != parent' | tr '\n' ' '
}

deepest_first() {  # the pids given, descendants before their ancestors (depth in the process tree)
    local p q depth
    for p in "$@"; do
        depth=0 q=$p
        # /proc/PID/stat: "pid (comm) state ppid ..."; comm may hold spaces
        while [ "$q" -gt 1 ] 2>/dev/null && q="$(sed 's/.*) [A-Za-z] //; s/ .*//' "/proc/$q/stat" 2>/dev/null)"; do
            depth=$((depth + 1))
        done
        echo "$depth $p"
    done | sort -k1,1nr | awk '{print $2}' | tr '\n' ' '
}

describe_pids() {  # "pid:comm@node" per pid (node: the process's SLURMD_NODENAME), for the logs
    local p comm node
    for p in "$@"; do
        comm="$(cat "/proc/$p/comm" 2>/dev/null)" || comm=gone
        node="$(tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | sed -n 's/^SLURMD_NODENAME=//p')"
        printf '%s:%s@%s ' "$p" "$comm" "${node:--}"
    done
}

check_node() {
    local n=$1
    [[ " ${NODES[*]} " == *" $n "* ]] || die "unknown node '$n'; nodes are: ${NODES[*]}"
    alive "$D/run/slurmd-$n.pid" || die "slurmd of $n is not running (start it: $0 up)"
}

cmd_kill_node() {  # one or more nodes, at the same moment
    local n pids="" t what
    for n in "$@"; do check_node "$n"; done
    for n in "$@"; do pids+=" $(node_step_pids "$n") $(cat "$D/run/slurmd-$n.pid")"; done
    what="$(describe_pids $pids)"
    t="$(date +%s.%N)"
    # Stop all, then kill all, descendants first: a node dies at once, nothing of it acts on the
    # others' deaths. Killed one by one while running, the batch host's srun saw its peers go and
    # cancelled the agents step on every node ("STEP J.1 ON n1 CANCELLED"). Killed while stopped
    # but parents first, the kernel woke it: a process group left orphaned with a stopped member
    # gets SIGHUP + SIGCONT (POSIX job control), and srun's SIGHUP handler ("forcing job
    # termination") had the controller SIGKILL the step on every node before srun's own SIGKILL
    # landed (1 run in 3 of the batch-node tests).
    kill -STOP $pids 2>/dev/null || true
    kill -KILL $(deepest_first $pids) 2>/dev/null || true
    for n in "$@"; do rm -f "$D/run/slurmd-$n.pid"; done
    log "killed $* at $t: $what"
}

cmd_freeze_node() {
    local n=$1; check_node "$n"
    local pids t; pids="$(node_step_pids "$n") $(cat "$D/run/slurmd-$n.pid")"
    echo "$pids" >"$D/run/frozen-$n.pids"
    t="$(date +%s.%N)"
    kill -STOP $pids 2>/dev/null || true
    log "froze $n at $t: pids $pids"
}

cmd_thaw_node() {
    local n=$1
    local f="$D/run/frozen-$n.pids"
    [ -s "$f" ] || die "$n is not frozen"
    kill -CONT $(cat "$f") 2>/dev/null || true
    rm -f "$f"
    log "thawed $n"
}

case "${1:-}" in
    up) cmd_up ;;
    down) cmd_down ;;
    status) cmd_status ;;
    env) echo "export SLURM_CONF=$SLURM_CONF" ;;
    kill-node) shift; cmd_kill_node "${@:?usage: $0 kill-node NODE [NODE...]}" ;;
    freeze-node) cmd_freeze_node "${2:?usage: $0 freeze-node NODE}" ;;
    thaw-node) cmd_thaw_node "${2:?usage: $0 thaw-node NODE}" ;;
    pids) check_node "${2:?usage: $0 pids NODE}"; node_step_pids "$2"; echo ;;
    *) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
