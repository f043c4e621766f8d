#!/bin/bash
# The wheels that benchmarks/device_check.sh carries to the GPU machine (no network there), into .whl/ (ignored
# through .git/info/exclude; under the 64 MiB a call may carry). Run it once before the machine's first call:
# ~3 minutes (xz).
#   .whl/any: TRL and what the machine's Python lacks;  .whl/cpu: this project's jax / jaxlib / flax pins
#   (jaxlib's 85 MB wheel unzipped, stripped and re-packed as a ~46 MB tar.xz; device_check.sh unpacks it) and
#   oneDNN's library (~7 MB);  .whl/ffi: stacked_matmul's and adam_in_place's handlers, prebuilt for the
#   machine's paths.
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
  # its shared objects stripped of the static symbol tables (the dynamic ones, all that loading needs, stay):
  # 53 -> ~46 MB, room for oneDNN below
  (cd "$tmp" && mkdir x && cd x && python3 -m zipfile -e ../jaxlib-*.whl . &&
   find . -name "*.so" -exec strip --strip-unneeded {} + && tar cf - . | xz -T2 -9 > ../jaxlib.tar.xz)
  mv "$tmp/jaxlib.tar.xz" .whl/cpu/ && rm -rf "$tmp"
fi
# oneDNN for ppojax's float32 projections on one CPU device (ppojax/backends/cpu/stacked_matmul.py): the wheel's
# libdnnl.so.3 and metadata only (the wheel holds three copies of the 55 MB library), unpacked on the machine
# to ONEDNN_SITE; and the handlers prebuilt here for that path and the pinned jaxlib, in case the machine has no
# C++ compiler (device_check.sh puts them in the handler cache, where stacked_matmul looks first)
ONEDNN_SITE=/tmp/site_onednn
if [ ! -f .whl/cpu/onednn.tar.xz ]; then
  tmp=$(mktemp -d)
  $DL -d "$tmp" onednn-cpu-gomp==2023.2.0
  (cd "$tmp" && mkdir w s && python3 -m zipfile -e onednn_cpu_gomp-*.whl w && info=$(basename w/*.dist-info) &&
   mkdir "s/$info" && cp "w/$info/METADATA" "s/$info/" && cp w/*.data/data/lib/libdnnl.so.3 s/ &&
   printf 'libdnnl.so.3,,\n%s/METADATA,,\n%s/RECORD,,\n' "$info" "$info" > "s/$info/RECORD" &&
   tar cf - -C s . | xz -T2 -9 > onednn.tar.xz)
  mv "$tmp/onednn.tar.xz" .whl/cpu/ && rm -rf "$tmp"
fi
rm -rf .whl/ffi && mkdir -p .whl/ffi $ONEDNN_SITE && tar xJf .whl/cpu/onednn.tar.xz -C $ONEDNN_SITE
.venv/bin/python - "$ONEDNN_SITE/libdnnl.so.3" <<'PY'
import shutil, sys
from pathlib import Path

import jax

from ppojax.backends.cpu import adam_in_place
from ppojax.backends.cpu import capabilities
from ppojax.backends.cpu.ffi import build
from ppojax.backends.cpu import stacked_matmul

assert jax.lib.__version__ == "0.10.2", f"the prebuilt handlers must match the carried jaxlib, not {jax.lib.__version__}"
library = Path(sys.argv[1])
compiler = shutil.which("g++") or shutil.which("c++")
builds = []
for defines in capabilities.ALL_BUILD_DEFINES:  # the device's CPU is not known here: a build for each kind
    builds += [(name, stacked_matmul.SOURCE, library, stacked_matmul.LIBRARIES[name] + defines)
               for name in ("onednn", "onednn_primitive")]  # the libraries on oneDNN's wheel (MKL's: the machine's torch)
    builds.append(("adam_in_place", adam_in_place.SOURCE, None, adam_in_place.FLAGS + defines))
for name, source, linked, flags in builds:
    out = build.library_path(source, jax.lib.__version__, linked, flags, cache=Path(".whl/ffi"))
    why = build.compile_source(compiler, source, out, linked, flags) if compiler else "no g++ here"
    if why:
        sys.exit(f"device_wheels.sh: prebuilding the {name} handlers: {why}")
    print(f"prebuilt {out} ({name})")
PY
du -sh .whl
