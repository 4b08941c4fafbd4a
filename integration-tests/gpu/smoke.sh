#!/bin/bash
# Tessera on a real NVIDIA GPU host: an opt-in smoke check, never run by `make test`
# (CI has no GPU). Usage, as root:
#
#   integration-tests/gpu/smoke.sh BIN_DIR OUT_DIR
#
# BIN_DIR holds tesserad, tessera and tessera-runtime (and runc when the host has
# none, and a static busybox for the exec check); OUT_DIR gets the logs. It runs tesserad on the NVML backend, reads the GPUs,
# leases a whole GPU and an MPS share, and starts a CUDA container through
# tessera-runtime and runc on each (probe.cu, built here with nvcc), then releases
# everything. It only reads the GPU's modes: it never changes MIG or compute mode and
# never resets a GPU; every MPS control daemon it starts goes with its lease's
# release, and a `quit` to each of their pipe directories is the backstop.
# Each step prints "== STEP name" and "-- name rc=N"; the last line says how many
# steps failed.

set -u
BIN=$(readlink -f "$1")
OUT=$(readlink -f "$2")
HERE=$(dirname "$(readlink -f "$0")")
mkdir -p "$OUT"
T=$(mktemp -d /tmp/tessera-gpu.XXXXXX)
chmod 0755 "$T"
FAILED=()
step() {
    local name=$1
    shift
    echo "== STEP $name: $*"
    "$@"
    local rc=$?
    echo "-- $name rc=$rc"
    [ $rc -eq 0 ] || FAILED+=("$name")
    return $rc
}

echo "== host"
nvidia-smi -L
nvidia-smi --query-gpu=index,name,uuid,memory.total,mig.mode.current,compute_mode,driver_version --format=csv
ls -la /dev/nvidia* 2>&1
grep -iE 'nvidia' /proc/devices
uname -r
stat -fc %T /sys/fs/cgroup
MPS_CONTROL=$(command -v nvidia-cuda-mps-control || ls /usr/local/nvidia/bin/nvidia-cuda-mps-control 2>/dev/null || true)
echo "mps control: ${MPS_CONTROL:-none}"
RUNC=$(command -v runc || true)
if [ -z "$RUNC" ] && [ -x "$BIN/runc" ]; then RUNC=$BIN/runc; fi
echo "runc: ${RUNC:-none}"
LIBCUDA=$(readlink -f "$(ldconfig -p | awk '/libcuda.so.1 /{print $NF; exit}')" 2>/dev/null || true)
[ -n "$LIBCUDA" ] || LIBCUDA=$(readlink -f /usr/local/nvidia/lib64/libcuda.so.1 2>/dev/null || true)
echo "libcuda: ${LIBCUDA:-none}"

# ---- tesserad on NVML ----
mkdir -p "$T/state" "$T/run"
MPS_LINE=""
[ -z "$MPS_CONTROL" ] || MPS_LINE="mps_control = \"$MPS_CONTROL\""
cat >"$T/tesserad.toml" <<EOF
[daemon]
socket = "$T/run/tesserad.sock"
state_dir = "$T/state"
run_dir = "$T/run"
shutdown_grace = "5s"
[gpu]
backend = "nvml"
[nvml]
$MPS_LINE
[lease]
min_ttl = "1s"
[devices]
dev_root = "/dev"
EOF
export TESSERA_SOCKET=$T/run/tesserad.sock
step check-config "$BIN/tesserad" --config "$T/tesserad.toml" --check-config
"$BIN/tesserad" --config "$T/tesserad.toml" >"$OUT/tesserad.log" 2>&1 &
DPID=$!
for _ in $(seq 100); do [ -S "$TESSERA_SOCKET" ] && break; sleep 0.1; done
step daemon-up test -S "$TESSERA_SOCKET"
step gpus "$BIN/tessera" gpus
step node "$BIN/tessera" --json node
"$BIN/tessera" doctor 2>&1 | sed 's/^/doctor: /'

# A MIG lease on a GPU whose MIG mode is off is refused, saying why.
echo "== STEP mig-refused"
if "$BIN/tessera" lease create --tenant gpu-check --mig 1g.18gb; then
    echo "-- mig-refused rc=1 (a MIG lease was granted)"
    FAILED+=(mig-refused)
else
    echo "-- mig-refused rc=0"
fi

