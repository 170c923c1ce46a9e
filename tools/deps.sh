# tools/deps.sh: sourced by tools/test.sh and tools/quickstart.sh.
# Installs the Debian 12 packages Starling needs, when they are missing.
# libssl-dev is optional for the build (the tensor RPC's AES-GCM runs about
# twice as fast on OpenSSL's libcrypto as on libsodium; records are the same
# bytes either way), so it is installed to get the fast path. fortunes and
# fortunes-min are the language models' default corpus (train_lm.py's).

STARLING_PKGS="meson ninja-build pkg-config gcc g++ libc6-dev libuv1-dev libsodium-dev \
libmsgpack-dev uthash-dev libopenblas-dev zlib1g-dev libcmocka-dev libjansson-dev \
dataset-fashion-mnist fortunes fortunes-min python3 iproute2 procps libssl-dev"

# What the tests need beyond the build: the Python package's tests
# (python/: ctypes over libstarling, PyTorch and pytest from Debian).
STARLING_TEST_PKGS="python3-torch python3-pytest python3-venv python3-pip python3-setuptools"

# starling_install_deps [extra packages...]
starling_install_deps() {
    missing=""
    for p in $STARLING_PKGS "$@"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" ||
            missing="$missing $p"
    done
    [ -z "$missing" ] && return 0
    echo "== installing:$missing"
    if [ "$(id -u)" -eq 0 ]; then
        SUDO=""
    elif command -v sudo >/dev/null 2>&1; then
        SUDO="sudo"
    else
        echo "error: missing packages:$missing; install them as root (apt-get install$missing)" >&2
        return 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -q >/dev/null || { echo "error: apt-get update failed" >&2; return 1; }
    # shellcheck disable=SC2086
    $SUDO apt-get install -y -q --no-install-recommends $missing ||
        { echo "error: apt-get install failed" >&2; return 1; }
}

# starling_configure BUILDDIR [meson options...]: (re)configures only when the
# options changed, so repeated runs rebuild incrementally.
starling_configure() {
    dir=$1; shift
    want="$*"
    if [ -f "$dir/build.ninja" ] && [ "$(cat "$dir/.starling-opts" 2>/dev/null)" = "$want" ]; then
        return 0
    fi
    if [ -d "$dir" ]; then
        meson setup --wipe "$dir" "$@" || return 1
    else
        meson setup "$dir" "$@" || return 1
    fi
    printf '%s' "$want" >"$dir/.starling-opts"
}
