#!/usr/bin/env bash
# Every kernel module compiles through NVRTC for sm_80..sm_120 and the sm_90a variants, with
# no GPU: NVRTC and the CUDA headers come from their PyPI wheels (the CUDA 13.0 of the GPU
# hosts' driver), unpacked into target/nvrtc. Then counts the entry points that spill registers
# (ptxas -v) on sm_80 and in the sm_90a modules (`dflash-kernels --resources` lists them).
set -euo pipefail
cd "$(dirname "$0")/.."
dir=target/nvrtc
if [ ! -e "$dir/nvidia/cu13/lib/libnvrtc.so.13" ]; then
  rm -rf "$dir" && mkdir -p "$dir/wheels"
  python3 -m pip download --no-deps --quiet --disable-pip-version-check -d "$dir/wheels" \
    "nvidia-cuda-nvrtc==13.0.*" "nvidia-cuda-runtime==13.0.*"
  python3 - "$dir" <<'PY'
import pathlib, sys, zipfile
root = pathlib.Path(sys.argv[1])
for w in sorted((root / "wheels").glob("*.whl")):
    zipfile.ZipFile(w).extractall(root)
PY
fi
cargo build --release --quiet -p xtask --features cuda --bin dflash-kernels
export LD_LIBRARY_PATH="$PWD/$dir/nvidia/cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export CUDA_HOME="$PWD/$dir/nvidia/cu13"
target/release/dflash-kernels > "$dir/compile.log" || { cat "$dir/compile.log"; exit 1; }
echo "kernels: $(grep -c '^ok' "$dir/compile.log") module builds compiled through NVRTC, none failed"
target/release/dflash-kernels --arch sm_80 --resources | tail -1
