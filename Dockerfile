# GPU CI image: the project on a CUDA build of the torch it is tested with, and tox running the
# `gpu` env (that torch from site packages; CUDA scenarios; NCCL or gloo+CUDA).
# torch comes from constraints.txt (torch==2.13.0): on Linux x86-64 the package index's torch
# wheel is the CUDA build, with CUDA's libraries as pip packages; the host gives the driver.
# Build: docker build -t gradparity-gpu .   Run: docker run --gpus all --ipc=host gradparity-gpu
FROM python:3.11-slim-bookworm

ENV PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY . /src
RUN pip install --no-cache-dir "tox==4.23.2" \
    && pip install --no-cache-dir -c constraints.txt -e ".[test]" \
    && python -c "import torch; assert torch.__version__.split('+')[0] == '2.13.0', torch.__version__; assert torch.version.cuda, 'not a CUDA build'"
CMD ["bash", "ci/gpu-smoke.sh"]
