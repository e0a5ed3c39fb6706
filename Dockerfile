# docker build -t fastclip . && docker run --gpus all --ipc=host -v $PWD/data:/opt/fastclip/data fastclip \
#     torchrun --standalone --nproc_per_node 8 -m fastclip train -- --config configs/cc3m-fastclip-v3.yaml
#
# CUDA PyTorch base image: torch and a matching torchvision are already installed, so pip keeps them and
# adds open_clip_torch, webdataset and the rest from pyproject.toml. The editable install keeps configs/
# (model configs under configs/models) where fastclip.models looks for them.
FROM pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    OMP_NUM_THREADS=4

WORKDIR /opt/fastclip
COPY pyproject.toml README.md ./
COPY fastclip ./fastclip
COPY configs ./configs
COPY launch ./launch
RUN pip install -e ".[log]" && python -c "import fastclip, open_clip, webdataset; print('fastclip ok')"

CMD ["fastclip", "--help"]
