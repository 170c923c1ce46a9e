#!/bin/sh
# The Python package's tests (python/tests, pytest) against the library and
# the starling binary this build made (STARLING_LIBRARY, STARLING). Skips
# (77) when /usr/bin/python3 lacks torch or pytest (Debian: python3-torch,
# python3-pytest).
PY=/usr/bin/python3
[ -x "$PY" ] || { echo "skip: no $PY"; exit 77; }
"$PY" -c 'import torch, pytest' 2>/dev/null ||
    { echo "skip: $PY lacks torch or pytest (apt-get install python3-torch python3-pytest)"; exit 77; }
: "${STARLING_LIBRARY:?}" "${STARLING:?}" "${STARLING_SOURCE_ROOT:?}"
cd "$STARLING_SOURCE_ROOT" || exit 1
export PYTHONPATH="$STARLING_SOURCE_ROOT/python${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1 OPENBLAS_NUM_THREADS=1
exec "$PY" -m pytest -q -x -p no:cacheprovider python/tests
