"""Builds the starling package (docs/python.md).

At build time the libstarling.so that meson built is copied into the
package, so that `import starling` loads the library it was installed
with. Where it is taken from: $STARLING_BUILD_DIR/capi/libstarling.so
(a relative STARLING_BUILD_DIR is taken from the checkout's root), else
../build/capi/, else ../build-release/capi/ (relative to this directory).

    python3 -m pip install --no-build-isolation --no-index ./python
"""
import ctypes
import os
import re
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
LIB = "libstarling.so"


def find_library():
    bd = os.environ.get("STARLING_BUILD_DIR")
    if bd:
        cands = [os.path.join(bd if os.path.isabs(bd) else os.path.join(ROOT, bd), "capi", LIB)]
    else:
        cands = [os.path.join(ROOT, d, "capi", LIB) for d in ("build", "build-release")]
    for c in cands:
        if os.path.isfile(c):
            return c
    raise SystemExit("starling: %s not found (looked at %s): build Starling first: meson setup build && "
                     "ninja -C build (or set STARLING_BUILD_DIR to your build directory)"
                     % (LIB, ", ".join(cands)))


def library_version(path):
    """The C library's version string; meson.build's project version if
    the library cannot be loaded here."""
    try:
        lib = ctypes.CDLL(path)
        lib.starling_version.restype = ctypes.c_char_p
        return lib.starling_version().decode()
    except (OSError, AttributeError):
        with open(os.path.join(ROOT, "meson.build")) as f:
            m = re.search(r"version:\s*'([^']+)'", f.read())
        if not m:
            raise SystemExit("starling: cannot tell the library's version")
        return m.group(1)


class BuildPy(build_py):
    """build_py that also copies libstarling.so into the package."""

    def run(self):
        super().run()
        src = find_library()
        dst = os.path.join(self.build_lib, "starling", LIB)
        self.mkpath(os.path.dirname(dst))
        shutil.copyfile(src, dst)
        os.chmod(dst, 0o755)
        self.announce("copied %s -> %s" % (src, dst), level=2)


class BinaryDistribution(Distribution):
    """The wheel holds a shared library: a platform wheel."""

    def has_ext_modules(self):
        return True


LIBPATH = find_library()

setup(
    name="starling",
    version=library_version(LIBPATH),
    description="PyTorch modules over a Starling swarm's remote stages (ctypes over libstarling)",
    license="MIT",
    python_requires=">=3.9",
    packages=["starling"],
    package_dir={"starling": os.path.relpath(os.path.join(HERE, "starling"), HERE)},
    cmdclass={"build_py": BuildPy},
    distclass=BinaryDistribution,
    zip_safe=False,
)
