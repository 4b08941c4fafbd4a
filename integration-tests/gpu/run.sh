#!/usr/bin/env bash
# Tessera on a real NVIDIA GPU: the end-to-end proof (see README.md next to this file).
#
#   sudo OUT=/tmp/gpu-out DEB_ROOT=/opt/debroot integration-tests/gpu/run.sh [--dry-run]
#
# It starts tesserad on the NVML backend in a temp dir, checks what it reports against
# nvidia-smi, leases two MPS shares and proves their limits with CUDA clients, measures
# matmul throughput with and without MPS, runs containers through tessera-runtime on a
# lease, then releases everything and checks that nothing is left on the GPU.
# It never changes MIG mode or compute mode and never resets a GPU.
#
# Environment:
#   OUT          where logs and results go (default ./gpu-out)
#   TESSERA_BIN  folder with tesserad, tessera, tessera-runtime (default ./target/release)
#   DEB_ROOT     folder where Debian's runc and busybox-static .debs were unpacked with
#                `dpkg -x` (default: runc and busybox from PATH, if any)
#   GPU_PYTHON   python3 with torch (CUDA build) for the CUDA clients (default python3)
#   GPU_INDEX    which GPU to lease on (default: the first one with MIG mode off)
#   BENCH_SECONDS  timed seconds per matmul run (default 3)
#   TESSERAD_EXTRA_TOML  a file appended to the generated tesserad.toml
# Flags: --dry-run (validate inputs, start nothing), --skip-bench, --skip-container,
#        --keep-tmp (leave the temp dir for inspection), -h/--help.
# Exit status: 0 every check passed or was skipped with a reason, 1 a check failed,
# 2 bad usage or broken inputs.

set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# No __pycache__ next to the helpers (the checkout may be read-only or tracked).
export PYTHONDONTWRITEBYTECODE=1
REPO=$(cd "$HERE/../.." && pwd)

DRY_RUN=0
SKIP_BENCH=0
SKIP_CONTAINER=0
KEEP_TMP=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    --skip-bench) SKIP_BENCH=1 ;;
    --skip-container) SKIP_CONTAINER=1 ;;
    --keep-tmp) KEEP_TMP=1 ;;
    -h | --help)
      sed -n '2,26p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
      exit 0
      ;;
    *)
      echo "run.sh: unknown argument $arg (see --help)" >&2
      exit 2
      ;;
  esac
done

OUT=${OUT:-./gpu-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
TESSERA_BIN=${TESSERA_BIN:-./target/release}
DEB_ROOT=${DEB_ROOT:-}
PYTHON=${GPU_PYTHON:-python3}
BENCH_SECONDS=${BENCH_SECONDS:-3}
TENANT=gpu-proof
HELPER="$HERE/gpuproof.py"
PROBE="$HERE/mps_probe.py"
BENCH="$HERE/matmul_bench.py"

# Everything printed also lands in $OUT/run.log.
: >"$OUT/run.log"
exec > >(tee -a "$OUT/run.log") 2>&1

RESULTS="$OUT/results.tsv"
printf 'status\tcheck\tdetail\n' >"$RESULTS"
N_FAIL=0
N_PASS=0
N_SKIP=0

say() { printf '%s\n' "$*"; }
# The last lines of a log, without terminal colour codes.
log_tail() { tail -n "$2" "$1" | sed 's/\x1b\[[0-9;]*m//g'; }
section() { printf '\n===== %s =====\n' "$*"; }
# record STATUS CHECK DETAIL: STATUS is PASS, FAIL, SKIP or INFO.
record() {
  local status=$1 check=$2 detail=${3:-}
  printf '%s\t%s\t%s\n' "$status" "$check" "${detail//$'\n'/ }" >>"$RESULTS"
  printf '%-4s  %s%s\n' "$status" "$check" "${detail:+ -- $detail}"
  case "$status" in
    PASS) N_PASS=$((N_PASS + 1)) ;;
    FAIL) N_FAIL=$((N_FAIL + 1)) ;;
    SKIP) N_SKIP=$((N_SKIP + 1)) ;;
  esac
}
pass() { record PASS "$@"; }
fail() { record FAIL "$@"; }
skip() { record SKIP "$@"; }
info() { record INFO "$@"; }
# Print a command, run it, keep its status (never aborts the script).
show() {
  say "\$ $*"
  local rc=0
  "$@" || rc=$?
  [ "$rc" -eq 0 ] || say "(exit $rc)"
  return 0
}
py() { python3 "$HELPER" "$@"; }

# ------------------------------------------------------------------ inputs

find_in_debroot() { # NAME CANDIDATE...: first executable candidate under DEB_ROOT, then PATH
  local name=$1 c
  shift
  if [ -n "$DEB_ROOT" ]; then
    for c in "$@"; do
      if [ -x "$DEB_ROOT/$c" ]; then
        printf '%s\n' "$DEB_ROOT/$c"
        return 0
      fi
    done
  fi
  command -v "$name" 2>/dev/null || true
}

RUNC=""
BUSYBOX=""
LIBSECCOMP_DIR=""
BIN=""
INPUTS_OK=1

validate_inputs() {
  section "inputs"
  local f
  if ! command -v python3 >/dev/null; then
    say "python3 is missing: the helpers need it"
    INPUTS_OK=0
    return
  fi
  for f in "$HELPER" "$PROBE" "$BENCH"; do
    if python3 -c 'import sys; compile(open(sys.argv[1]).read(), sys.argv[1], "exec")' "$f" 2>"$OUT/py_compile.err"; then
      say "ok       helper $f compiles"
    else
      say "BROKEN   helper $f: $(cat "$OUT/py_compile.err")"
      INPUTS_OK=0
    fi
  done
  [ "$INPUTS_OK" -eq 1 ] || return 0

  if [ -d "$TESSERA_BIN" ]; then
    BIN=$(cd "$TESSERA_BIN" && pwd)
  else
    BIN=$TESSERA_BIN
  fi
  for f in tesserad tessera tessera-runtime; do
    if [ -x "$BIN/$f" ]; then
      say "ok       $BIN/$f"
    else
      say "missing  $BIN/$f (cargo build --release, or set TESSERA_BIN)"
    fi
  done

  if [ -n "$DEB_ROOT" ] && [ ! -d "$DEB_ROOT" ]; then
    say "BROKEN   DEB_ROOT=$DEB_ROOT is not a directory"
    INPUTS_OK=0
    return 0
  fi
  RUNC=$(find_in_debroot runc usr/sbin/runc usr/bin/runc sbin/runc)
  BUSYBOX=$(find_in_debroot busybox bin/busybox usr/bin/busybox)
  if [ -n "$RUNC" ]; then say "ok       runc $RUNC"; else
    say "missing  runc (DEB_ROOT=${DEB_ROOT:-unset}; see README: apt-get download runc)"; fi
  if [ -n "$BUSYBOX" ]; then say "ok       busybox $BUSYBOX"; else
    say "missing  busybox (DEB_ROOT=${DEB_ROOT:-unset}; see README: apt-get download busybox-static)"; fi
  if [ -n "$DEB_ROOT" ] && [ -e "$DEB_ROOT/usr/lib/x86_64-linux-gnu/libseccomp.so.2" ]; then
    LIBSECCOMP_DIR="$DEB_ROOT/usr/lib/x86_64-linux-gnu"
    say "ok       libseccomp from $LIBSECCOMP_DIR (runc gets LD_LIBRARY_PATH)"
  fi
  if [ -n "$RUNC" ]; then
    local v
    if v=$(LD_LIBRARY_PATH="${LIBSECCOMP_DIR}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$RUNC" --version 2>&1 | head -1); then
      say "ok       $v"
    else
      say "BROKEN   $RUNC --version: $v (missing libseccomp? also unpack libseccomp2 into DEB_ROOT)"
    fi
  fi
  [[ "$BENCH_SECONDS" =~ ^[0-9]+([.][0-9]+)?$ ]] || {
    say "BROKEN   BENCH_SECONDS=$BENCH_SECONDS is not a number"
    INPUTS_OK=0
  }
  if [ -n "${GPU_INDEX:-}" ] && ! [[ "$GPU_INDEX" =~ ^[0-9]+$ ]]; then
    say "BROKEN   GPU_INDEX=$GPU_INDEX is not an index"
    INPUTS_OK=0
  fi
  if [ -n "${TESSERAD_EXTRA_TOML:-}" ] && [ ! -r "$TESSERAD_EXTRA_TOML" ]; then
    say "BROKEN   TESSERAD_EXTRA_TOML=$TESSERAD_EXTRA_TOML is not readable"
    INPUTS_OK=0
  fi
  return 0
}