token_of() { python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["token"])' "$1"; }
lease_of() { python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["lease"]["id"])' "$1"; }

# ---- the container's rootfs: the probe and the libraries it links ----
ROOTFS=$T/rootfs
# A merged-/usr rootfs, as current distributions have: one copy of each library (a
# second libc, loaded through another path, breaks the MPS client's handshake).
mkdir -p "$ROOTFS"/{proc,dev,sys,run,tmp,etc,usr/lib/x86_64-linux-gnu,usr/lib64}
ln -s usr/lib "$ROOTFS/lib"
ln -s usr/lib64 "$ROOTFS/lib64"
# Native code for this GPU: PTX would need the driver's JIT library in the container.
step nvcc nvcc -O2 -arch=native -cudart static -o "$ROOTFS/probe" "$HERE/probe.cu"
for lib in $( (ldd "$ROOTFS/probe"; [ -z "$LIBCUDA" ] || ldd "$LIBCUDA") |
    awk '/=> \//{print $3; next} $1 ~ /^\//{print $1}' | sort -u); do
    case $lib in
    */ld-linux*) cp -L "$lib" "$ROOTFS/usr/lib64/" ;;
    *) cp -L "$lib" "$ROOTFS/usr/lib/x86_64-linux-gnu/" ;;
    esac
done
printf 'root:x:0:0:root:/root:/bin/sh\ntenant:x:1000:1000::/tmp:/bin/sh\n' >"$ROOTFS/etc/passwd"
printf 'root:x:0:\ntenant:x:1000:\n' >"$ROOTFS/etc/group"
ls -lR "$ROOTFS" | head -30

# ---- tessera-runtime ----
RT_RUNC=$RUNC
if [ -n "$RUNC" ] && ! ldconfig -p | grep -q 'libseccomp.so.2 '; then
    # A runc carried from another distribution may need its libseccomp beside it;
    # the runtime gives runc a clean environment, so a root-owned wrapper sets it.
    cat >"$T/runc" <<EOF
#!/bin/sh
LD_LIBRARY_PATH=$BIN exec $RUNC "\$@"
EOF
    chmod 0755 "$T/runc"
    RT_RUNC=$T/runc
fi
LIB_LINES=""
if [ -n "$LIBCUDA" ]; then
    LIB_LINES="[[driver_libraries]]
source = \"$LIBCUDA\"
destination = \"/usr/lib/x86_64-linux-gnu/libcuda.so.1\""
fi
cat >"$T/runtime.toml" <<EOF
runc_path = "$RT_RUNC"
daemon_socket = "$TESSERA_SOCKET"
state_dir = "$T/rt-state"
nvidia_proc_root = "/proc/driver/nvidia"
nvidia_cdi_specs = []
runc_cve_acknowledged = ["CVE-2025-31133", "CVE-2025-52565", "CVE-2025-52881"]
$LIB_LINES
[policy]
apparmor = "if-available"
container_storage_roots = ["$T"]
EOF
export TESSERA_RUNTIME_CONFIG=$T/runtime.toml

# Start the probe on a lease: run ID TOKEN UID PROBE-ARGS...
run_probe() {
    local id=$1 token=$2 uid=$3
    shift 3
    local b=$T/bundle-$id
    mkdir -p "$b"
    # The rootfs inside the bundle (hard links): one outside it must be an engine's
    # recorded layer.
    cp -al "$ROOTFS" "$b/rootfs"
    python3 - "$HERE/base-spec.json" "$b/config.json" "rootfs" "$token" "$uid" "$@" <<'PY'
import json, sys
src, dst, rootfs, token, uid = sys.argv[1:6]
s = json.load(open(src))
s["root"]["path"] = rootfs
s["process"]["args"] = ["/probe"] + sys.argv[6:]
s["process"]["user"] = {"uid": int(uid), "gid": int(uid)}
s["annotations"] = {"tessera.io/lease-token": token}
json.dump(s, open(dst, "w"))
PY
    "$BIN/tessera-runtime" --root "$T/runc-root" --log "$T/runc-$id.log" run --bundle "$b" "$id" |
        tee "$T/probe-$id.txt"
}

