# GPU CI image: CUDA PyTorch base, the project installed, and tox running the `gpu` env
# (the machine's own CUDA torch from site packages; CUDA scenarios; NCCL or gloo+CUDA).
# Build: docker build -t gradparity-gpu .   Run: docker run --gpus all --ipc=host gradparity-gpu
FROM pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime

ENV PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY . /src
RUN pip install --no-cache-dir "tox==4.23.2" \
    && pip install --no-cache-dir -e ".[test]"
CMD ["tox", "-e", "gpu"]
