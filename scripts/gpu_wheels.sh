#!/usr/bin/env bash
# The wheels a lent GPU machine lacks for scripts/gpu_check.sh, into .whl/ (git-ignored; the
# device tool carries it when a run names it in carry). That machine runs Python 3.12 with
# torch, Lightning, transformers and pytest, but no Hydra, W&B or datasets, and reaches no
# registry; these are the versions of
# the CPU venv, checked on a Python 3.12 venv of the machine's package list (pydantic-core
# needs typing-extensions >= 4.16; antlr4 4.9.3 has no wheel on PyPI: built here).
#
#   scripts/gpu_wheels.sh            then, on that machine, with .whl carried:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
#   PYTHONPATH=/tmp/site:$PWD PYTHON=python3 scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
mkdir -p .whl
WHEELS=(
  hydra-core==1.3.8 omegaconf==2.3.1 hydra-joblib-launcher==1.2.0
  wandb==0.31.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
  typing-inspection==0.4.5 typing-extensions==4.16.0 platformdirs==4.14.9
  cwevals==0.0.1b1 distro==1.9.0 sniffio==1.3.1 googleapis-common-protos==1.76.0
  opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-proto==1.45.2
  opentelemetry-exporter-otlp-proto-http==1.45.2 opentelemetry-exporter-otlp-proto-common==1.45.2
  opentelemetry-exporter-otlp-common==0.66b2 opentelemetry-exporter-http-transport==0.66b2
  opentelemetry-semantic-conventions==0.66b2
  datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d .whl "${WHEELS[@]}"
"$PY" -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3
ls .whl | wc -l