# A container that stays up (busybox sleep) on a lease: run_detached ID TOKEN UID.
run_detached() {
    local id=$1 token=$2 uid=$3
    local b=$T/bundle-$id
    mkdir -p "$b"
    cp -al "$ROOTFS" "$b/rootfs"
    python3 - "$HERE/base-spec.json" "$b/config.json" "rootfs" "$token" "$uid" <<'PY'
import json, sys
src, dst, rootfs, token, uid = sys.argv[1:6]
s = json.load(open(src))
s["root"]["path"] = rootfs
s["process"]["args"] = ["/busybox", "sleep", "300"]
s["process"]["user"] = {"uid": int(uid), "gid": int(uid)}
s["annotations"] = {"tessera.io/lease-token": token}
json.dump(s, open(dst, "w"))
PY
    "$BIN/tessera-runtime" --root "$T/runc-root" --log "$T/runc-$id.log" create --bundle "$b" "$id" \
        </dev/null >/dev/null 2>"$T/create-$id.err" || { cat "$T/create-$id.err"; return 1; }
    "$BIN/tessera-runtime" --root "$T/runc-root" start "$id"
}

# The probe's output for ID has a line matching each pattern given.
saw() {
    local id=$1
    shift
    local p
    for p in "$@"; do
        grep -qE "$p" "$T/probe-$id.txt" || { echo "missing: $p"; return 1; }
    done
}

# The lease's runtime calls in the audit log: exactly one ResolveToken and two
# successful binds (two containers, the second on the kept answer).
kept_answer_used() {
    local a=$T/state/audit.jsonl r b
    r=$(grep -c "\"action\":\"ResolveToken\",\"lease\":\"$1\"" "$a")
    # A bind record names its container between the lease and the result.
    b=$(grep -E "\"action\":\"BindContainer\",\"lease\":\"$1\",(\"container\":\"[^\"]*\",)?\"result\":\"ok\"" "$a" |
        grep -cE '"container":"(mps|mps-over)"')
    echo "lease $1: ResolveToken $r, BindContainer ok $b"
    [ "$r" = 1 ] && [ "$b" = 2 ]
}

# ---- a whole GPU ----
if step lease-whole sh -c "'$BIN/tessera' --json lease create --tenant gpu-check --gpu > '$T/whole.json'"; then
    W=$(lease_of "$T/whole.json")
    if [ -n "$RUNC" ]; then
        step probe-whole run_probe whole "$(token_of "$T/whole.json")" 0 1
        step probe-whole-saw saw whole '^PROBE devices 1$' '^PROBE kernel ok' '^PROBE alloc 1.0 GiB ok'
        cat "$T/runc-whole.log" 2>/dev/null | tail -5
    fi
    step lease-show "$BIN/tessera" lease show "$W"
    step release-whole "$BIN/tessera" lease release "$W"
fi

