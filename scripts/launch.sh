#!/usr/bin/env bash
# Start `moeserve serve` as a rank group under OpenMPI's mpirun: one rank per GPU on one node, or
# G ranks on each node of a hostfile. Every argument this script does not know goes to
# `moeserve serve` unchanged, so the usual serving flags (--model-path, --port, --moe-a2a-backend,
# --no-load-balance, ...) work as they do for one process. Rank r listens on --port + r.
#
# What it adds to a bare `mpirun -np N moeserve serve ...`, and why:
#   --bind-to none (default) or numa: a rank's engine threads and its HTTP threads must not be
#       pinned to one core, which is what OpenMPI does by default for np <= 2;
#   -x for the variables that must be the same on every rank: OMP_NUM_THREADS and
#       OMP_WAIT_POLICY when set, every NCCL_* and MOESERVE_* set, NCCL_NVLS_ENABLE=0 (NVLink
#       multicast stays off), and PATH / LD_LIBRARY_PATH on several nodes so that remote ranks find
#       the same libraries;
#   on several nodes: --hostfile FILE --map-by ppr:G:node (G ranks on every node, ranks in node
#       order) and --host 0.0.0.0 unless a --host is given, so that peers on other nodes reach
#       each rank's HTTP port (load balancing relays requests between ranks);
#   on one node with more ranks than cores: --oversubscribe and mpi_yield_when_idle;
#   --allow-run-as-root when run as root;
#   a graceful shutdown: mpirun answers SIGTERM or SIGINT by killing its ranks a second later
#       (odls_base_sigkill_timeout), so it runs in a session of its own, out of reach of the
#       terminal's Ctrl-C, and this script passes SIGTERM / SIGINT on to the ranks on this node
#       instead: each drains (--shutdown-timeout), the ranks on other nodes drain with them, and
#       the exit status is mpirun's (0 after a clean drain).
set -euo pipefail

script_dir=$(cd "$(dirname "$0")" && pwd)
bin=${MOESERVE_BIN:-$(cd "$script_dir/.." && pwd)/build/moeserve}
mpirun=${MPIRUN:-mpirun}

usage() {
    cat <<'EOF'
usage: scripts/launch.sh [launch flags] [--] [moeserve serve flags]

Runs (or, with --dry-run, prints) the mpirun line of a moeserve rank group.

launch flags:
  --np N                ranks in all (one node: default one per GPU that nvidia-smi lists;
                        several nodes: GPUs per node x nodes in the hostfile)
  --hostfile FILE       several nodes: OpenMPI hostfile, one node per line ("host slots=8")
  --gpus-per-node G     ranks per node with --hostfile (default: GPUs on this node)
  --bind none|numa      CPU binding of the ranks (default none; numa keeps each rank's threads
                        and memory on one NUMA node)
  --mpi-arg ARG         one more argument for mpirun, as is (repeat it for more)
  --dry-run             print the command instead of running it
  -h, --help            this text

Everything else goes to `moeserve serve`: rank r serves HTTP on --port + r. The binary is
$MOESERVE_BIN, else build/moeserve beside this script; on several nodes it must exist at the
same path on every node, with the model folder.

examples:
  # one node, 8 GPUs, ranks on ports 30000..30007
  scripts/launch.sh -- --model-path /models/Qwen3-30B-A3B --port 30000
  # two nodes of 8 GPUs from a hostfile, 16 ranks, ports 30000..30015 (8 on each node)
  scripts/launch.sh --hostfile hosts.txt --gpus-per-node 8 -- --model-path /models/Qwen3-235B-A22B
  # a machine without GPU: 4 ranks sharing its cores
  scripts/launch.sh --np 4 --dry-run -- --model-path models/tiny-qwen3-moe --port 30000
EOF
}

die() {
    echo "launch.sh: $*" >&2
    exit 2
}

count_gpus() {
    if command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true
    else
        echo 0
    fi
}

np=
hostfile=
per_node=
bind=none
dry_run=0
mpi_args=()
serve_args=()
while [ $# -gt 0 ]; do
    case "$1" in
    --np | -np) [ $# -ge 2 ] || die "$1 needs a value"; np=$2; shift 2 ;;
    --np=*) np=${1#*=}; shift ;;
    --hostfile) [ $# -ge 2 ] || die "$1 needs a value"; hostfile=$2; shift 2 ;;
    --hostfile=*) hostfile=${1#*=}; shift ;;
    --gpus-per-node) [ $# -ge 2 ] || die "$1 needs a value"; per_node=$2; shift 2 ;;
    --gpus-per-node=*) per_node=${1#*=}; shift ;;
    --bind) [ $# -ge 2 ] || die "$1 needs a value"; bind=$2; shift 2 ;;
    --bind=*) bind=${1#*=}; shift ;;
    --mpi-arg) [ $# -ge 2 ] || die "$1 needs a value"; mpi_args+=("$2"); shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    -h | --help) usage; exit 0 ;;
    --) shift; serve_args+=("$@"); break ;;
    *) serve_args+=("$1"); shift ;;
    esac