# ------------------------------------------------------------------ configs

write_daemon_config() { # DIR SOCKET FILE MPS_CONTROL
  local dir=$1 sock=$2 file=$3 mps=$4
  cat >"$file" <<EOF
# Generated by integration-tests/gpu/run.sh: tesserad on the real GPUs (NVML).
[daemon]
socket = "$sock"
state_dir = "$dir/state"
run_dir = "$dir/run"
shutdown_grace = "10s"

[gpu]
backend = "nvml"
mps_control = "$mps"

[partition]
strategy = "best-fit"
dynamic_mig = true
on_release = "destroy"

[lease]
default_ttl = "1h"
max_ttl = "1d"
min_ttl = "1s"

[devices]
dev_root = "/dev"
EOF
  if [ -n "${TESSERAD_EXTRA_TOML:-}" ]; then
    printf '\n# From TESSERAD_EXTRA_TOML=%s\n' "$TESSERAD_EXTRA_TOML" >>"$file"
    cat "$TESSERAD_EXTRA_TOML" >>"$file"
  fi
}

# Host paths of the driver's user-space pieces a container needs (one per line).
driver_files() {
  local lib path
  for lib in libcuda.so.1 libnvidia-ml.so.1 libnvidia-ptxjitcompiler.so.1 libnvidia-nvvm.so.4; do
    path=$(ldconfig -p 2>/dev/null | awk -v l="$lib" '$1 == l && /x86-64/ { print $NF; exit }')
    [ -n "$path" ] && printf '%s\n' "$path"
  done
  path=$(command -v nvidia-smi 2>/dev/null || true)
  [ -n "$path" ] && printf '%s\n' "$path"
  return 0
}

write_runtime_config() { # FILE RUNC SOCKET DRIVER_FILE...
  local file=$1 runc=$2 sock=$3
  shift 3
  local passthrough='"NOTIFY_SOCKET"'
  [ -z "$LIBSECCOMP_DIR" ] || passthrough='"NOTIFY_SOCKET", "LD_LIBRARY_PATH"'
  {
    echo "# Generated by integration-tests/gpu/run.sh for tessera-runtime."
    echo "runc_path = \"$runc\""
    echo "daemon_socket = \"$sock\""
    echo "daemon_timeout_ms = 10000"
    echo "env_passthrough = [$passthrough]"
    echo "nvidia_proc_root = \"/proc/driver/nvidia\""
    local f
    for f in "$@"; do
      printf '\n[[driver_libraries]]\nsource = "%s"\noptional = false\n' "$f"
    done
    printf '\n[policy]\n'
    echo '# The proof host may lack the AppArmor LSM; where it has it, run.sh loads'
    echo '# configs/apparmor/tessera-tenant for the run and unloads it afterwards.'
    echo 'apparmor = "if-available"'
    echo 'no_token = "refuse"'
  } >"$file"
}

# ------------------------------------------------------------------ dry run

dry_run() {
  local why=$1 d="$OUT/dry-run"
  mkdir -p "$d"
  section "dry run ($why)"
  write_daemon_config "/tmp/tgpu.DRYRUN" "/tmp/tgpu.DRYRUN/tesserad.sock" "$d/tesserad.toml" \
    "/usr/bin/nvidia-cuda-mps-control"
  write_runtime_config "$d/runtime.toml" "${RUNC:-/usr/sbin/runc}" "/tmp/tgpu.DRYRUN/tesserad.sock" \
    /usr/lib/x86_64-linux-gnu/libcuda.so.1 /usr/bin/nvidia-smi
  local rc=0
  if (cd "$HERE" && PYTHONDONTWRITEBYTECODE=1 python3 -m unittest -q test_gpuproof.py) >"$d/unittest.log" 2>&1; then
    say "ok       helper tests: $(grep -E '^Ran ' "$d/unittest.log")"
  else
    say "BROKEN   helper tests (test_gpuproof.py):"
    cat "$d/unittest.log"
    rc=1
  fi
  py toml-check "$d/tesserad.toml" || rc=1
  py toml-check "$d/runtime.toml" || rc=1
  if [ -x "$BIN/tesserad" ]; then
    if "$BIN/tesserad" --config "$d/tesserad.toml" --check-config >"$d/check-config.log" 2>&1; then
      say "ok       tesserad --check-config accepts the generated config ($(tail -1 "$d/check-config.log"))"
    else
      say "BROKEN   tesserad --check-config: $(cat "$d/check-config.log")"
      rc=1
    fi
  else
    say "not checked: tesserad --check-config (no $BIN/tesserad)"
  fi
  if [ -x "$BIN/tessera" ]; then
    if "$BIN/tessera" --help 2>/dev/null | grep -qw doctor; then
      say "ok       tessera has a doctor subcommand (it will be run)"
    else
      say "note     tessera has no doctor subcommand (that step will be skipped)"
    fi
  fi
  say "generated configs: $d/tesserad.toml $d/runtime.toml"
  dry_run_container "$d" || rc=1
  return "$rc"
}