# ---- an MPS share: 25 % of the SMs, 8 GiB ----
if step lease-mps sh -c "'$BIN/tessera' --json lease create --tenant gpu-check --mps 25%,8GiB --mps-mode isolated > '$T/mps.json'"; then
    M=$(lease_of "$T/mps.json")
    ps -eo pid,user,args | grep '[n]vidia-cuda-mps' | sed 's/^/mps process: /'
    ls -la "$T/run/mps" 2>&1
    if [ -n "$RUNC" ]; then
        # Within the share's limits (25 % of the SMs, 8 GiB), then beyond them.
        step probe-mps run_probe mps "$(token_of "$T/mps.json")" 1000 4
        # The share as CUDA sees it in the container: about a quarter of the SMs and
        # 8 GiB of free memory (the MPS server's limits).
        step probe-mps-saw saw mps '^PROBE device0 .* sms 3[0-4]$' '^PROBE mem free_mib 8[0-9]{3} ' \
            '^PROBE kernel ok' '^PROBE alloc 4.0 GiB ok'
        for f in "$T"/run/mps/*/log/*.log; do sed "s|^|$(basename "$f"): |" "$f" | tail -15; done
        # The same probe on the host, as uid 1000, on the lease's MPS pipe directory:
        # tells an MPS set-up problem from a container one.
        PIPE=$(ls -d "$T"/run/mps/*/pipe | head -1)
        ls -la "$PIPE" | sed 's/^/pipe dir: /'
        echo "== host client:"
        host_client() {
            setpriv --reuid 1000 --regid 1000 --clear-groups env CUDA_MPS_PIPE_DIRECTORY="$PIPE" \
                "$ROOTFS/probe" "$1" 2>&1 | tee "$T/probe-host-$1.txt" | sed 's/^/host client: /'
        }
        host_client 2
        step mps-host-client saw host-2 '^PROBE kernel ok' '^PROBE alloc 2.0 GiB ok'
        # The share's 8 GiB limit, enforced by its MPS server.
        host_client 12
        step mps-host-limit saw host-12 '^PROBE kernel ok' '^PROBE alloc 12.0 GiB out of memory'
        for c in get_server_list "get_default_device_pinned_mem_limit 0" get_default_active_thread_percentage; do
            echo "$c" | CUDA_MPS_PIPE_DIRECTORY=$PIPE timeout 10 "$MPS_CONTROL" 2>&1 | sed "s/^/mps $c: /"
        done
        SRV=$(echo get_server_list | CUDA_MPS_PIPE_DIRECTORY=$PIPE timeout 10 "$MPS_CONTROL" 2>/dev/null | head -1)
        [ -z "$SRV" ] || echo "get_device_pinned_mem_limit $SRV 0" | CUDA_MPS_PIPE_DIRECTORY=$PIPE timeout 10 "$MPS_CONTROL" 2>&1 | sed 's/^/mps server limit: /'
        run_probe mps-over "$(token_of "$T/mps.json")" 1000 12
        # 12 GiB on an 8 GiB share: the MPS server refuses it.
        step probe-mps-over-refused saw mps-over '^PROBE alloc 12.0 GiB out of memory'
        # The second container on the lease was judged against the answer the first
        # one's bind confirmed (kept by the runtime): one ResolveToken, two binds, none
        # refused as RESOLUTION_CHANGED.
        step mps-kept-answer kept_answer_used "$M"
        # exec into a running container on the share (create, start, exec, as kubelet's
        # probes and `kubectl exec` do): the process runs as the container's own user
        # from the runtime's record, with the lease's MPS environment, and CUDA works.
        if [ -x "$BIN/busybox" ]; then
            cp "$BIN/busybox" "$ROOTFS/busybox"
            step exec-create run_detached exec-c "$(token_of "$T/mps.json")" 1000
            step exec-probe sh -c "'$BIN/tessera-runtime' --root '$T/runc-root' exec exec-c /probe 2 | tee '$T/probe-exec-c.txt'"
            step exec-probe-saw saw exec-c '^PROBE kernel ok' '^PROBE alloc 2.0 GiB ok'
            step exec-id sh -c "'$BIN/tessera-runtime' --root '$T/runc-root' exec exec-c /busybox id | tee '$T/probe-exec-id.txt'"
            step exec-id-saw grep -qE '^uid=1000(\([a-z]+\))? gid=1000(\([a-z]+\))?' "$T/probe-exec-id.txt"
            # An exec asking for root's group is refused.
            if "$BIN/tessera-runtime" --root "$T/runc-root" exec -g 0 exec-c /busybox id; then
                echo "-- exec-root-group-refused rc=1 (ran)"; FAILED+=(exec-root-group-refused)
            else
                echo "-- exec-root-group-refused rc=0"
            fi
            "$BIN/tessera-runtime" --root "$T/runc-root" kill exec-c KILL
            sleep 1
            step exec-delete "$BIN/tessera-runtime" --root "$T/runc-root" delete --force exec-c
        fi
        cat "$T/runc-mps.log" "$T/runc-mps-over.log" 2>/dev/null | tail -5
    fi
    step release-mps "$BIN/tessera" lease release "$M"
    sleep 1
    ps -eo pid,user,args | grep '[n]vidia-cuda-mps' | sed 's/^/mps process after release: /'
fi

# ---- stop ----
kill -TERM "$DPID"
step tesserad-clean-stop wait "$DPID"
# Backstop: quit any MPS control daemon still answering in our run dir.
for pipe in "$T"/run/mps/*/pipe; do
    [ -d "$pipe" ] || continue
    echo quit | CUDA_MPS_PIPE_DIRECTORY=$pipe timeout 10 "${MPS_CONTROL:-nvidia-cuda-mps-control}" 2>/dev/null &&
        echo "backstop: quit sent to $pipe"
done
ps -eo pid,user,args | grep '[n]vidia-cuda-mps' | sed 's/^/mps process at the end: /'
cp "$T"/state/audit.jsonl "$OUT/audit.jsonl" 2>/dev/null
echo "== done: ${#FAILED[@]} steps failed: ${FAILED[*]:-none}"
