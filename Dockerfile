# GPU image for multi-GPU runs: NVIDIA's NGC PyTorch container ships a CUDA build of torch
# (and, in the releases that include it, NVIDIA apex for norm.backend=apex).
# Build:  docker build -t stabilize .
# Run:    docker run --gpus all --ipc=host -v $PWD/runs:/workspace/stabilize/runs stabilize \
#           python scripts/bench_norms.py
# Not built or run on the development machines (no Docker engine, no GPU there).
ARG NGC_TAG=25.12-py3
FROM nvcr.io/nvidia/pytorch:${NGC_TAG}

WORKDIR /workspace/stabilize
COPY pyproject.toml README.md ./
COPY stabilize ./stabilize
COPY configs ./configs
COPY scripts ./scripts
# torch>=2.4 is already satisfied by the container's own build, so pip keeps it.
RUN pip install --no-cache-dir -e . \
 && python -c "import torch, stabilize; print('torch', torch.__version__)" \
 && (python -c "import apex.normalization; print('apex: available')" \
     || echo "apex: not in this image; norm.backend=apex will explain how to get it")
ENV WANDB_MODE=offline
CMD ["python", "scripts/bench_norms.py"]
