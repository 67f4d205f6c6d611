# shellcheck shell=bash
# Shared settings of tests/moto/install.sh and tests/moto/moto.sh: which moto
# (getmoto/moto, an emulator of the AWS APIs) the cloud tests run, and where its
# virtual environment is cached. Sourced, never run.
# shellcheck disable=SC2034 # the variables are used by the scripts that source this

# Pinned: the newest release on PyPI when the AWS provider was written (issue 18).
# Its EC2 behaviour, and where it differs from AWS's, is recorded in
# docs/kubernetes.md ("Running on AWS"); check that table when raising the pin.
EGRET_MOTO_VERSION=${EGRET_MOTO_VERSION:-5.2.5}

# Outside the clone, so that fresh clones (CI) reuse it.
EGRET_MOTO_VENV=${EGRET_MOTO_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/egret/moto-$EGRET_MOTO_VERSION}
EGRET_MOTO_SERVER_BIN=$EGRET_MOTO_VENV/bin/moto_server
