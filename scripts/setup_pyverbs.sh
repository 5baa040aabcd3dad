#!/usr/bin/env bash
# Makes pyverbs (rdma-core's Python bindings) importable for the tests without installing
# anything into the system or the main environment (scripts/test.sh calls this), so that
# tests/test_rdma_pyverbs_api.py runs instead of being skipped. pyverbs is not on PyPI:
# Debian's python3-pyverbs is fetched with apt-get, as files only, and unpacked here.
#
#   .venv-pyverbs/apt/    apt-get's own lists and cache for this download (the system's
#                         sources and keys are used; /var/lib/apt and /var/cache/apt are
#                         neither read nor written, no lock is taken, no hook runs)
#   .venv-pyverbs/debs/   the .deb files: python3-pyverbs and the shared libraries its
#                         extension modules need beyond a base Debian 12 (libibverbs1,
#                         librdmacm1, libnl-3-200, libnl-route-3-200)
#   .venv-pyverbs/root/   those packages unpacked with dpkg -x
#   .venv-pyverbs/site/   for PYTHONPATH: holds only a `pyverbs` symlink into root/
#                         (the whole dist-packages would shadow our pip, setuptools...)
#   .venv-pyverbs/lib/    for LD_LIBRARY_PATH: links to the shared libraries in root/
#
# Needs apt-get and dpkg-deb (Debian/Ubuntu), the package registry the system's apt
# sources name, and a Python of the version the package was built for (Debian 12: 3.11,
# with libpython3.11 either loaded already, as a --enable-shared build does, or
# installed). No RDMA device is needed or looked for. First run: a few seconds and about
# 1.5 MB of packages (plus apt's lists, about 20 MB); later runs only check the import.
# Does nothing when PYTHON (default python3) already imports pyverbs.
#
# Environment: PYTHON, TE_PYVERBS_DIR (default .venv-pyverbs). Fails, saying why, when
# pyverbs cannot be made importable: with TE_PYVERBS_REQUIRED=1 the tests must not pass
# by skipping it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DIR=${TE_PYVERBS_DIR:-.venv-pyverbs}
PACKAGES=(python3-pyverbs libibverbs1 librdmacm1 libnl-3-200 libnl-route-3-200)
STAMP="$DIR/.te-pyverbs-ready"

fail() {
    echo "scripts/setup_pyverbs.sh: $*" >&2
    echo "scripts/setup_pyverbs.sh: tests/test_rdma_pyverbs_api.py cannot run" >&2
    exit 1
}
# Runs a command quietly; on failure shows its output and fails with the given reason.
quiet() {
    local why=$1 log
    shift
    log=$(mktemp)
    if ! "$@" >"$log" 2>&1; then
        sed 's/^/    /' "$log" >&2
        rm -f "$log"
        fail "$why"
    fi
    rm -f "$log"
}

if "$PY" -c "import pyverbs.device" >/dev/null 2>&1; then
    echo "setup_pyverbs: $PY already imports pyverbs; nothing to do"
    exit 0
fi

TAG=$("$PY" -c "import sys; print(sys.implementation.cache_tag)") \
    || fail "cannot run $PY"
WANT="${PACKAGES[*]} for $TAG"

if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ] || [ ! -e "$DIR/site/pyverbs" ] \
   || [ ! -e "$DIR/lib" ]; then
    command -v apt-get >/dev/null && command -v dpkg-deb >/dev/null \
        || fail "apt-get and dpkg-deb are needed to fetch Debian's python3-pyverbs" \
                "(on other systems install the distribution's pyverbs: docs/rdma.md)"
    start=$SECONDS
    rm -rf "$STAMP" "$DIR/debs" "$DIR/root" "$DIR/site" "$DIR/lib"
    mkdir -p "$DIR/apt/lists/partial" "$DIR/apt/cache/archives/partial" "$DIR/debs" \
        "$DIR/root" "$DIR/site"
    ABS=$(cd "$DIR" && pwd)
    : > "$ABS/apt/status"
    # Private state: apt-get neither reads nor changes the system's package lists, cache,
    # dpkg status or locks, and the hooks of /etc/apt/apt.conf.d (cache clean-up,
    # AppStream refresh) do not run. Sources, keys, proxies still come from /etc/apt.
    cat > "$ABS/apt/apt.conf" <<EOF
