"""The package imports, finds its library and refuses a bogus one clearly."""
import os
import subprocess
import sys

import starling

PYDIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_imports_and_finds_library():
    path = starling.library_path()
    assert os.path.isfile(path)
    if os.environ.get("STARLING_LIBRARY"):
        assert os.path.samefile(path, os.environ["STARLING_LIBRARY"])
    assert starling.api_version() == 1
    assert starling.version() == starling.__version__ == "0.1.0"
    info = starling.model_info("fmnist-mlp")
    assert info["name"] == "fmnist-mlp" and len(info["stages"]) == 6


def test_bogus_library_is_a_clear_import_error(tmp_path):
    bogus = tmp_path / "libstarling.so"
    bogus.write_bytes(b"not a shared library")
    for lib in (str(bogus), str(tmp_path / "missing.so")):
        env = dict(os.environ, STARLING_LIBRARY=lib, PYTHONPATH=PYDIR)
        r = subprocess.run([sys.executable, "-c", "import starling"], env=env, capture_output=True, text=True,
                           timeout=60)
        assert r.returncode != 0
        assert "ImportError" in r.stderr and "STARLING_LIBRARY" in r.stderr and lib in r.stderr, r.stderr


def test_without_torch_the_swarm_api_still_imports():
    # RemoteStages alone needs torch: `import starling` must not import it.
    code = "import sys, starling; assert 'torch' not in sys.modules, 'torch imported'; print('ok')"
    env = dict(os.environ, PYTHONPATH=PYDIR)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


def test_errno_mapping():
    import errno
    import pickle
    from starling.errors import error_from_code
    want = {errno.ENOENT: starling.UnknownModelError, errno.EHOSTUNREACH: starling.UnreachableError,
            errno.EADDRNOTAVAIL: starling.UnreachableError, errno.EKEYREJECTED: starling.SwarmKeyError,
            errno.ETIMEDOUT: starling.StarlingTimeoutError, errno.ECANCELED: starling.ClosedError,
            errno.ERANGE: starling.RefusedError, errno.EINVAL: starling.InvalidArgumentError,
            errno.EIO: starling.StarlingError}
    for code, cls in want.items():
        e = error_from_code(-code, b"the sentence\0garbage after the NUL")
        assert type(e) is cls and isinstance(e, starling.StarlingError)
        assert e.errno == code and e.message == "the sentence"
        assert str(e) == "the sentence [%s]" % errno.errorcode[code]
        f = pickle.loads(pickle.dumps(e))
        assert type(f) is cls and f.errno == code and str(f) == str(e)
    assert isinstance(error_from_code(-errno.ETIMEDOUT, b""), TimeoutError)
    assert isinstance(error_from_code(-errno.EINVAL, b""), ValueError)
