#!/usr/bin/env bash
# What benchmarks/gpu_gpt2.py and accelerator_check.py need on a GPU machine without a package
# index, gathered here beforehand into build/ (git ignores it):
#
#   benchmarks/gpu_bundle.sh NANOGPT_CHECKOUT [TEXT]
#
# - build/nanoGPT: the checkout's files (no .git), for --nanogpt_dir;
# - build/text.txt: a copy of TEXT, if given (accelerator_check.py's --text: tinyshakespeare);
# - build/wheels: Python 3.12 manylinux wheels of the packages this repository imports that
#   such a machine's image lacks (this workplace's H100/H200 image holds PyTorch, JAX 0.11.2
#   with CUDA and most of the rest, not grain, array_record, ml_collections, portpicker or
#   tensorboardX), and flax, optax and orbax-checkpoint at the versions the newest-jax tier
#   tests (the image's are not known), all without their dependencies.
#
# Then the device run is one command from the repository root, build/ carried with it:
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
#       build/wheels/*.whl && PYTHONPATH=/tmp/site python3 benchmarks/gpu_gpt2.py \
#       --nanogpt_dir=build/nanoGPT --output=$OUT/gpu_gpt2.md
#
# and likewise `accelerator_check.py --text=build/text.txt --nanogpt_dir=build/nanoGPT`.
# (--allow_cpu rehearses either on a machine without a GPU.)
set -euo pipefail
cd "$(dirname "$0")/.."
nanogpt=${1:?usage: benchmarks/gpu_bundle.sh NANOGPT_CHECKOUT [TEXT]} text=${2:-}
[[ -f $nanogpt/model.py && -f $nanogpt/train.py ]] || {
    echo "gpu_bundle.sh: $nanogpt holds no nanoGPT model.py and train.py" >&2; exit 2; }
[[ -z $text || -f $text ]] || { echo "gpu_bundle.sh: no text file $text" >&2; exit 2; }
PINS=(grain==0.2.18 array_record==0.8.6 ml_collections==1.1.0 portpicker==1.6.0
      tensorboardX==2.6.5 flax==0.12.12 optax==0.2.8 orbax-checkpoint==0.12.8)

rm -rf build/nanoGPT build/wheels build/text.txt
mkdir -p build/nanoGPT build/wheels
tar -C "$nanogpt" --exclude=.git -cf - . | tar -C build/nanoGPT -xf -
[[ -z $text ]] || cp "$text" build/text.txt
platforms=()
for p in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014; do
    platforms+=(--platform "${p}_x86_64")
done
python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp "${platforms[@]}" -d build/wheels "${PINS[@]}"
du -sh build/*
