#!/bin/sh
# The Python package installs into a fresh venv (Debian's python3-venv,
# --system-site-packages for torch) with pip, offline, from a copy of
# python/, taking the library this build made (STARLING_BUILD_DIR), and the
# installed package loads its own copy of that library. Skips (77) when
# /usr/bin/python3 lacks torch, pytest or venv.
PY=/usr/bin/python3
[ -x "$PY" ] || { echo "skip: no $PY"; exit 77; }
"$PY" -c 'import torch, pytest, ensurepip' 2>/dev/null ||
    { echo "skip: $PY lacks torch, pytest or venv (apt-get install python3-torch python3-pytest python3-venv)"; exit 77; }
: "${STARLING_LIBRARY:?}" "${STARLING_SOURCE_ROOT:?}"
BUILT=$STARLING_LIBRARY
BUILD=$(cd "$(dirname "$BUILT")/.." && pwd) || exit 1
T=$(mktemp -d "${TMPDIR:-/tmp}/starling-pyinstall-XXXXXX") || exit 1
trap 'rm -rf "$T"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
# A copy of python/ beside a copy of meson.build (setup.py's fallback for
# the version), so the build writes nothing into the checkout.
mkdir "$T/src" && cp "$STARLING_SOURCE_ROOT/meson.build" "$T/src/" &&
    (cd "$STARLING_SOURCE_ROOT" && tar -cf - --exclude=__pycache__ --exclude='*.egg-info' --exclude=build \
        --exclude=libstarling.so python) | (cd "$T/src" && tar -xf -) || fail "copying python/"
"$PY" -m venv --system-site-packages "$T/venv" || fail "venv"
unset PYTHONPATH STARLING_LIBRARY
# Without a built library: a clear refusal.
STARLING_BUILD_DIR="$T/nothing" "$T/venv/bin/python" -m pip install -q --no-build-isolation --no-index \
    "$T/src/python" >"$T/nolib.out" 2>&1 && fail "pip installed without a library"
grep -q "build Starling first" "$T/nolib.out" || { cat "$T/nolib.out" >&2; fail "no clear message without a library"; }
STARLING_BUILD_DIR="$BUILD" "$T/venv/bin/python" -m pip install -q --no-build-isolation --no-index \
    "$T/src/python" || fail "pip install"
cd "$T" || exit 1
out=$("$T/venv/bin/python" -c "import starling; print(starling.__file__, starling.library_path()); print(starling.version())") ||
    fail "import starling in the venv"
echo "$out"
file=$(echo "$out" | head -1 | cut -d' ' -f1)
lib=$(echo "$out" | head -1 | cut -d' ' -f2)
case "$file" in "$T/venv/"*) ;; *) fail "starling imported from $file, not the venv" ;; esac
[ "$lib" = "$(dirname "$file")/libstarling.so" ] || fail "library $lib is not the packaged copy"
cmp -s "$lib" "$BUILT" || fail "the packaged library differs from the build's"
echo "$out" | tail -1 | grep -qx '0.1.0' || fail "version"
"$T/venv/bin/python" -m pip show starling | grep -q '^Version: 0.1.0' || fail "pip show: version"
echo ok
