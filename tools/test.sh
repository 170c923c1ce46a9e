#!/usr/bin/env bash
# tools/test.sh: install what is missing, build, run every test suite.
#
# Usage: tools/test.sh [--no-sanitize | --sanitize-only] [MESON_OPTION...]
#   e.g. tools/test.sh -Dcuda=disabled
#
# Two builds run: build/ (the normal build, warnings as errors, CUDA when
# available) and build-sanitize/ (ASan + UBSan, CPU only). The last line is
# "N passed, N failed, N skipped" summed over both; the exit status is non-zero
# when anything failed.
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 1
. tools/deps.sh

normal=1 sanitize=1
opts=()
for a in "$@"; do
    case "$a" in
    --no-sanitize) sanitize=0 ;;
    --sanitize-only) normal=0 ;;
    -h|--help) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -D*) opts+=("$a") ;;
    *) echo "tools/test.sh: unknown argument '$a' (see --help)" >&2; exit 2 ;;
    esac
done

# shellcheck disable=SC2086
starling_install_deps $STARLING_TEST_PKGS || exit 1

passed=0 failed=0 skipped=0
# run_suite BUILDDIR TIMEOUT_MULTIPLIER MESON_OPTIONS...
run_suite() {
    dir=$1; mult=$2; shift 2
    echo "== configure $dir: $*"
    if ! starling_configure "$dir" "$@"; then
        echo "== $dir: configure FAILED"; failed=$((failed + 1)); return
    fi
    echo "== build $dir"
    if ! ninja -C "$dir"; then
        echo "== $dir: build FAILED"; failed=$((failed + 1)); return
    fi
    echo "== test $dir"
    rm -f "$dir/meson-logs/testlog.json"
    meson test -C "$dir" --print-errorlogs -t "$mult" </dev/null
    log="$dir/meson-logs/testlog.json"
    if [ ! -s "$log" ]; then
        echo "== $dir: no test log"; failed=$((failed + 1)); return
    fi
    ok=$(grep -c '"result": "OK"' "$log")
    sk=$(grep -c '"result": "SKIP"' "$log")
    total=$(grep -c '"result": ' "$log")
    passed=$((passed + ok)); skipped=$((skipped + sk)); failed=$((failed + total - ok - sk))
}

if [ "$normal" = 1 ]; then
    run_suite build 1 -Dwerror=true "${opts[@]}"
fi
if [ "$sanitize" = 1 ]; then
    # CUDA stays off here: the sanitizers cannot see into device code.
    run_suite build-sanitize 3 -Dwerror=true -Dcuda=disabled -Db_sanitize=address,undefined \
        -Db_lundef=false -Dbuildtype=debug
fi

echo "$passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ]