# Without a GPU: the same rootfs, spec and runtime.toml as step 4, but no lease token
# (policy no_token = "baseline"), run for real through tessera-runtime and runc.
dry_run_container() { # DIR
  local d=$1
  if [ "$(id -u)" -ne 0 ] || [ -z "$RUNC" ] || [ -z "$BUSYBOX" ] || [ ! -x "$BIN/tessera-runtime" ]; then
    say "not checked: container smoke test (needs root, runc, busybox and tessera-runtime)"
    return 0
  fi
  local t rc=0 out
  t=$(mktemp -d /tmp/tgpu-dry.XXXXXX)
  write_runtime_config "$t/runtime.toml" "$RUNC" "$t/no-daemon.sock"
  sed -i 's/^no_token = "refuse"/no_token = "baseline"/' "$t/runtime.toml"
  cp "$t/runtime.toml" "$d/runtime-smoke.toml"
  build_busybox_rootfs "$t/rootfs"
  mkdir -p "$t/b"
  py oci-spec --out "$t/b/config.json" --rootfs "$t/rootfs" --env PATH=/bin -- \
    sh -c 'echo container-ok; id -u; grep -E "^(NoNewPrivs|Seccomp):" /proc/self/status'
  RT_CONF="$t/runtime.toml"
  RUNC_ROOT="$t/runc-root"
  rt_argv
  out=$(timeout 60 "${RT[@]}" run --bundle "$t/b" "tgpu-dry-$$" </dev/null 2>&1) || rc=$?
  printf '%s\n' "$out" | sed 's/^/  container: /'
  timeout 30 "${RT[@]}" delete -f "tgpu-dry-$$" >/dev/null 2>&1 || true
  rm -rf "$t"
  RT_CONF=""
  RUNC_ROOT=""
  if [ "$rc" -eq 0 ] && grep -q container-ok <<<"$out"; then
    say "ok       container smoke test: busybox rootfs through tessera-runtime and $RUNC (no lease)"
    return 0
  fi
  say "BROKEN   container smoke test: exit $rc (see above)"
  return 1
}

# ------------------------------------------------------------------ state + cleanup

STARTED=0
TMP=""
SOCK=""
DAEMON_PID=""
RT_CONF=""
RUNC_ROOT=""
APPARMOR_LOADED=""
MPS_CONTROL=""
LEASES=()       # live lease ids this run created
PIPE_DIRS=()    # their MPS pipe directories
CONTAINERS=()   # container ids this run created

tsr() { "$BIN/tessera" --socket "$SOCK" "$@"; }
# tessera-runtime with the generated config, as an argv (usable under timeout).
rt_argv() {
  RT=(env TESSERA_RUNTIME_CONFIG="$RT_CONF")
  [ -z "$LIBSECCOMP_DIR" ] || RT+=(LD_LIBRARY_PATH="$LIBSECCOMP_DIR")
  RT+=("$BIN/tessera-runtime" --root "$RUNC_ROOT" --log "$OUT/runtime-log.json" --log-format json)
}
rt() { timeout 120 "${RT[@]}" "$@"; }
RT=()

mps_quit() { # PIPE_DIR: stop the control daemon of that pipe dir (only that one)
  local dir=$1 pids pid
  pids=$(py mps-procs "$dir" 2>/dev/null || true)
  [ -n "$pids" ] || return 0
  say "cleanup: quit MPS control daemon(s) $pids of $dir"
  echo quit | env CUDA_MPS_PIPE_DIRECTORY="$dir" timeout 20 "${MPS_CONTROL:-nvidia-cuda-mps-control}" || true
  for _ in $(seq 1 20); do
    pids=$(py mps-procs "$dir" 2>/dev/null || true)
    [ -n "$pids" ] || return 0
    sleep 0.5
  done
  for pid in $pids; do
    say "cleanup: MPS control daemon $pid ignored quit: SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
  done
}

stop_daemon() { # sets DAEMON_EXIT; returns 0 if it stopped within 30 s
  DAEMON_EXIT=""
  [ -n "$DAEMON_PID" ] || return 0
  if kill -0 "$DAEMON_PID" 2>/dev/null; then
    kill -TERM "$DAEMON_PID" 2>/dev/null || true
    for _ in $(seq 1 60); do
      kill -0 "$DAEMON_PID" 2>/dev/null || break
      sleep 0.5
    done
    if kill -0 "$DAEMON_PID" 2>/dev/null; then
      say "tesserad ($DAEMON_PID) did not stop within 30 s of SIGTERM: SIGKILL"
      kill -KILL "$DAEMON_PID" 2>/dev/null || true
      wait "$DAEMON_PID" 2>/dev/null || true
      DAEMON_PID=""
      DAEMON_EXIT=killed
      return 1
    fi
  fi
  local rc=0
  wait "$DAEMON_PID" 2>/dev/null || rc=$?
  DAEMON_EXIT=$rc
  DAEMON_PID=""
  return 0
}

