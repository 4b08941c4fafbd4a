#!/usr/bin/env bash
# Stage the root file system of the tessera image: what the DaemonSet runs, on a
# `scratch` base (no distribution, no package manager, no shell).
#
#   deploy/image/stage-rootfs.sh BIN_DIR RUNTIME OUT_DIR
#
# BIN_DIR holds tesserad and tessera; RUNTIME is tessera-runtime (statically linked as
# `make build` makes it, or any build). OUT_DIR gets:
#   /usr/bin/{tesserad,tessera,tessera-runtime}  stripped
#   the shared libraries tesserad and tessera link (glibc, libgcc_s: tesserad dlopens
#   the host's libnvidia-ml.so.1, so it cannot be a static glibc program), at the
#   paths the dynamic loader looks them up
#   /usr/bin/tessera-install-runtime             the init container's copy of
#                                                tessera-runtime to the host, a
#                                                script run by busybox (static):
#                                                /bin/{sh,mkdir,cp,chmod,mv}
#   /etc/{passwd,group}, /run/tessera, /var/lib/tessera, /tmp
# Used by `make image` (podman, no registry) and by deploy/kubernetes/Dockerfile.
set -euo pipefail

[ $# -eq 3 ] || { sed -n '2,18p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 2; }
BIN=$1
RUNTIME=$2
OUT=$3
for f in "$BIN/tesserad" "$BIN/tessera" "$RUNTIME"; do
    [ -x "$f" ] || { echo "stage-rootfs: $f is missing" >&2; exit 2; }
done
BUSYBOX=$(command -v busybox || true)
[ -n "$BUSYBOX" ] || BUSYBOX=/bin/busybox
if ! [ -x "$BUSYBOX" ] || readelf -l "$(readlink -f "$BUSYBOX")" | grep -q 'program interpreter'; then
    echo "stage-rootfs: a static busybox is needed (Debian: busybox-static)" >&2
    exit 2
fi

rm -rf "$OUT"
install -d -m 0755 "$OUT/usr/bin" "$OUT/bin" "$OUT/etc" "$OUT/tmp" "$OUT/run/tessera" \
    "$OUT/var/lib/tessera"
chmod 1777 "$OUT/tmp"
chmod 0700 "$OUT/var/lib/tessera"
chmod 0751 "$OUT/run/tessera"
install -m 0755 "$BIN/tesserad" "$BIN/tessera" "$OUT/usr/bin/"
install -m 0755 "$RUNTIME" "$OUT/usr/bin/tessera-runtime"
strip --strip-unneeded "$OUT"/usr/bin/tesserad "$OUT"/usr/bin/tessera "$OUT"/usr/bin/tessera-runtime

# Each shared library the dynamic binaries load, at the path the loader finds it.
for b in "$OUT/usr/bin/tesserad" "$OUT/usr/bin/tessera" "$OUT/usr/bin/tessera-runtime"; do
    ldd "$b" 2>/dev/null | awk '/=> \//{print $3} /^\t\/[^ ]+ \(/{print $1}' || true
done | sort -u | while read -r lib; do
    [ -n "$lib" ] || continue
    install -D -m 0755 "$(readlink -f "$lib")" "$OUT$lib"
done

install -m 0755 "$BUSYBOX" "$OUT/bin/busybox"
for applet in sh mkdir cp chmod mv; do ln -s busybox "$OUT/bin/$applet"; done
install -m 0755 "$(dirname "${BASH_SOURCE[0]}")/tessera-install-runtime" "$OUT/usr/bin/"
printf 'root:x:0:0:root:/:/bin/nologin\n' >"$OUT/etc/passwd"
printf 'root:x:0:\ntessera:x:999:\n' >"$OUT/etc/group"
chmod 0644 "$OUT/etc/passwd" "$OUT/etc/group"
echo "stage-rootfs: $OUT ($(du -sh "$OUT" | cut -f1))"
