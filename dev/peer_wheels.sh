#!/usr/bin/env bash
# The cuDNN-frontend peer (nvidia-cudnn-frontend 1.32.0 and its CuTe DSL wheels, cp312) for the
# GPU machine, which cannot download. About 111 MB: more than one device call carries (64 MiB),
# so the wheels travel in two stages, each an ignored folder under .peer/.
#
#   bash dev/peer_wheels.sh download   # here: the wheels into .peer/stage1 and .peer/stage2
#   bash dev/peer_wheels.sh stage1     # device call 1 (carry .peer/stage1): keep them in $KEEP
#   bash dev/peer_wheels.sh install    # device call 2 (carry .peer/stage2): join, install into
#                                      # $SITE; then run the peers in the same call with
#                                      # PYTHONPATH=$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages
# The second call must come while the machine is still warm (about 30 s after the first).
set -euo pipefail
cd "$(dirname "$0")/.."
KEEP=${KEEP:-/root/peer_wheels}
SITE=${SITE:-/tmp/site}
WHEELS=("nvidia-cudnn-frontend==1.32.0" "nvidia-cutlass-dsl==4.8.1"
        "nvidia-cutlass-dsl-libs-base==4.8.1" "nvidia-cutlass-dsl-libs-core==4.8.1"
        "nvidia-cutlass-dsl-libs-cu13==4.8.1" "apache-tvm-ffi==0.1.15.post2")
case "${1:-}" in
  download)
    rm -rf .peer && mkdir -p .peer/all .peer/stage1 .peer/stage2
    for w in "${WHEELS[@]}"; do
      python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .peer/all "$w"
    done
    big=$(ls .peer/all/nvidia_cutlass_dsl_libs_cu13-*.whl)
    split -b 50m "$big" ".peer/stage1/$(basename "$big").part_"
    mv ".peer/stage1/$(basename "$big").part_ab" .peer/stage2/
    mv .peer/all/nvidia_cudnn_frontend-*.whl .peer/stage2/
    rm "$big"
    mv .peer/all/*.whl .peer/stage1/
    rmdir .peer/all
    du -sh .peer/stage1 .peer/stage2 ;;
  stage1)
    mkdir -p "$KEEP" && cp .peer/stage1/* "$KEEP"/ && ls "$KEEP" ;;
  install)
    cp .peer/stage2/* "$KEEP"/
    cd "$KEEP"
    for first in *.part_aa; do cat "${first%.part_aa}".part_* > "${first%.part_aa}"; done
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" ./*.whl
    echo "installed into $SITE: PYTHONPATH=$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages" ;;
  *) echo "usage: bash dev/peer_wheels.sh download | stage1 | install" >&2; exit 2 ;;
esac