cleanup() {
  local rc=$?
  set +e
  trap - EXIT INT TERM
  if [ -n "$TMP" ]; then
    section "cleanup"
    local id d
    for id in "${CONTAINERS[@]}"; do
      rt delete -f "$id" >/dev/null 2>&1 && say "cleanup: deleted container $id"
    done
    if [ -n "$DAEMON_PID" ] && kill -0 "$DAEMON_PID" 2>/dev/null; then
      for id in "${LEASES[@]}"; do
        timeout 60 "$BIN/tessera" --socket "$SOCK" lease release "$id" --reason "gpu proof cleanup" >/dev/null 2>&1 &&
          say "cleanup: released lease $id"
      done
    fi
    for d in "${PIPE_DIRS[@]}"; do
      mps_quit "$d"
    done
    if [ -n "$DAEMON_PID" ]; then
      stop_daemon
      say "cleanup: tesserad stopped (exit ${DAEMON_EXIT:-?})"
    fi
    # MPS daemons tesserad may have started after the last look (a lease in flight).
    if [ -d "$TMP/run/mps" ]; then
      for d in "$TMP"/run/mps/*/pipe; do
        [ -d "$d" ] && mps_quit "$d"
      done
    fi
    if [ -n "$APPARMOR_LOADED" ]; then
      apparmor_parser -R "$APPARMOR_LOADED" >/dev/null 2>&1 && say "cleanup: unloaded AppArmor profile $APPARMOR_LOADED"
    fi
    if [ "$KEEP_TMP" -eq 1 ]; then
      say "cleanup: kept $TMP (--keep-tmp)"
    else
      rm -rf "$TMP"
    fi
  fi
  if [ "$STARTED" -eq 1 ]; then
    section "summary"
    column -t -s $'\t' "$RESULTS" 2>/dev/null || cat "$RESULTS"
    say ""
    if [ "$N_FAIL" -gt 0 ]; then
      say "RESULT: FAIL ($N_FAIL failed, $N_PASS passed, $N_SKIP skipped) -- logs in $OUT"
      [ "$rc" -ne 0 ] || rc=1
    elif [ "$rc" -ne 0 ]; then
      say "RESULT: FAIL (run.sh stopped with status $rc) -- logs in $OUT"
    else
      say "RESULT: PASS ($N_PASS passed, $N_SKIP skipped) -- logs in $OUT"
    fi
  fi
  exit "$rc"
}

# Stop here: record why, then the trap cleans up and prints the summary.
abort() {
  fail "$1" "$2"
  say "cannot go on: $2"
  exit 1
}

# ------------------------------------------------------------------ steps

GPU_INDEX_SEL=""
GPU_UUID=""
HAVE_TORCH=0
BASE_APPS=""

step_preconditions() {
  section "1. preconditions"
  [ "$(id -u)" -eq 0 ] || abort "root" "run.sh needs root (MPS control daemons, runc, cgroups)"
  pass "root" "uid 0"
  show nvidia-smi --version
  nvidia-smi --query-gpu=index,name,uuid,memory.total,mig.mode.current,mig.mode.pending,compute_mode,driver_version,pci.bus_id \
    --format=csv | tee "$OUT/nvidia-smi-query.csv"
  nvidia-smi -q >"$OUT/nvidia-smi-q.txt"
  nvidia-smi -q -x >"$OUT/nvidia-smi-q.xml"
  local driver
  driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1)
  info "driver" "$driver"

  # The GPU to lease on: GPU_INDEX, or the first with MIG mode off. Never changed here.
  local idx mig cm
  while IFS=', ' read -r idx mig cm; do
    if [ -n "${GPU_INDEX:-}" ]; then
      [ "$idx" = "$GPU_INDEX" ] || continue
    elif [ "$mig" = "Enabled" ]; then
      continue
    fi
    GPU_INDEX_SEL=$idx
    break
  done < <(nvidia-smi --query-gpu=index,mig.mode.current,compute_mode --format=csv,noheader)
  [ -n "$GPU_INDEX_SEL" ] || abort "gpu choice" \
    "no GPU ${GPU_INDEX:+with index $GPU_INDEX }with MIG mode off; this proof never changes MIG mode (the operator decides: nvidia-smi -i N -mig 0)"
  GPU_UUID=$(nvidia-smi -i "$GPU_INDEX_SEL" --query-gpu=uuid --format=csv,noheader)
  mig=$(nvidia-smi -i "$GPU_INDEX_SEL" --query-gpu=mig.mode.current --format=csv,noheader)
  cm=$(nvidia-smi -i "$GPU_INDEX_SEL" --query-gpu=compute_mode --format=csv,noheader)
  if [ "$mig" = "Enabled" ]; then
    abort "gpu choice" "GPU $GPU_INDEX_SEL has MIG mode on; the MPS steps need it off and run.sh never changes it"
  fi
  pass "gpu choice" "GPU $GPU_INDEX_SEL $GPU_UUID, MIG mode $mig, compute mode $cm"
  if [ "$cm" != "Default" ]; then
    fail "compute mode" "GPU $GPU_INDEX_SEL is in compute mode $cm: two MPS leases need Default (run.sh never changes it)"
  else
    pass "compute mode" "Default (several MPS servers may share the GPU)"
  fi

  MPS_CONTROL=$(command -v nvidia-cuda-mps-control || true)
  [ -n "$MPS_CONTROL" ] || abort "mps binary" "nvidia-cuda-mps-control is not in PATH"
  pass "mps binary" "$MPS_CONTROL"

  local b
  for b in tesserad tessera tessera-runtime; do
    [ -x "$BIN/$b" ] || abort "binaries" "$BIN/$b is missing (cargo build --release, or TESSERA_BIN)"
  done
  pass "binaries" "$BIN/{tesserad,tessera,tessera-runtime}"

  py mps-all | tee "$OUT/mps-before.txt"
  if [ -s "$OUT/mps-before.txt" ]; then
    info "mps before" "MPS processes were already running (left alone): $(tr '\n' ';' <"$OUT/mps-before.txt")"
  fi
  BASE_APPS=$(nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader 2>/dev/null | sort || true)
  printf '%s\n' "$BASE_APPS" >"$OUT/compute-apps-before.txt"
  if [ -n "$BASE_APPS" ]; then
    info "compute apps before" "other processes use the GPU (benchmarks will be disturbed): $(tr '\n' ';' <<<"$BASE_APPS")"
  fi

  local torch_info
  if torch_info=$("$PYTHON" -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())' 2>&1); then
    if [[ "$torch_info" == *"available True"* ]]; then
      HAVE_TORCH=1
      pass "torch" "$PYTHON: torch $torch_info"
    else
      skip "torch" "$PYTHON: torch $torch_info: CUDA clients will be skipped"
    fi
  else
    skip "torch" "$PYTHON cannot import torch ($(tail -1 <<<"$torch_info")): CUDA clients and benchmarks will be skipped"
  fi
}

step_daemon() {
  section "2. tesserad on NVML"
  TMP=$(mktemp -d /tmp/tgpu.XXXXXX)
  chmod 0711 "$TMP"
  SOCK="$TMP/tesserad.sock"
  write_daemon_config "$TMP" "$SOCK" "$OUT/tesserad.toml" "$MPS_CONTROL"
  cat "$OUT/tesserad.toml"
  if ! "$BIN/tesserad" --config "$OUT/tesserad.toml" --check-config >"$OUT/check-config.log" 2>&1; then
    abort "daemon config" "tesserad --check-config: $(cat "$OUT/check-config.log")"
  fi
  pass "daemon config" "$(tail -1 "$OUT/check-config.log")"
  NO_COLOR=1 "$BIN/tesserad" --config "$OUT/tesserad.toml" >"$OUT/tesserad.log" 2>&1 &
  DAEMON_PID=$!
  say "tesserad pid $DAEMON_PID, log $OUT/tesserad.log"
  local up=0
  for _ in $(seq 1 60); do
    if ! kill -0 "$DAEMON_PID" 2>/dev/null; then
      local rc=0
      wait "$DAEMON_PID" || rc=$?
      DAEMON_PID=""
      abort "daemon start" "tesserad exited with status $rc: $(log_tail "$OUT/tesserad.log" 5)"
    fi
    if [ -S "$SOCK" ] && tsr gpus >/dev/null 2>&1; then
      up=1
      break
    fi
    sleep 0.5
  done
  [ "$up" -eq 1 ] || abort "daemon start" "tesserad did not answer within 30 s: $(log_tail "$OUT/tesserad.log" 5)"
  pass "daemon start" "answering on $SOCK"
}

step_gpus() {
  section "2. tessera gpus against nvidia-smi"
  show tsr gpus
  if ! tsr --json gpus >"$OUT/tessera-gpus.json" 2>"$OUT/tessera-gpus.err"; then
    fail "tessera gpus" "$(cat "$OUT/tessera-gpus.err")"
    return 0
  fi
  local rc=0
  py compare-gpus "$OUT/tessera-gpus.json" "$OUT/nvidia-smi-q.xml" | tee "$OUT/gpu-compare.txt" || rc=$?
  if [ "$rc" -eq 0 ]; then
    pass "gpus match nvidia-smi" "$(grep -c '^MATCH' "$OUT/gpu-compare.txt") fields (name, uuid, memory, MIG mode, bus id, minor)"
  else
    fail "gpus match nvidia-smi" "$(grep '^MISMATCH' "$OUT/gpu-compare.txt" | tr '\n' ';')"
  fi
  if tsr --json node >"$OUT/tessera-node.json" 2>/dev/null; then
    local ours theirs backend
    ours=$(py json-get "$OUT/tessera-node.json" driver_version || true)
    backend=$(py json-get "$OUT/tessera-node.json" backend || true)
    theirs=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1)
    if [ "$backend" = nvml ]; then pass "backend" "nvml"; else fail "backend" "tessera node says backend=$backend"; fi
    if [ "$ours" = "$theirs" ]; then
      pass "driver version" "$ours"
    else
      fail "driver version" "tessera=$ours nvidia-smi=$theirs"
    fi
  fi
}

step_mig_refusal() {
  section "2. MIG lease on a GPU with MIG mode off"
  local out rc=0
  out=$(tsr lease create --tenant "$TENANT" --mig 1g.10gb --gpu-index "$GPU_INDEX_SEL" --ttl 10m 2>&1) || rc=$?
  printf '%s\n' "$out" | tee "$OUT/mig-refusal.txt"
  if [ "$rc" -eq 0 ]; then
    fail "mig refused" "tessera lease create --mig 1g.10gb succeeded on GPU $GPU_INDEX_SEL with MIG mode off"
    local id
    id=$(grep -oE '\bl-[A-Za-z0-9-]+' <<<"$out" | head -1 || true)
    [ -z "$id" ] || tsr lease release "$id" --reason "should have been refused" || true
  elif grep -qi 'mig' <<<"$out" && grep -qiE 'mode|disabled|not enabled|off' <<<"$out"; then
    pass "mig refused" "exit $rc: $(tail -1 <<<"$out")"
  else
    fail "mig refused" "refused (exit $rc) but the reason does not name MIG mode: $(tail -1 <<<"$out")"
  fi
}

step_doctor() {
  section "2. tessera doctor"
  if "$BIN/tessera" --help 2>/dev/null | grep -qw doctor; then
    local rc=0
    tsr doctor >"$OUT/doctor.txt" 2>&1 || rc=$?
    cat "$OUT/doctor.txt"
    tsr --json doctor >"$OUT/doctor.json" 2>&1 || true
    # Saved, not judged: doctor also checks things this proof does not use (containerd).
    if [ "$rc" -eq 0 ]; then
      pass "doctor" "exit 0, saved doctor.txt and doctor.json"
    else
      info "doctor" "exit $rc; its FAIL lines: $(grep -E '\bFAIL\b' "$OUT/doctor.txt" | head -5 | tr '\n' ';')"
    fi
  else
    skip "doctor" "this tessera has no doctor subcommand"
  fi
}

step_bench_baseline() {
  section "3. matmul without MPS"
  if [ "$SKIP_BENCH" -eq 1 ]; then skip "bench no MPS" "--skip-bench"; return 0; fi
  if [ "$HAVE_TORCH" -eq 0 ]; then skip "bench no MPS" "no torch"; return 0; fi
  : >"$OUT/bench.jsonl"
  if env -u CUDA_MPS_PIPE_DIRECTORY CUDA_VISIBLE_DEVICES="$GPU_UUID" timeout 300 \
    "$PYTHON" "$BENCH" --label "no MPS" --seconds "$BENCH_SECONDS" | tee -a "$OUT/bench.jsonl"; then
    pass "bench no MPS" "see bench.jsonl"
  else
    fail "bench no MPS" "matmul_bench.py failed (see run.log)"
  fi
}

# Lease data, by lease id.
declare -A L_PIPE L_LOG L_MEM L_SM L_TOKEN

create_mps_lease() { # NAME SM_PERCENT MEMORY_GIB -> sets NEW_LEASE
  local name=$1 sm=$2 gib=$3 rc=0
  NEW_LEASE=""
  tsr --json lease create --tenant "$TENANT" --mps "${sm}%,${gib}GiB" --gpu-index "$GPU_INDEX_SEL" --ttl 1h \
    >"$OUT/lease-$name-create.json" 2>"$OUT/lease-$name-create.err" || rc=$?
  if [ "$rc" -ne 0 ]; then
    fail "lease $name" "tessera lease create --mps ${sm}%,${gib}GiB: exit $rc: $(cat "$OUT/lease-$name-create.err")"
    return 0
  fi
  local id
  id=$(py json-get "$OUT/lease-$name-create.json" lease.id || true)
  if [ -z "$id" ]; then
    fail "lease $name" "no lease id in the create output: $(head -c 300 "$OUT/lease-$name-create.json")"
    return 0
  fi
  LEASES+=("$id")
  L_TOKEN[$id]=$(py json-get "$OUT/lease-$name-create.json" token || true)
  tsr --json lease show "$id" >"$OUT/lease-$name.json" || true
  tsr lease show "$id" || true
  local state pipe
  state=$(py json-get "$OUT/lease-$name.json" state || true)
  pipe=$(py json-get "$OUT/lease-$name.json" partition.mps.pipe_dir || true)
  L_PIPE[$id]=$pipe
  L_LOG[$id]=$(py json-get "$OUT/lease-$name.json" partition.mps.log_dir || true)
  L_MEM[$id]=$((gib << 30))
  L_SM[$id]=$sm
  [ -z "$pipe" ] || PIPE_DIRS+=("$pipe")
  if [ "$state" = active ] && [ -n "$pipe" ]; then
    pass "lease $name" "$id active, ${sm}% SMs, ${gib} GiB, pipe dir $pipe"
    NEW_LEASE=$id
  else
    fail "lease $name" "$id state=$state pipe_dir=${pipe:-(none)}"
  fi
}

check_mps_daemon() { # NAME LEASE_ID -> sets MPS_PID (the control daemon's pid)
  local name=$1 id=$2 pipe=${L_PIPE[$2]} pids n pidfile
  MPS_PID=""
  pids=$(py mps-procs "$pipe")
  n=$(grep -c . <<<"$pids" || true)
  pidfile=$(cat "$pipe/nvidia-cuda-mps-control.pid" 2>/dev/null || echo none)
  [ -z "$pids" ] || ps -o pid,user,args -p "$(paste -sd, - <<<"$pids")" || true
  if [ "$n" -eq 1 ] && [ "$pids" = "$pidfile" ]; then
    pass "mps daemon $name" "pid $pids, CUDA_MPS_PIPE_DIRECTORY=$pipe, pid file agrees"
  else
    fail "mps daemon $name" "$n control daemon(s) [$(tr '\n' ' ' <<<"$pids")] for $pipe, pid file says $pidfile"
  fi
  MPS_PID=$(head -1 <<<"$pids")
  # The limits the daemon holds (the tenant cannot loosen these).
  local pct mem
  pct=$(echo get_default_active_thread_percentage | env CUDA_MPS_PIPE_DIRECTORY="$pipe" timeout 20 "$MPS_CONTROL" 2>&1 || true)
  mem=$(echo "get_default_device_pinned_mem_limit 0" | env CUDA_MPS_PIPE_DIRECTORY="$pipe" timeout 20 "$MPS_CONTROL" 2>&1 || true)
  if awk -v p="$pct" -v want="${L_SM[$id]}" 'BEGIN { exit !(p + 0 == want + 0) }'; then
    pass "mps sm limit $name" "get_default_active_thread_percentage = $pct"
  else
    fail "mps sm limit $name" "get_default_active_thread_percentage = '$pct', want ${L_SM[$id]}"
  fi
  info "mps mem limit $name" "get_default_device_pinned_mem_limit 0 = '$mem' (lease: $((L_MEM[$id] >> 20)) MiB)"
}

probe() { # NAME LEASE_ID BYTES EXPECT [EXTRA_ENV...]
  local name=$1 id=$2 bytes=$3 expect=$4 rc=0 line
  shift 4
  line=$(env CUDA_MPS_PIPE_DIRECTORY="${L_PIPE[$id]}" CUDA_VISIBLE_DEVICES="$GPU_UUID" "$@" \
    timeout 300 "$PYTHON" "$PROBE" --bytes "$bytes" --expect "$expect" --label "$name" 2>>"$OUT/probe.stderr") || rc=$?
  printf '%s\n' "$line" | tee -a "$OUT/probes.jsonl"
  case "$rc" in
    0) pass "$name" "$((bytes >> 20)) MiB: outcome $expect as expected" ;;
    1) fail "$name" "$((bytes >> 20)) MiB: expected $expect, got the other ($line)" ;;
    124) fail "$name" "timed out after 300 s (MPS server unreachable?)" ;;
    *) fail "$name" "CUDA client could not run (exit $rc): $line" ;;
  esac
}

LEASE_A=""
LEASE_B=""

step_mps() {
  section "3. two MPS leases"
  create_mps_lease a 25 8
  LEASE_A=$NEW_LEASE
  create_mps_lease b 50 16
  LEASE_B=$NEW_LEASE
  [ -n "$LEASE_A" ] && [ -n "$LEASE_B" ] || return 0
  local pa pb
  check_mps_daemon a "$LEASE_A"
  pa=$MPS_PID
  check_mps_daemon b "$LEASE_B"
  pb=$MPS_PID
  if [ -n "$pa" ] && [ -n "$pb" ] && [ "$pa" != "$pb" ]; then
    pass "mps daemons distinct" "lease a: $pa, lease b: $pb"
  else
    fail "mps daemons distinct" "lease a: ${pa:-none}, lease b: ${pb:-none}"
  fi
  py mps-all | tee "$OUT/mps-during.txt"

  section "3. MPS limits seen by CUDA clients"
  if [ "$HAVE_TORCH" -eq 0 ]; then
    skip "mps clients" "no torch"
    return 0
  fi
  local id name mem
  for name in a b; do
    id=$LEASE_A
    [ "$name" = a ] || id=$LEASE_B
    mem=${L_MEM[$id]}
    probe "mps $name below limit" "$id" $((mem / 2)) ok
    probe "mps $name above limit" "$id" $((mem * 3 / 2)) oom
    probe "mps $name above limit, looser client env" "$id" $((mem * 3 / 2)) oom \
      CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=$(((mem >> 30) * 4))G" CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100
  done
}

step_bench_mps() {
  section "3. matmul under MPS"
  if [ "$SKIP_BENCH" -eq 1 ]; then skip "bench mps" "--skip-bench"; return 0; fi
  if [ "$HAVE_TORCH" -eq 0 ]; then skip "bench mps" "no torch"; return 0; fi
  if [ -z "$LEASE_A" ] || [ -z "$LEASE_B" ]; then
    skip "bench mps" "the MPS leases are missing"
    return 0
  fi
  local id label
  for id in "$LEASE_A" "$LEASE_B"; do
    label="mps ${L_SM[$id]}%"
    if env CUDA_MPS_PIPE_DIRECTORY="${L_PIPE[$id]}" CUDA_VISIBLE_DEVICES="$GPU_UUID" timeout 300 \
      "$PYTHON" "$BENCH" --label "$label" --seconds "$BENCH_SECONDS" | tee -a "$OUT/bench.jsonl"; then
      pass "bench $label" "see bench.jsonl"
    else
      fail "bench $label" "matmul_bench.py failed under MPS"
    fi
  done
  py bench-table "$OUT/bench.jsonl" | tee "$OUT/bench-table.txt"
  info "bench" "table in bench-table.txt (throughput should scale roughly with the SM share)"
}

# ------------------------------------------------------------------ containers

build_busybox_rootfs() { # DIR
  local r=$1 applet f
  mkdir -p "$r"/{bin,proc,sys,dev,tmp,etc,run,root}
  cp "$BUSYBOX" "$r/bin/busybox"
  for applet in $("$BUSYBOX" --list); do
    [ "$applet" = busybox ] || ln -sf busybox "$r/bin/$applet"
  done
  echo 'root:x:0:0:root:/root:/bin/sh' >"$r/etc/passwd"
  echo 'root:x:0:' >"$r/etc/group"
  # The C library nvidia-smi and libnvidia-ml need (not the driver: that comes through
  # the runtime's driver_libraries).
  for f in $( (ldd "$(command -v nvidia-smi)"; ldd "$NVML_LIB") 2>/dev/null |
    grep -oE '/[^ ]+' | grep -v -e libnvidia -e libcuda | sort -u); do
    [ -e "$f" ] && cp -L --parents "$f" "$r/"
  done
}

load_apparmor_if_needed() {
  [ "$(cat /sys/module/apparmor/parameters/enabled 2>/dev/null || echo N)" = Y ] || return 0
  if grep -q '^tessera-tenant ' /sys/kernel/security/apparmor/profiles 2>/dev/null; then
    return 0
  fi
  local prof="$REPO/configs/apparmor/tessera-tenant"
  if command -v apparmor_parser >/dev/null && [ -f "$prof" ]; then
    if apparmor_parser -r "$prof"; then
      APPARMOR_LOADED=$prof
      info "apparmor" "loaded $prof for this run"
      return 0
    fi
  fi
  info "apparmor" "AppArmor is on but tessera-tenant is not loaded and cannot be (apparmor_parser or $prof missing): containers will be refused"
}

devices_cgroup() { # CONTAINER_ID
  local id=$1 pid cg
  pid=$(LD_LIBRARY_PATH="${LIBSECCOMP_DIR}" "$RUNC" --root "$RUNC_ROOT" state "$id" 2>/dev/null |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["pid"])' 2>/dev/null || true)
  [ -n "$pid" ] || { fail "devices cgroup" "no pid for container $id"; return 0; }
  say "container $id init pid $pid; /proc/$pid/cgroup:"
  cat "/proc/$pid/cgroup"
  if [ "$(stat -fc %T /sys/fs/cgroup)" = cgroup2fs ]; then
    cg=$(awk -F: '$1 == "0" { print $3 }' "/proc/$pid/cgroup")
    say "cgroup v2: device access is a BPF_CGROUP_DEVICE program runc attached to /sys/fs/cgroup$cg (no devices.list on v2)"
    if command -v bpftool >/dev/null; then
      bpftool cgroup list "/sys/fs/cgroup$cg" | tee "$OUT/devices-bpf.txt"
      if grep -q device "$OUT/devices-bpf.txt"; then
        pass "devices cgroup" "v2: a device program is attached to $cg"
      else
        fail "devices cgroup" "v2: no device program attached to $cg"
      fi
    else
      info "devices cgroup" "v2 at $cg; bpftool is absent so the attached device program was not listed (the in-container checks below still apply)"
    fi
  else
    cg=$(awk -F: '$2 ~ /(^|,)devices(,|$)/ { print $3 }' "/proc/$pid/cgroup")
    tee "$OUT/devices.list" <"/sys/fs/cgroup/devices$cg/devices.list"
    local minor
    minor=$(gpu_minor "$GPU_INDEX_SEL")
    if grep -q '^a \*:\* rwm' "$OUT/devices.list"; then
      fail "devices cgroup" "v1 devices.list allows everything (a *:* rwm)"
    elif grep -q "^c 195:$minor " "$OUT/devices.list" && ! grep -E '^c 195:' "$OUT/devices.list" | grep -vqE "^c 195:($minor|255) "; then
      pass "devices cgroup" "v1: 195:$minor and nvidiactl only among NVIDIA nodes"
    else
      fail "devices cgroup" "v1 devices.list does not hold exactly this GPU's node (minor $minor): see devices.list"
    fi
  fi
}

NVML_LIB=""

gpu_minor() { # INDEX -> the GPU's /dev/nvidiaN minor (nvidia-smi -q "Minor Number")
  nvidia-smi -q -i "$1" | awk -F: '/Minor Number/ { gsub(/ /, "", $2); print $2; exit }'
}

step_container() {
  section "4. a container on an MPS lease through tessera-runtime"
  if [ "$SKIP_CONTAINER" -eq 1 ]; then skip "container" "--skip-container"; return 0; fi
  [ -n "$RUNC" ] || { skip "container" "no runc (set DEB_ROOT, see README)"; return 0; }
  [ -n "$BUSYBOX" ] || { skip "container" "no busybox (set DEB_ROOT, see README)"; return 0; }
  [ -n "$LEASE_A" ] || { skip "container" "lease a is missing"; return 0; }
  local id=$LEASE_A token=${L_TOKEN[$LEASE_A]}
  mapfile -t DRIVER_FILES < <(driver_files)
  NVML_LIB=$(printf '%s\n' "${DRIVER_FILES[@]}" | grep libnvidia-ml || true)
  [ -n "$NVML_LIB" ] || { fail "container" "libnvidia-ml.so.1 not found with ldconfig -p"; return 0; }
  info "driver files" "${DRIVER_FILES[*]}"
  RT_CONF="$OUT/runtime.toml"
  RUNC_ROOT="$TMP/runc-root"
  mkdir -p "$RUNC_ROOT"
  rt_argv
  write_runtime_config "$RT_CONF" "$RUNC" "$SOCK" "${DRIVER_FILES[@]}"
  cat "$RT_CONF"
  load_apparmor_if_needed
  build_busybox_rootfs "$TMP/rootfs"
  local libdirs
  libdirs=$(printf '%s\n' "${DRIVER_FILES[@]}" | grep '\.so' | xargs -n1 dirname | sort -u | paste -sd: -)

  local cid="tgpu-smi-$$" b="$TMP/bundle-smi"
  mkdir -p "$b"
  py oci-spec --out "$b/config.json" --rootfs "$TMP/rootfs" --token "$token" \
    --env PATH=/bin:/usr/bin --env "LD_LIBRARY_PATH=$libdirs" -- sleep 600
  CONTAINERS+=("$cid")
  if ! rt create --bundle "$b" "$cid" </dev/null >"$OUT/container-smi.out" 2>"$OUT/container-smi.err"; then
    fail "container create" "$(cat "$OUT/container-smi.err")"
    tail -3 "$OUT/runtime-log.json" 2>/dev/null || true
    return 0
  fi
  if ! rt start "$cid" 2>>"$OUT/container-smi.err"; then
    fail "container start" "$(cat "$OUT/container-smi.err")"
    return 0
  fi
  pass "container start" "$cid on lease $id"
  cp "$b/config.json" "$OUT/container-smi.config.json" 2>/dev/null || true

  local smi rc=0
  # nvidia-smi is in the container at its host path (a driver_libraries entry).
  local smi_path
  smi_path=$(printf '%s\n' "${DRIVER_FILES[@]}" | grep '/nvidia-smi$' || echo nvidia-smi)
  smi=$(rt exec "$cid" "$smi_path" -L 2>&1) || rc=$?
  printf '%s\n' "$smi" | tee "$OUT/container-nvidia-smi-L.txt"
  local n
  n=$(grep -c '^GPU ' <<<"$smi" || true)
  if [ "$rc" -eq 0 ] && [ "$n" -eq 1 ] && grep -q "$GPU_UUID" <<<"$smi"; then
    pass "nvidia-smi -L in container" "one GPU, $GPU_UUID"
  else
    fail "nvidia-smi -L in container" "exit $rc, $n GPU line(s): $(tr '\n' ' ' <<<"$smi")"
  fi
  say "--- inside: env, /dev, the MPS pipe dir"
  rt exec "$cid" sh -c 'env | grep -E "^(CUDA|NVIDIA|TESSERA)" | sort; ls -l /dev /dev/nvidia-caps 2>&1; ls -la /run/nvidia-mps 2>&1; cat /proc/self/status | grep -E "^(CapEff|NoNewPrivs|Seccomp):"' 2>&1 |
    tee "$OUT/container-inside.txt" || true
  if grep -q '^CUDA_MPS_PIPE_DIRECTORY=' "$OUT/container-inside.txt" && grep -q ' control' "$OUT/container-inside.txt"; then
    pass "mps pipe in container" "CUDA_MPS_PIPE_DIRECTORY set, the lease's control socket is visible"
  else
    fail "mps pipe in container" "the lease's MPS pipe dir or env is missing inside (see container-inside.txt)"
  fi
  local others="" gi mine
  mine=$(gpu_minor "$GPU_INDEX_SEL")
  for gi in $(nvidia-smi --query-gpu=index --format=csv,noheader); do
    [ "$gi" = "$GPU_INDEX_SEL" ] || others="$others $(gpu_minor "$gi")"
  done
  others=$(tr ' ' '\n' <<<"$others" | grep -vx -e '' -e "$mine" || true)
  if [ -n "$others" ]; then
    local m bad=""
    for m in $others; do
      grep -qE " nvidia$m\$" "$OUT/container-inside.txt" && bad="$bad nvidia$m"
    done
    if [ -z "$bad" ]; then pass "other gpus hidden" "no /dev/nvidia{$(tr '\n' ',' <<<"$others" | sed 's/,$//')} inside"; else fail "other gpus hidden" "visible:$bad"; fi
  else
    info "other gpus hidden" "this host has one GPU: nothing else to hide"
  fi
  devices_cgroup "$cid"
  tsr --json lease show "$id" >"$OUT/lease-a-bound.json" || true
  if python3 -c 'import json,sys; sys.exit(0 if json.load(open(sys.argv[1]))["containers"] else 1)' "$OUT/lease-a-bound.json" 2>/dev/null; then
    pass "container bound" "tessera lease show lists the container on lease $id"
  else
    fail "container bound" "lease $id shows no bound container"
  fi
  rt kill "$cid" KILL 2>/dev/null || true
  sleep 1
  rt delete -f "$cid" 2>/dev/null || true

  step_container_cuda "$id" "$token"
}

# CUDA inside a container: the host's /usr (read-only) gives python and torch; needs
# a python whose prefix the runtime policy lets us bind (not under /root, /proc, ...).
step_container_cuda() { # LEASE_ID TOKEN
  local id=$1 token=$2
  section "4. CUDA in a container on the lease"
  if [ "$HAVE_TORCH" -eq 0 ]; then skip "cuda in container" "no torch"; return 0; fi
  local pyinfo pyexe roots=() err
  # The interpreter, its prefixes and torch's site dir: the container must see them all.
  # The interpreter is run by the path it was started with (a venv's bin/python3 is a
  # symlink, and the venv is found from that path, not from its target).
  if ! pyinfo=$("$PYTHON" -c 'import os, sys, torch
print(os.path.abspath(sys.executable))
print(os.path.dirname(os.path.dirname(os.path.abspath(sys.executable))))
print(os.path.dirname(os.path.dirname(os.path.realpath(sys.executable))))
print(os.path.realpath(sys.prefix))
print(os.path.realpath(sys.base_prefix))
print(os.path.dirname(os.path.dirname(os.path.realpath(torch.__file__))))' 2>&1); then
    fail "cuda in container" "cannot ask $PYTHON where torch lives: $(tail -1 <<<"$pyinfo")"
    return 0
  fi
  pyexe=$(head -1 <<<"$pyinfo")
  local -a paths
  mapfile -t paths < <(tail -n +2 <<<"$pyinfo")
  if ! err=$(py bind-roots "${paths[@]}" 2>&1); then
    skip "cuda in container" "$err (install torch under /usr or /opt to run this step)"
    return 0
  fi
  mapfile -t roots <<<"$err"
  local r="$TMP/rootfs-cuda" d binds=(--bind /usr:/usr)
  mkdir -p "$r"/{proc,sys,dev,tmp,etc,run,probe,usr}
  for d in /lib /lib64 /lib32 /bin /sbin; do
    if [ -L "$d" ]; then
      ln -sfn "$(readlink "$d")" "$r$d"
    elif [ -d "$d" ]; then
      mkdir -p "$r$d"
      binds+=(--bind "$d:$d")
    fi
  done
  for d in "${roots[@]}"; do
    [ -n "$d" ] || continue
    mkdir -p "$r$d"
    binds+=(--bind "$d:$d")
  done
  cp /etc/ld.so.cache "$r/etc/" 2>/dev/null || true
  echo 'root:x:0:0:root:/tmp:/bin/sh' >"$r/etc/passwd"
  cp "$PROBE" "$r/probe/mps_probe.py"
  info "cuda container binds" "${binds[*]}"
  local mem=${L_MEM[$id]} expect bytes n=0
  for expect in ok oom; do
    n=$((n + 1))
    bytes=$((mem / 2))
    [ "$expect" = ok ] || bytes=$((mem * 3 / 2))
    local cid="tgpu-cuda-$$-$n" b="$TMP/bundle-cuda-$n" out rc=0
    mkdir -p "$b"
    py oci-spec --out "$b/config.json" --rootfs "$r" --token "$token" "${binds[@]}" \
      --env PATH=/usr/bin:/bin --env HOME=/tmp --env PYTHONDONTWRITEBYTECODE=1 \
      -- "$pyexe" /probe/mps_probe.py --bytes "$bytes" --expect "$expect" --label "container $expect"
    CONTAINERS+=("$cid")
    out=$(timeout 300 "${RT[@]}" run --bundle "$b" "$cid" </dev/null 2>&1) || rc=$?
    printf '%s\n' "$out" | tee -a "$OUT/container-cuda.txt"
    rt delete -f "$cid" >/dev/null 2>&1 || true
    case "$rc" in
      0) pass "cuda in container ($expect)" "$((bytes >> 20)) MiB under lease $id: $expect as expected" ;;
      1) fail "cuda in container ($expect)" "$((bytes >> 20)) MiB: the other outcome ($(tail -1 <<<"$out"))" ;;
      124) fail "cuda in container ($expect)" "timed out (an MPS client in its own IPC namespace may not reach the server: see README)" ;;
      *) fail "cuda in container ($expect)" "exit $rc: $(tail -2 <<<"$out" | tr '\n' ' ')" ;;
    esac
  done
}

# ------------------------------------------------------------------ release

step_release() {
  section "5. release"
  local id logdir
  for id in "${LEASES[@]}"; do
    logdir=${L_LOG[$id]:-}
    if [ -n "$logdir" ] && [ -d "$logdir" ]; then
      mkdir -p "$OUT/mps-logs/$id"
      cp "$logdir"/* "$OUT/mps-logs/$id/" 2>/dev/null || true
    fi
    if tsr lease release "$id" --reason "gpu proof done" >"$OUT/release-$id.txt" 2>&1; then
      local state
      tsr --json lease show "$id" >"$OUT/lease-$id-released.json" 2>/dev/null || true
      state=$(py json-get "$OUT/lease-$id-released.json" state 2>/dev/null || echo "?")
      pass "release $id" "state $state"
    else
      fail "release $id" "$(cat "$OUT/release-$id.txt")"
    fi
  done
  LEASES=()
  local left="" d
  for _ in $(seq 1 40); do
    left=""
    for d in "${PIPE_DIRS[@]}"; do
      [ -z "$(py mps-procs "$d")" ] || left="$left $d"
    done
    [ -n "$left" ] || break
    sleep 0.5
  done
  if [ -z "$left" ]; then
    pass "mps daemons gone" "no nvidia-cuda-mps-control for the leases' pipe dirs"
  else
    fail "mps daemons gone" "still running for:$left"
  fi
  py mps-all | tee "$OUT/mps-after.txt"
  if diff -q "$OUT/mps-before.txt" "$OUT/mps-after.txt" >/dev/null; then
    pass "no new mps processes" "same MPS processes as before the run"
  else
    fail "no new mps processes" "$(diff "$OUT/mps-before.txt" "$OUT/mps-after.txt" | grep '^>' | tr '\n' ';')"
  fi
  local apps
  for _ in $(seq 1 20); do
    apps=$(nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader 2>/dev/null | sort || true)
    [ "$apps" != "$BASE_APPS" ] || break
    sleep 0.5
  done
  printf '%s\n' "$apps" >"$OUT/compute-apps-after.txt"
  if [ "$apps" = "$BASE_APPS" ]; then
    pass "no leftover compute apps" "nvidia-smi --query-compute-apps as before the run${BASE_APPS:+ (pre-existing ones kept)}"
  else
    fail "no leftover compute apps" "$(tr '\n' ';' <<<"$apps")"
  fi
  for d in "${PIPE_DIRS[@]}"; do
    if [ -e "$d" ]; then info "pipe dir" "$d still exists after release"; fi
  done
  if stop_daemon; then
    if [ "$DAEMON_EXIT" = 0 ]; then
      pass "daemon stop" "tesserad exited 0 on SIGTERM"
    else
      fail "daemon stop" "tesserad exited $DAEMON_EXIT on SIGTERM"
    fi
  else
    fail "daemon stop" "tesserad needed SIGKILL"
  fi
}

# ------------------------------------------------------------------ main

main() {
  say "tessera GPU proof: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname)"
  say "repo $REPO, OUT=$OUT, TESSERA_BIN=$TESSERA_BIN, DEB_ROOT=${DEB_ROOT:-unset}, GPU_PYTHON=$PYTHON"
  validate_inputs
  if [ "$INPUTS_OK" -ne 1 ]; then
    say "run.sh: broken inputs (above): fix them first"
    exit 2
  fi
  if ! command -v nvidia-smi >/dev/null; then
    dry_run "no nvidia-smi" || exit 2
    say "SKIPPED: no NVIDIA GPU (nvidia-smi not found)"
    exit 0
  fi
  if [ "$DRY_RUN" -eq 1 ]; then
    dry_run "--dry-run" || exit 2
    say "DRY RUN: inputs validated, nothing started"
    exit 0
  fi
  STARTED=1
  trap cleanup EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
  step_preconditions
  step_daemon
  step_gpus
  step_mig_refusal
  step_doctor
  step_bench_baseline
  step_mps
  step_bench_mps
  step_container
  step_release
}

main
