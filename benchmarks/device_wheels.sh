#!/bin/bash
# The wheels that benchmarks/device_check.sh carries to the GPU machine (no network there), into .whl/ (ignored
# through .git/info/exclude; under the 64 MiB a call may carry). Run here once per session: ~3 minutes (xz).
#   .whl/any: TRL and what the machine's Python lacks;  .whl/cpu: this project's jax / jaxlib / flax pins
#   (jaxlib's 85 MB wheel unzipped and re-packed as a 53 MB tar.xz; device_check.sh unpacks it).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl/any .whl/cpu
DL="python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64"
$DL -d .whl/any trl==1.12.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 gguf==0.19.0 tensorboardX==2.6.5 \
  cmeel-mimalloc==3.4.3 cmeel==0.62.0
$DL -d .whl/cpu jax==0.10.2 flax==0.12.8 optax==0.2.8 chex==0.1.92 orbax-checkpoint==0.12.8
if [ ! -f .whl/cpu/jaxlib.tar.xz ]; then
  tmp=$(mktemp -d)
  $DL -d "$tmp" jaxlib==0.10.2
  (cd "$tmp" && mkdir x && cd x && python3 -m zipfile -e ../jaxlib-*.whl . && tar cf - . | xz -T2 -9 > ../jaxlib.tar.xz)
  mv "$tmp/jaxlib.tar.xz" .whl/cpu/ && rm -rf "$tmp"
fi
du -sh .whl
