#!/usr/bin/env bash
# tools/quickstart.sh: the one command a new user runs.
#
# Installs what is missing (Debian 12, as root or with sudo), builds Starling
# in release mode into build-release/, and runs what this version can do.
# As the swarm lands (bootstrap node, peers, trainer) this script grows into
# "start a local swarm on loopback and train Fashion-MNIST".
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 1
. tools/deps.sh

starling_install_deps || exit 1
starling_configure build-release -Dbuildtype=release -Dtests=false || exit 1
ninja -C build-release || exit 1
S=build-release/tools/starling

echo
"$S" --version
echo
"$S" --help
echo

work=${STARLING_HOME:-$HOME/.starling}
mkdir -p "$work" && chmod 700 "$work"
if [ ! -f "$work/identity.key" ]; then
    echo "== creating your node identity in $work/identity.key"
    "$S" keygen --out "$work/identity.key" >/dev/null || exit 1
fi
echo "== your node ID: $("$S" keygen --show "$work/identity.key")"
echo
echo "This version builds the foundation: the CLI, identities and the data set."
echo "The local swarm (bootstrap node, peers, trainer) is not in this build yet."
