#!/bin/sh
# What the trainer, the bench, the tpu tests and `python -m workflows.local` need on a TPU machine that reaches no
# package registry (docs/PERFORMANCE.md). Two halves, run on two machines:
#   sh bench/tpu_env.sh download WHEELS        where PyPI is reachable: the wheels that machine's index lacks
#   sh bench/tpu_env.sh install WHEELS TARGET  on the TPU machine: its own index (/opt/pypi/simple), then WHEELS
# then `export PYTHONPATH=$PYTHONPATH:$PWD:TARGET` (after the machine's own entries: that is where its JAX is).
# TARGET must lie outside the repository's tree.
set -eu
# The versions this project is tested with (pip freeze of its test environment); kubernetes goes in without its
# dependencies, since pip finds no set beside hera's there.
MISSING="hera==7.1.0 grain==0.2.18 array_record==0.8.6 google-cloud-storage==3.17.2"
KUBE="kubernetes==35.0.0 durationpy websocket-client requests-oauthlib oauthlib"
INDEXED="flax>=0.12,<0.13 optax>=0.2.5,<0.3 orbax-checkpoint>=0.12,<0.13 tensorstore prometheus-client psutil
google-crc32c matplotlib"
case "${1:-}" in
download)
    pip download -q --only-binary=:all: --python-version 3.11 --platform manylinux2014_x86_64 \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any -d "$2" $MISSING $KUBE
    # What the TPU machine's index has, and its own JAX beside it, stay there.
    rm -f "$2"/numpy-* "$2"/pydantic* "$2"/pyyaml-* "$2"/cryptography-* "$2"/protobuf-* "$2"/cffi-*
    ;;
install)
    pip="pip install -q --isolated --only-binary=:all: --index-url file:///opt/pypi/simple --find-links $2 --target $3"
    # shellcheck disable=SC2086
    $pip $MISSING $INDEXED
    # shellcheck disable=SC2086
    $pip --no-deps $KUBE
    ;;
*)
    echo "usage: sh bench/tpu_env.sh download WHEELS | install WHEELS TARGET" >&2
    exit 2
    ;;
esac
