#!/usr/bin/env bash
# tools/bundle.sh: packs a relocatable bundle of a CUDA build, to run the GPU
# checks (tools/gpu-check.sh) on a machine that has the NVIDIA driver and the
# CUDA 13 runtime libraries but no compiler, no internet, and perhaps none of
# our Debian libraries.
#
# Usage: tools/bundle.sh [--build DIR] [--out FILE] [--extra DIR]... [options]
#   --build DIR       use this build directory (it is brought up to date with
#                     ninja). Default: build-bundle, configured when missing
#                     with: meson setup build-bundle -Dbuildtype=release -Dgpu_arch=90
#                     -Dcuda=enabled -Dtests=true
#   --no-build        do not run ninja (use the build directory as it is)
#   --out FILE        the bundle (default out/starling-bundle.tar.xz; the
#                     staging directory starling-bundle/ sits beside it)
#   --extra DIR       copy DIR verbatim into the bundle as <bundle>/$(basename
#                     DIR) (repeatable). gpu-check.sh looks for the PyTorch
#                     reference in <bundle>/torch: --extra ../shared/bench/torch
#   --allow-no-cuda   bundle a build without CUDA (to test the packing: the
#                     GPU tests then skip)
#   --fmnist N,M      ship the first N training and M test images of
#                     Fashion-MNIST (default 6000,2000: tests/test_swarm_device.sh
#                     trains on that many); 0 ships none
#   --max-mib N       fail when the bundle is bigger (default 48)
#   -h, --help        this text
#
# The bundle (starling-bundle/):
#   bin/        starling and every executable of the build (tests, benchmarks,
#               helpers; no fuzz targets), stripped, RUNPATH $ORIGIN/../lib
#   lib/        every shared library they link (ldd), stripped, RUNPATH
#               $ORIGIN; not glibc's (libc, libm, libpthread, libdl, librt,
#               libresolv, ld-linux, ...) nor CUDA's (libcuda, libcudart,
#               libcublas, libcublasLt, libcudnn*, libnvrtc*, libnvJitLink,
#               libnvidia-*), which the GPU machine provides
#   lib/compat/ the C++ runtime (libstdc++, libgcc_s), off the RUNPATH: the
#               GPU machine's is used (ours needs only CXXABI_1.3, GCC_4.3;
#               Debian 12's libstdc++ needs glibc 2.36, our binaries 2.34);
#               gpu-check.sh adds lib/compat to LD_LIBRARY_PATH when the
#               machine has none
#   build/      the build tree's layout as links into bin/ and lib/, so that
#               scripts taking a BUILD_DIR (tests/bench/*.sh) run unchanged
#   tools/gpu-check.sh, gpu-tests.tsv (its list of GPU tests and benchmarks)
#   tests/      what those tests read: the GPU script tests, swarm_lib.sh,
#               tests/ref/, tests/bench/gpu_* and bench_lib.sh, and
#               tests/bench/fortunes.bin (gpu_lm_bench.sh's corpus, made from
#               the fortunes packages as train_lm.py reads them); docs/*.md
#               and expert/*.c when a script uses them as a text corpus
#   data/fashion-mnist/   a prefix of the data set, as IDX files
#   BUNDLE-INFO.txt   commit, build options, glibc needed, CUDA libraries needed
# Then out/starling-bundle.tar.xz (xz -9), its size, and a self-check: the
# bundle extracted into a temporary directory, ldd (LD_LIBRARY_PATH unset) on
# every binary resolves everything but CUDA's libraries and the C++ runtime
# from inside it, and those too with LD_LIBRARY_PATH=lib/compat; bin/starling
# runs.
#
# With the device tool (the working tree is copied there; ignored files only
# when carried):
#   here:   tools/bundle.sh --extra ../shared/bench/torch
#   run:    carry ["out/starling-bundle.tar.xz"], command
#           tar xJf out/starling-bundle.tar.xz && starling-bundle/tools/gpu-check.sh
#           (logs land in $OUT; without xz there: python3 -c 'import tarfile;
#           tarfile.open("out/starling-bundle.tar.xz").extractall()')
# Exit status: 0 bundle written and checked, 1 failure, 2 usage error.
set -u -o pipefail

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
die() { echo "bundle: error: $*" >&2; exit 1; }
say() { echo "== $*"; }

