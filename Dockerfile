# GPU image for multi-GPU runs: NVIDIA's NGC PyTorch container ships a CUDA build of torch
# and NVIDIA apex (norm.backend=apex) in the releases that include it.
#
# Build:   docker build -t stabilize .
# Default: the CPU-scale NaN scenario (every arm + report), on the GPU if there is one:
#          docker run --gpus all --ipc=host -v $PWD/runs:/workspace/stabilize/runs stabilize
# 1.3B on one node (8 GPUs):
#          docker run --gpus all --ipc=host -v $PWD/runs:/workspace/stabilize/runs stabilize \
#            scripts/launch.sh --nproc-per-node 8 experiment=nan_at_12000
# Several nodes: run on each, with the same --run-id and rendezvous endpoint:
#          docker run --gpus all --ipc=host --network=host -v /shared/runs:/workspace/stabilize/runs \
#            stabilize scripts/launch.sh --nnodes 2 --nproc-per-node 8 \
#            --rdzv-endpoint node0:29500 --run-id nan12k experiment=nan_at_12000
#
# Not built or run on the development machines (no Docker engine, no GPU there); the suite
# checks this file statically (tests/test_dockerfile.py).
ARG NGC_TAG=25.12-py3
FROM nvcr.io/nvidia/pytorch:${NGC_TAG}

WORKDIR /workspace/stabilize
COPY pyproject.toml setup.py README.md ./
COPY stabilize ./stabilize
COPY configs ./configs
COPY scripts ./scripts
# the benchmark scripts' libraries (not installed with the package: scripts/README.md)
COPY benchmarks ./benchmarks
# torch>=2.4 is already satisfied by the container's own CUDA build, so pip keeps it.
RUN pip install --no-cache-dir -e . \
 && python -c "import torch, stabilize; print('torch', torch.__version__)" \
 && (python -c "import apex.normalization; print('apex: available')" \
     || echo "apex: not in this image; norm.backend=apex will explain how to get it")
ENV WANDB_MODE=offline
CMD ["scripts/repro_nan.sh"]
