#!/usr/bin/env bash
# Build tessera_<version>_<arch>.deb from a staged `make install` (what `make deb` runs).
#
#   deploy/debian/build-deb.sh [--profile dist|release|debug] [--out DIR]
#
# The binaries must be built already for the profile (`make build` for dist, the
# default; `cargo build --bins` for debug). The package holds:
#   /usr/bin/{tesserad,tessera,tessera-runtime}   stripped
#   /lib/systemd/system/tesserad.service          enabled and started by nobody
#   /usr/lib/{sysusers,tmpfiles}.d/tessera.conf
#   /etc/tessera/{tesserad.toml,runtime.toml,seccomp/*}, /etc/apparmor.d/tessera-tenant
#                                                 conffiles
#   /usr/share/man/man1/tessera*.1.gz, bash/zsh/fish completions
#   /usr/share/tessera/{containerd,monitoring}/   the containerd snippet, alert
#                                                 rules and the Grafana dashboard
# Maintainer scripts (this folder): postinst makes the group and directories, reloads
# systemd and loads the AppArmor profile; prerm stops tesserad on remove; postrm
# purges the configuration, the state and the group on purge only.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
PROFILE=dist
OUT=""
while [ $# -gt 0 ]; do
    case "$1" in
    --profile) PROFILE=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    -h | --help) sed -n '2,20p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "build-deb: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
TARGET_DIR=${CARGO_TARGET_DIR:-$REPO/target}
OUT=${OUT:-$TARGET_DIR/deb}
for tool in dpkg-deb dpkg strip gzip md5sum; do
    command -v "$tool" >/dev/null || { echo "build-deb: $tool is missing" >&2; exit 2; }
done

VERSION=$(sed -n '/^\[workspace.package\]/,/^\[/s/^version = "\(.*\)"/\1/p' "$REPO/Cargo.toml")
ARCH=$(dpkg --print-architecture)
[ -n "$VERSION" ] || { echo "build-deb: no version in Cargo.toml" >&2; exit 2; }

STAGE=$(mktemp -d "${TMPDIR:-/tmp}/tessera-deb.XXXXXX")
trap 'rm -rf "$STAGE"' EXIT
chmod 0755 "$STAGE"

# The same install steps as `make install`, into the package's root.
make -s -C "$REPO" install DESTDIR="$STAGE" PREFIX=/usr SYSCONFDIR=/etc \
    UNITDIR=/lib/systemd/system PROFILE="$PROFILE" TARGET_DIR="$TARGET_DIR" >/dev/null

for b in tesserad tessera tessera-runtime; do
    strip --strip-unneeded --remove-section=.comment --remove-section=.note "$STAGE/usr/bin/$b"
done