done
# `launch.sh serve --model-path ...` reads like the binary's own command line
if [ ${#serve_args[@]} -gt 0 ] && [ "${serve_args[0]}" = serve ]; then serve_args=("${serve_args[@]:1}"); fi

is_count() { [[ $1 =~ ^[1-9][0-9]*$ ]]; }
[ -z "$np" ] || is_count "$np" || die "--np wants a positive integer, not '$np'"
[ -z "$per_node" ] || is_count "$per_node" || die "--gpus-per-node wants a positive integer, not '$per_node'"
case "$bind" in none | numa) ;; *) die "--bind wants none or numa, not '$bind'" ;; esac
if [ -n "$per_node" ] && [ -z "$hostfile" ]; then die "--gpus-per-node goes with --hostfile (one node: --np)"; fi
if [ $dry_run -eq 0 ]; then
    command -v "$mpirun" >/dev/null 2>&1 || die "$mpirun not found (apt-get install openmpi-bin)"
    [ -x "$bin" ] || die "$bin is not built (make), or set MOESERVE_BIN"
fi

cmd=("$mpirun")
[ "$(id -u)" -eq 0 ] && cmd+=(--allow-run-as-root)

if [ -n "$hostfile" ]; then
    [ -r "$hostfile" ] || die "cannot read the hostfile $hostfile"
    n_nodes=$(grep -cvE '^[[:space:]]*(#|$)' "$hostfile" || true)
    [ "$n_nodes" -gt 0 ] || die "no node in $hostfile"
    if [ -z "$per_node" ]; then
        per_node=$(count_gpus)
        [ "$per_node" -gt 0 ] || die "no GPU on this node (nvidia-smi): say how many ranks per node with --gpus-per-node G"
    fi
    [ -n "$np" ] || np=$((per_node * n_nodes))
    [ "$np" -le $((per_node * n_nodes)) ] || die "--np $np is more than $per_node ranks on each of $n_nodes nodes"
    cmd+=(--hostfile "$hostfile" --map-by "ppr:$per_node:node")
    has_host=0
    for a in "${serve_args[@]+"${serve_args[@]}"}"; do
        case "$a" in --host | --host=*) has_host=1 ;; esac
    done
    if [ $has_host -eq 0 ]; then
        serve_args=(--host 0.0.0.0 "${serve_args[@]+"${serve_args[@]}"}")
    fi
else
    if [ -z "$np" ]; then
        np=$(count_gpus)
        [ "$np" -gt 0 ] || die "no GPU found (nvidia-smi): say how many ranks with --np N"
    fi
    cores=$(nproc 2>/dev/null || echo 1)
    if [ "$np" -gt "$cores" ]; then
        cmd+=(--oversubscribe --mca mpi_yield_when_idle 1)
    fi
fi
cmd+=(-np "$np")

if [ "$bind" = numa ]; then
    # several nodes keep the ppr mapping above; one node spreads the ranks over its NUMA nodes
    [ -n "$hostfile" ] || cmd+=(--map-by numa)
    cmd+=(--bind-to numa)
else
    cmd+=(--bind-to none)
fi

for v in OMP_NUM_THREADS OMP_WAIT_POLICY; do
    [ -n "${!v:-}" ] && cmd+=(-x "$v")
done
while IFS= read -r v; do
    [ "$v" = NCCL_NVLS_ENABLE ] || cmd+=(-x "$v")
done < <(compgen -e | grep -E '^(NCCL|MOESERVE)_' || true)
cmd+=(-x "NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}")
if [ -n "$hostfile" ]; then
    cmd+=(-x PATH)
    [ -n "${LD_LIBRARY_PATH:-}" ] && cmd+=(-x LD_LIBRARY_PATH)
fi
cmd+=("${mpi_args[@]+"${mpi_args[@]}"}")

cmd+=("$bin" serve "${serve_args[@]+"${serve_args[@]}"}")

if [ $dry_run -eq 1 ]; then
    printf '%q' "${cmd[0]}"
    printf ' %q' "${cmd[@]:1}"
    printf '\n'
    exit 0
fi
setsid "${cmd[@]}" &
pid=$!
# the ranks on this node are mpirun's children; one rank signalled drains the whole group
forward() { pkill "-$1" -P "$pid" 2>/dev/null || true; }
trap 'forward TERM' TERM
trap 'forward INT' INT
while kill -0 "$pid" 2>/dev/null; do wait "$pid" || true; done
wait "$pid"