cd "$(dirname "$0")/.." || exit 1
SRC=$PWD

BUILD="" OUTFILE=out/starling-bundle.tar.xz EXTRAS=() ALLOW_NO_CUDA=0 DO_BUILD=1 MAX_MIB=48 FMNIST=6000,2000
while [ $# -gt 0 ]; do
    case "$1" in
    --build) [ $# -ge 2 ] || { echo "bundle: --build needs a directory" >&2; exit 2; }; BUILD=$2; shift ;;
    --no-build) DO_BUILD=0 ;;
    --out) [ $# -ge 2 ] || { echo "bundle: --out needs a file name" >&2; exit 2; }; OUTFILE=$2; shift ;;
    --extra)
        [ $# -ge 2 ] || { echo "bundle: --extra needs a directory" >&2; exit 2; }
        [ -d "$2" ] || { echo "bundle: --extra $2: no such directory" >&2; exit 2; }
        EXTRAS+=("$2"); shift ;;
    --allow-no-cuda) ALLOW_NO_CUDA=1 ;;
    --fmnist)
        [ $# -ge 2 ] || { echo "bundle: --fmnist needs N,M or 0" >&2; exit 2; }
        case "$2" in 0|[0-9]*,[0-9]*) FMNIST=$2 ;; *) echo "bundle: --fmnist $2: want N,M or 0" >&2; exit 2 ;; esac
        shift ;;
    --max-mib)
        [ $# -ge 2 ] || { echo "bundle: --max-mib needs a number" >&2; exit 2; }
        case "$2" in ''|*[!0-9]*) echo "bundle: --max-mib $2: not a number" >&2; exit 2 ;; esac
        MAX_MIB=$2; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "bundle: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
    shift
done

# shellcheck source=tools/deps.sh disable=SC1091
. tools/deps.sh
need_tools=()
command -v patchelf >/dev/null || need_tools+=(patchelf)
command -v xz >/dev/null || need_tools+=(xz-utils)
{ command -v strip >/dev/null && command -v objdump >/dev/null; } || need_tools+=(binutils)
if [ "${#need_tools[@]}" -gt 0 ]; then
    starling_install_deps "${need_tools[@]}" || die "cannot install ${need_tools[*]} (needed to pack)"
fi
for c in meson ninja python3 patchelf xz strip objdump ldd tar; do
    command -v "$c" >/dev/null || die "'$c' is missing"
done

# ---- the build ----
if [ -z "$BUILD" ]; then
    BUILD=build-bundle
    if [ ! -f "$BUILD/build.ninja" ]; then
        say "configure $BUILD (release, CUDA, tests)"
        wipe=()
        [ -d "$BUILD/meson-private" ] && wipe=(--wipe)
        if ! meson setup "${wipe[@]}" "$BUILD" -Dbuildtype=release -Dcuda=enabled -Dtests=true -Dgpu_arch=90; then
            die "meson setup $BUILD -Dcuda=enabled failed: is nvcc (/usr/local/cuda/bin) on PATH or CUDA_HOME set, and are cudart, cuBLAS and cuBLASLt installed? To test the packing alone: tools/bundle.sh --build build-nocuda --allow-no-cuda"
        fi
    fi
fi
[ -f "$BUILD/build.ninja" ] || die "$BUILD is not a configured meson build directory"
BUILD=$(cd "$BUILD" && pwd)
mkdir -p "$(dirname "$OUTFILE")" || die "cannot create $(dirname "$OUTFILE")"
OUTDIR=$(cd "$(dirname "$OUTFILE")" && pwd)
OUTFILE=$OUTDIR/$(basename "$OUTFILE")
if [ "$DO_BUILD" = 1 ]; then
    say "build $BUILD"
    log=$OUTDIR/bundle-build.log
    stale=""
    [ -f "$OUTFILE" ] && stale=" (The older $OUTFILE, of $(date -r "$OUTFILE" '+%Y-%m-%d %H:%M'), is still there: do not carry it by mistake.)"
    if ! ninja -C "$BUILD" >"$log" 2>&1; then
        echo "---- the first errors (all of it: $log)"
        grep -E -A12 '^FAILED:' "$log" | head -60
        cuda_fail=$(grep -E '^FAILED:' "$log" | grep -c '\.cu\.o\|cuda/')
        if [ "$cuda_fail" -gt 0 ]; then
            die "the CUDA build failed ($cuda_fail CUDA object(s) above; cuda/*.cu may be mid-edit). Nothing was bundled.$stale To test the packing alone: tools/bundle.sh --build build-nocuda --allow-no-cuda"
        fi
        die "ninja -C $BUILD failed (see above). Nothing was bundled.$stale"
    fi
    tail -1 "$log"