# Man pages and completions, from the CLI's own definition.
MAN=$STAGE/usr/share/man/man1
"$STAGE/usr/bin/tessera" manpages "$MAN" >/dev/null
install -d -m 0755 "$STAGE/usr/share/man/man8"
install -m 0644 "$HERE/man/tesserad.8" "$HERE/man/tessera-runtime.8" "$STAGE/usr/share/man/man8/"
gzip -9n "$MAN"/*.1 "$STAGE/usr/share/man/man8"/*.8
install -d -m 0755 "$STAGE/usr/share/bash-completion/completions" \
    "$STAGE/usr/share/zsh/vendor-completions" "$STAGE/usr/share/fish/vendor_completions.d"
"$STAGE/usr/bin/tessera" completion bash >"$STAGE/usr/share/bash-completion/completions/tessera"
"$STAGE/usr/bin/tessera" completion zsh >"$STAGE/usr/share/zsh/vendor-completions/_tessera"
"$STAGE/usr/bin/tessera" completion fish >"$STAGE/usr/share/fish/vendor_completions.d/tessera.fish"

# What operators merge into other software's configuration.
install -D -m 0644 "$REPO/configs/containerd/tessera-runtime.toml" \
    "$STAGE/usr/share/tessera/containerd/tessera-runtime.toml"
install -D -m 0644 "$REPO/deploy/monitoring/prometheus/tessera-alerts.yaml" \
    "$STAGE/usr/share/tessera/monitoring/tessera-alerts.yaml"
install -D -m 0644 "$REPO/deploy/monitoring/grafana/tessera-dashboard.json" \
    "$STAGE/usr/share/tessera/monitoring/tessera-dashboard.json"

DOC=$STAGE/usr/share/doc/tessera
install -D -m 0644 "$HERE/copyright" "$DOC/copyright"
install -m 0644 "$REPO/README.md" "$DOC/README.md"
gzip -9n "$DOC/README.md"
{
    printf 'tessera (%s) unstable; urgency=medium\n\n' "$VERSION"
    printf '  * Built from the tessera repository at %s.\n\n' \
        "$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)"
    printf ' -- Tessera maintainers <tessera-maintainers@lists.tessera.dev>  %s\n' \
        "$(date -R -d "@$(git -C "$REPO" log -1 --format=%ct 2>/dev/null || date +%s)")"
} | gzip -9n >"$DOC/changelog.gz"
install -D -m 0644 "$HERE/lintian-overrides" "$STAGE/usr/share/lintian/overrides/tessera"

# Depends: the shared libraries the binaries need, by package, glibc at the newest
# symbol version they use.
needed=$(for b in "$STAGE"/usr/bin/*; do objdump -p "$b" | awk '/NEEDED/{print $2}'; done | sort -u)
deps=()
for lib in $needed; do
    path=$(ldconfig -p | awk -v l="$lib" '$1 == l {print $NF; exit}')
    [ -n "$path" ] || { echo "build-deb: $lib is not on this machine" >&2; exit 1; }
    pkg=$(dpkg -S "$(readlink -f "$path")" 2>/dev/null | head -1 | cut -d: -f1) ||
        pkg=$(dpkg -S "$path" | head -1 | cut -d: -f1)
    [ -n "$pkg" ] || { echo "build-deb: no package owns $path" >&2; exit 1; }
    if [ "$pkg" = libc6 ]; then
        glibc=$(for b in "$STAGE"/usr/bin/*; do objdump -T "$b"; done |
            grep -o 'GLIBC_[0-9.]*' | sed 's/GLIBC_//' | sort -uV | tail -1)
        deps+=("libc6 (>= $glibc)")
    else
        deps+=("$pkg")
    fi
done
DEPENDS=$(printf '%s\n' "${deps[@]}" | sort -u | paste -sd, | sed 's/,/, /g')

install -d -m 0755 "$STAGE/DEBIAN"
SIZE=$(du -sk --exclude=DEBIAN "$STAGE" | cut -f1)
sed -e "s/@VERSION@/$VERSION/" -e "s/@ARCH@/$ARCH/" -e "s/@SIZE@/$SIZE/" \
    -e "s/@DEPENDS@/$DEPENDS/" "$HERE/control.in" >"$STAGE/DEBIAN/control"
for s in postinst prerm postrm; do install -m 0755 "$HERE/$s" "$STAGE/DEBIAN/$s"; done
(cd "$STAGE" && find etc -type f | sort | sed 's|^|/|') >"$STAGE/DEBIAN/conffiles"
(cd "$STAGE" && find . -path ./DEBIAN -prune -o -type f -printf '%P\n' | sort |
    xargs md5sum) >"$STAGE/DEBIAN/md5sums"
chmod 0644 "$STAGE/DEBIAN/control" "$STAGE/DEBIAN/conffiles" "$STAGE/DEBIAN/md5sums"

mkdir -p "$OUT"
DEB=$OUT/tessera_${VERSION}_${ARCH}.deb
dpkg-deb --root-owner-group -Zxz --build "$STAGE" "$DEB" >/dev/null
echo "build-deb: $DEB ($(du -h "$DEB" | cut -f1), installed $SIZE KiB; Depends: $DEPENDS)"