#clear APT::Update::Pre-Invoke;
#clear APT::Update::Post-Invoke;
#clear APT::Update::Post-Invoke-Success;
#clear DPkg::Pre-Invoke;
#clear DPkg::Post-Invoke;
Dir::State "$ABS/apt";
Dir::State::Lists "$ABS/apt/lists";
Dir::State::status "$ABS/apt/status";
Dir::Cache "$ABS/apt/cache";
Debug::NoLocking "true";
APT::Sandbox::User "root";
EOF
    APT=(apt-get -qq -c "$ABS/apt/apt.conf")
    quiet "apt-get update failed (is the package registry reachable? apt's output is above)" \
        "${APT[@]}" --error-on=any update
    quiet "apt-get could not download ${PACKAGES[*]} (apt's output is above)" \
        bash -c 'cd "$1" && shift && exec "$@"' _ "$ABS/debs" "${APT[@]}" download \
        "${PACKAGES[@]}"
    for deb in "$DIR"/debs/*.deb; do
        quiet "cannot unpack $deb" dpkg-deb -x "$deb" "$DIR/root"
    done
    pkg=$(find "$DIR/root" -type d -name pyverbs -path '*/dist-packages/pyverbs' | head -n 1)
    [ -n "$pkg" ] || fail "python3-pyverbs holds no dist-packages/pyverbs folder"
    # Debian 12 is not merged-/usr inside its packages: libnl-3 lies in /lib/<triplet>,
    # the others in /usr/lib/<triplet>. lib/ gathers them all, as relative links.
    mkdir "$DIR/lib"
    find "$DIR/root/lib" "$DIR/root/usr/lib" -mindepth 2 -maxdepth 2 -name 'lib*.so*' \
        -path '*-linux-*/*' 2>/dev/null | while read -r so; do
        ln -s "../${so#"$DIR"/}" "$DIR/lib/"
    done
    [ -e "$DIR/lib/libibverbs.so.1" ] || fail "libibverbs1 holds no libibverbs.so.1"
    # (relative links: the folder may be moved or copied with the checkout)
    ln -s "../${pkg#"$DIR"/}" "$DIR/site/pyverbs"
    fetched=$((SECONDS - start))
fi

# Checked on every run: the modules the tests use import, with every library they link
# that the packages above provide (libibverbs, librdmacm, libnl) taken from lib/.
ROOT=$(cd "$DIR/root" && pwd -P)
VERSION=$(dpkg-deb -f "$DIR"/debs/python3-pyverbs_*.deb Version 2>/dev/null || echo "?")
PYTHONPATH="$DIR/site${PYTHONPATH:+:$PYTHONPATH}" \
LD_LIBRARY_PATH="$DIR/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    "$PY" - "$DIR/site" "$ROOT" <<'PYEOF' || { rm -f "$STAMP"; fail "pyverbs from $DIR does not import into $PY (see above)"; }
import importlib.machinery, os, pathlib, sys
site, root = sys.argv[1], sys.argv[2]
built = sorted(pathlib.Path(site, "pyverbs").glob("*.so"))
ours = tuple(x for x in importlib.machinery.EXTENSION_SUFFIXES if sys.implementation.cache_tag in x)
if not any(p.name.endswith(ours) for p in built):
    sys.exit(f"its extension modules ({built[0].name if built else 'none'}, ...) are not "
             f"built for this Python ({sys.implementation.cache_tag}); use the Python "
             "version the distribution's python3 has (Debian 12: 3.11)")
import pyverbs  # noqa: E402
if not os.path.realpath(pyverbs.__file__).startswith(root + "/"):
    sys.exit(f"pyverbs was imported from {pyverbs.__file__}, not from {site}")
import pyverbs.cmid, pyverbs.cq, pyverbs.device, pyverbs.pd, pyverbs.qp, pyverbs.wr  # noqa
loaded = {os.path.basename(p).split(".so")[0]: os.path.realpath(p)
          for p in open("/proc/self/maps").read().split() if ".so" in p}
for name in ("libibverbs", "librdmacm", "libnl-3", "libnl-route-3"):
    if not loaded.get(name, "").startswith(root + "/"):
        sys.exit(f"{name} was loaded from {loaded.get(name)}, not from {root}")
PYEOF
echo "$WANT" > "$STAMP"
echo "setup_pyverbs: pyverbs $VERSION in $DIR/site (PYTHONPATH), its libraries in" \
     "$DIR/lib (LD_LIBRARY_PATH)${fetched:+; fetched in $fetched s}"