fi
if grep -q '#define HAVE_CUDA 1' "$BUILD/config.h" 2>/dev/null; then
    CUDA=yes
else
    CUDA=no
    [ "$ALLOW_NO_CUDA" = 1 ] ||
        die "$BUILD was built without CUDA (config.h: HAVE_CUDA 0): the GPU tests would only skip. Use a CUDA build (the default build-bundle), or --allow-no-cuda to test the packing"
    echo "WARNING: $BUILD has no CUDA: a CPU-only bundle (--allow-no-cuda); its GPU tests skip"
fi
buildtype=$(meson introspect "$BUILD" --buildoptions 2>/dev/null |
    python3 -c 'import json,sys; print({o["name"]: o["value"] for o in json.load(sys.stdin)}.get("buildtype", "?"))')
case "$buildtype" in release|debugoptimized) ;; *) echo "WARNING: $BUILD is a '$buildtype' build (timings will not be representative)" ;; esac

# ---- the executables and shared libraries meson built ----
targets=$(meson introspect "$BUILD" --targets | python3 -c '
import json, sys
for t in json.load(sys.stdin):
    if t["type"] not in ("executable", "shared library") or t["name"].startswith("fuzz"):
        continue
    for f in t["filename"]:
        print(t["type"].split()[0] + "\t" + f)
') || die "meson introspect $BUILD --targets failed"
grep -q "	$BUILD/tools/starling$" <<<"$targets" || die "no tools/starling among $BUILD's targets"
grep -q '/tests/' <<<"$targets" || die "$BUILD has no tests (configure it with -Dtests=true)"

STAGE=$OUTDIR/starling-bundle
[ -e "$STAGE" ] && { chmod -R u+w "$STAGE" 2>/dev/null; rm -rf "$STAGE"; }
mkdir -p "$STAGE/bin" "$STAGE/lib" "$STAGE/build" "$STAGE/tools" "$STAGE/tests" || die "cannot create $STAGE"

# mirror REL TARGET: $STAGE/build/REL, a relative link to $STAGE/TARGET.
mirror() {
    local link=$STAGE/build/$1
    mkdir -p "$(dirname "$link")" || return 1
    ln -sfn "$(realpath -m --relative-to="$(dirname "$link")" "$STAGE/$2")" "$link"
}

say "copy the executables"
exes=() n=0
while IFS=$'\t' read -r kind f; do
    [ -f "$f" ] || die "$f is listed by meson but not built"
    rel=${f#"$BUILD"/}
    if [ "$kind" = executable ]; then
        name=$(basename "$f")
        [ -e "$STAGE/bin/$name" ] && die "two executables are named $name ($rel): bin/ cannot hold both"
        cp -L "$f" "$STAGE/bin/$name" || die "cannot copy $f"
        mirror "$rel" "bin/$name" || die "cannot link build/$rel"
        exes+=("$f"); n=$((n + 1))
    fi
done <<<"$targets"
echo "$n executables"

is_glibc() { [[ $1 =~ ^(libc|libm|libmvec|libpthread|libdl|librt|libresolv|libutil|libanl|libnsl|libBrokenLocale|libthread_db)\.so|^ld-linux|^linux-vdso|^linux-gate ]]; }
is_cuda() { [[ $1 =~ ^lib(cuda|cudart|cublas|cublasLt|cudnn[A-Za-z_]*|nvrtc[A-Za-z_.-]*|nvJitLink|nvidia-[A-Za-z_-]*)\.so ]]; }
# The C++ runtime goes to lib/compat/, off the RUNPATH: every machine with
# PyTorch or CUDA has one, ours needs only CXXABI_1.3 and GCC_4.3, and this
# machine's libstdc++ needs a newer glibc (2.36) than our binaries (2.34).
# gpu-check.sh adds lib/compat to LD_LIBRARY_PATH when the system has none.
is_compat() { [[ $1 =~ ^(libstdc\+\+|libgcc_s)\.so ]]; }

say "copy the shared libraries they link"
declare -A LIBSRC=()
cuda_needed=""
for f in "${exes[@]}"; do
    out=$(env -u LD_LIBRARY_PATH ldd "$f" 2>&1) || die "ldd $f failed: $out"
    while read -r name arrow path _; do
        [ "$arrow" = "=>" ] || continue
        if is_glibc "$name"; then continue; fi
        if is_cuda "$name"; then cuda_needed="$cuda_needed $name"; continue; fi
        [ "$path" = not ] && die "$(basename "$f") links $name, which ldd does not find here"
        if [ -n "${LIBSRC[$name]:-}" ] && [ "${LIBSRC[$name]}" != "$path" ]; then
            echo "WARNING: $name resolves to ${LIBSRC[$name]} and $path; bundling the first"
            continue
        fi
        LIBSRC[$name]=$path
    done <<<"$out"
done
# The project's shared libraries (libstarling), linked or not.
while IFS=$'\t' read -r kind f; do
    [ "$kind" = shared ] || continue
    soname=$(objdump -p "$f" | awk '$1 == "SONAME" { print $2 }')
    [ -n "$soname" ] || soname=$(basename "$f")
    LIBSRC[$soname]=$f
    rel=${f#"$BUILD"/}
    mirror "$rel" "lib/$soname"
    mirror "$(dirname "$rel")/$soname" "lib/$soname"
    mirror "$(dirname "$rel")/${soname%%.so*}.so" "lib/$soname"
done <<<"$targets"
mkdir -p "$STAGE/lib/compat"
for name in "${!LIBSRC[@]}"; do
    dest=lib/$name
    is_compat "$name" && dest=lib/compat/$name
    cp -L "${LIBSRC[$name]}" "$STAGE/$dest" || die "cannot copy ${LIBSRC[$name]}"
    echo "  $dest  <- ${LIBSRC[$name]}"
done | sort
cuda_needed=$(echo "$cuda_needed" | tr ' ' '\n' | grep . | sort -u | tr '\n' ' ')
echo "CUDA libraries left to the GPU machine: ${cuda_needed:-none}"
[ "$CUDA" = yes ] && [ -z "$cuda_needed" ] && echo "WARNING: a CUDA build that links no CUDA library?"

say "strip, and set RUNPATHs"
chmod -R u+w "$STAGE/bin" "$STAGE/lib"
for f in "$STAGE"/bin/* "$STAGE"/lib/*.so* "$STAGE"/lib/compat/*; do
    [ -f "$f" ] || continue
    strip --strip-unneeded "$f" 2>/dev/null || echo "WARNING: strip failed on $(basename "$f")"
done
# shellcheck disable=SC2016  # $ORIGIN is for the dynamic loader, not the shell
for f in "$STAGE"/bin/*; do
    patchelf --set-rpath '$ORIGIN/../lib' "$f" || die "patchelf failed on $f"
done
# shellcheck disable=SC2016
for f in "$STAGE"/lib/*.so* "$STAGE"/lib/compat/*; do
    [ -f "$f" ] || continue
    patchelf --set-rpath '$ORIGIN' "$f" || die "patchelf failed on $f"
done

# ---- scripts and the data they read ----
say "copy gpu-check.sh and what its tests read"
cp tools/gpu-check.sh "$STAGE/tools/" || die "cannot copy tools/gpu-check.sh"
tools/gpu-check.sh --manifest --build "$BUILD" >"$STAGE/gpu-tests.tsv" || die "gpu-check.sh --manifest failed"
sed 's/^\([a-z]*\)\t\([^\t]*\).*/  \1 \2/' "$STAGE/gpu-tests.tsv"
# Files of the source tree the GPU tests name (@SRC@/...).
mapfile -t srcfiles < <(grep -o "@SRC@/[^']*" "$STAGE/gpu-tests.tsv" | sed 's|^@SRC@/||' | sort -u)
scripts=()
for rel in "${srcfiles[@]}"; do
    [ -e "$rel" ] || { echo "WARNING: a GPU test names $rel, which is missing"; continue; }
    [ -f "$rel" ] || continue   # directories (e.g. STARLING_SOURCE_ROOT itself)
    { mkdir -p "$STAGE/$(dirname "$rel")" && cp "$rel" "$STAGE/$rel"; } || die "cannot copy $rel"
    case "$rel" in *.sh) scripts+=("$rel") ;; esac
done
for rel in tests/bench/gpu_*.sh tests/bench/gpu_*.py; do
    [ -f "$rel" ] || continue
    { mkdir -p "$STAGE/tests/bench" && cp "$rel" "$STAGE/$rel"; } || die "cannot copy $rel"
    scripts+=("$rel")
done
if grep -q 'bench_lib\.sh' "${scripts[@]}" /dev/null; then cp tests/bench/bench_lib.sh "$STAGE/tests/bench/"; fi
if grep -q 'swarm_lib\.sh' "${scripts[@]}" /dev/null; then cp tests/swarm_lib.sh "$STAGE/tests/"; fi
cp -R tests/ref "$STAGE/tests/ref" || die "cannot copy tests/ref"
# A text corpus some scripts build from the sources.
if grep -q '\.\./docs/' "${scripts[@]}" /dev/null; then
    mkdir -p "$STAGE/docs" && cp docs/*.md "$STAGE/docs/"
fi
if grep -q '\.\./expert/' "${scripts[@]}" /dev/null; then
    mkdir -p "$STAGE/expert" && cp expert/*.c "$STAGE/expert/"
fi
if [ "$FMNIST" != 0 ]; then
    fm=${FASHION_MNIST_DIR:-/usr/share/datasets/fashion-mnist}
    if [ -d "$fm" ]; then
        mkdir -p "$STAGE/data/fashion-mnist"
        python3 - "$fm" "$STAGE/data/fashion-mnist" "${FMNIST%,*}" "${FMNIST#*,}" <<'EOF' || die "cannot cut Fashion-MNIST"
import gzip, os, struct, sys
src, dst, ntrain, ntest = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
for split, n in (("train", ntrain), ("t10k", ntest)):
    for kind, hdr in (("images-idx3", 16), ("labels-idx1", 8)):
        name = f"{split}-{kind}-ubyte"
        p = os.path.join(src, name)
        f = gzip.open(p + ".gz") if os.path.exists(p + ".gz") else open(p, "rb")
        h = bytearray(f.read(hdr))
        count = struct.unpack(">I", h[4:8])[0]
        n = min(n, count)
        item = 1 if hdr == 8 else struct.unpack(">I", h[8:12])[0] * struct.unpack(">I", h[12:16])[0]
        h[4:8] = struct.pack(">I", n)
        with open(os.path.join(dst, name), "wb") as o:
            o.write(h + f.read(n * item))
EOF
        echo "Fashion-MNIST: the first ${FMNIST%,*} training and ${FMNIST#*,} test images (from $fm)"
    else
        echo "WARNING: no Fashion-MNIST in $fm: tests that train fmnist-mlp will fail unless the GPU machine has it"
    fi
fi
# gpu_lm_bench.sh's corpus without the fortunes packages: fortunes.bin beside
# it, made as ../shared/bench/torch/README.md "Corpus without apt" says.
if [ -f "$STAGE/tests/bench/gpu_lm_bench.sh" ]; then
    tl=""
    for d in "${EXTRAS[@]}" ../shared/bench/torch; do [ -f "$d/train_lm.py" ] && { tl=$d/train_lm.py; break; }; done
    if [ -z "$tl" ]; then
        echo "WARNING: no train_lm.py (--extra ../shared/bench/torch): no fortunes.bin for gpu_lm_bench.sh"
    elif python3 - "$tl" "$STAGE/tests/bench/fortunes.bin" <<'EOF'
import ast, os, re, subprocess, sys, hashlib
tl, out = sys.argv[1], sys.argv[2]
consts = {}
for n in ast.parse(open(tl).read()).body:   # train_lm.fortune_files(), without importing torch
    if isinstance(n, ast.Assign) and len(n.targets) == 1 and getattr(n.targets[0], "id", "") in ("FORTUNE_PKGS", "FORTUNE_DIR"):
        consts[n.targets[0].id] = ast.literal_eval(n.value)
files = set()
for pkg in consts.get("FORTUNE_PKGS", ()):
    r = subprocess.run(["dpkg", "-L", pkg], capture_output=True, text=True)
    for line in r.stdout.splitlines():
        p = line.strip()
        if (os.path.dirname(p) == consts.get("FORTUNE_DIR") and not p.endswith(".dat")
                and os.path.isfile(p) and not os.path.islink(p)):
            files.add(p)
if not files:
    sys.exit("the fortunes packages are not installed here")
data = b"".join(open(p, "rb").read() for p in sorted(files, key=lambda p: os.path.basename(p).encode()))
open(out, "wb").write(data)
h = hashlib.sha256(data).hexdigest()
readme = os.path.join(os.path.dirname(tl), "README.md")
want = re.findall(r"must start with ([0-9a-f]{16})", open(readme).read()) if os.path.exists(readme) else []
print(f"fortunes.bin: {len(data)} bytes, sha256 {h[:16]}" + ("" if not want or h.startswith(want[0])
      else f" -- WARNING: README.md says it must start with {want[0]}"))
EOF
    then :; else
        echo "WARNING: no fortunes.bin (above): gpu_lm_bench.sh will find no corpus unless the GPU machine has the fortunes packages"
        rm -f "$STAGE/tests/bench/fortunes.bin"
    fi
fi
for x in "${EXTRAS[@]}"; do
    b=$(basename "$(cd "$x" && pwd)")
    case "$b" in bin|lib|build|tools|tests|data|docs|expert) die "--extra $x: $b/ is the bundle's own" ;; esac
    [ -e "$STAGE/$b" ] && die "--extra $x: two extras named $b"
    cp -R "$x" "$STAGE/$b" || die "cannot copy $x"
    echo "extra: $x -> $b/"
done
chmod -R u+w "$STAGE"

# ---- BUNDLE-INFO.txt ----
glibc_of() { for f in "$@"; do [ -f "$f" ] && objdump -T "$f" 2>/dev/null; done |
    grep -o 'GLIBC_[0-9][0-9.]*' | sed 's/GLIBC_//' | sort -Vu | tail -1; }
glibc_needed=$(glibc_of "$STAGE"/bin/* "$STAGE"/lib/*.so*)
glibc_compat=$(glibc_of "$STAGE"/lib/compat/*)
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
[ -n "$(git status --porcelain 2>/dev/null | head -1)" ] && commit="$commit (with uncommitted changes)"
{
    echo "starling bundle, made $(date -u '+%Y-%m-%d %H:%M:%SZ') on $(hostname 2>/dev/null)"
    echo "commit: $commit"
    echo "cuda: $CUDA"
    echo "buildtype: $buildtype"
    echo "gpu_arch: $(meson introspect "$BUILD" --buildoptions 2>/dev/null |
        python3 -c 'import json,sys; print({o["name"]: o["value"] for o in json.load(sys.stdin)}.get("gpu_arch", "?"))')"
    nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
    echo "nvcc: $("$nvcc" --version 2>/dev/null | tail -2 | head -1)"
    echo "glibc_needed: $glibc_needed"
    echo "glibc_needed_by_lib_compat: ${glibc_compat:-none} ($(find "$STAGE/lib/compat" -type f -printf '%f ' | sort))"
    echo "cuda_libraries_needed: ${cuda_needed:-none}"
    echo "built on: $(sed -n 's/^PRETTY_NAME="*\([^"]*\)"*/\1/p' /etc/os-release 2>/dev/null), $(ldd --version | head -1)"
    echo
    echo "files:"
    (cd "$STAGE" && find . -type f -o -type l | sort | sed 's|^\./|  |')
} >"$STAGE/BUNDLE-INFO.txt"

# ---- pack ----
say "pack $OUTFILE"
rm -f "$OUTFILE"
tar -C "$OUTDIR" --owner=0 --group=0 -cf - starling-bundle | xz -9 -T0 >"$OUTFILE.tmp" ||
    { rm -f "$OUTFILE.tmp"; die "tar | xz failed"; }
mv "$OUTFILE.tmp" "$OUTFILE"
bytes=$(stat -c %s "$OUTFILE")
mib=$(awk -v b="$bytes" 'BEGIN { printf "%.1f", b / 1048576 }')
echo "contents (uncompressed):"
(cd "$STAGE" && du -sh -- * | sed 's/^/  /')
echo "$OUTFILE: $mib MiB ($bytes bytes)"
[ "$bytes" -le $((MAX_MIB * 1048576)) ] ||
    die "the bundle is $mib MiB, over the $MAX_MIB MiB limit (carry holds 64 MiB in all)"

# ---- self-check: extract elsewhere, resolve every library, run starling ----
say "self-check"
tmp=$(mktemp -d "${TMPDIR:-/tmp}/starling-bundle-check-XXXXXX") || die "mktemp failed"
trap 'rm -rf "$tmp"' EXIT
tar -C "$tmp" -xJf "$OUTFILE" || die "cannot extract $OUTFILE"
B=$tmp/starling-bundle
bad=0 checked=0
# check_ldd FILE MODE: MODE plain: LD_LIBRARY_PATH unset, the C++ runtime
# may come from the system; MODE compat: LD_LIBRARY_PATH=lib/compat, it must
# come from the bundle.
check_ldd() {
    local f=$1 mode=$2 out name arrow path
    if [ "$mode" = plain ]; then out=$(env -u LD_LIBRARY_PATH ldd "$f" 2>&1)
    else out=$(env LD_LIBRARY_PATH="$B/lib/compat" ldd "$f" 2>&1); fi ||
        { echo "  $(basename "$f"): ldd failed: $out"; bad=$((bad + 1)); return; }
    while read -r name arrow path _; do
        [ "$arrow" = "=>" ] || continue
        if is_glibc "$name" || is_cuda "$name"; then continue; fi   # the GPU machine's
        if [ "$mode" = plain ] && is_compat "$name"; then continue; fi
        if [ "$path" = not ]; then
            echo "  $(basename "$f"): $name not found ($mode)"; bad=$((bad + 1))
        elif [[ $(readlink -f "$path") != "$B"/* ]]; then
            echo "  $(basename "$f"): $name resolves outside the bundle ($path; $mode)"; bad=$((bad + 1))
        fi
    done <<<"$out"
}
for f in "$B"/bin/* "$B"/lib/*.so* "$B"/lib/compat/*; do
    [ -f "$f" ] || continue
    checked=$((checked + 1))
    check_ldd "$f" plain
    check_ldd "$f" compat
done
for l in $(cd "$B" && find build -type l); do
    [ -e "$B/$l" ] || { echo "  dangling link $l"; bad=$((bad + 1)); }
done
env -u LD_LIBRARY_PATH "$B/bin/starling" --version >/dev/null 2>&1 ||
    { echo "  bin/starling --version failed"; bad=$((bad + 1)); }
env -u LD_LIBRARY_PATH "$B/build/tools/starling" --help >/dev/null 2>&1 ||
    { echo "  build/tools/starling --help failed"; bad=$((bad + 1)); }
"$B/tools/gpu-check.sh" --help >/dev/null 2>&1 || { echo "  tools/gpu-check.sh --help failed"; bad=$((bad + 1)); }
if [ -x "$B/bin/test_cuda_device" ]; then
    env -u LD_LIBRARY_PATH "$B/bin/test_cuda_device" >/dev/null 2>&1
    rc=$?
    case "$rc" in 0|77) ;; *) echo "  bin/test_cuda_device exited $rc (want 0, or 77 without a GPU)"; bad=$((bad + 1)) ;; esac
fi
[ "$bad" -eq 0 ] || die "self-check: $bad problem(s) above"
echo "ok: $checked binaries resolve every library from the bundle (CUDA's and the C++ runtime's aside; with lib/compat on LD_LIBRARY_PATH, the C++ runtime's too), starling runs"
echo
echo "Carry $OUTFILE; on the GPU machine, from the repository root:"
echo "  tar xJf ${OUTFILE#"$SRC"/} && starling-bundle/tools/gpu-check.sh"
