# docker build -t fastclip .
# docker run --gpus all --ipc=host -v $PWD/data:/opt/fastclip/data -v $PWD/runs:/opt/fastclip/runs fastclip \
#     bash launch/single_node.sh configs/cc3m-fastclip-v3.yaml 8
# (runs/ is mounted so checkpoints, metrics and `--train.resume latest` outlive the container)
# A fastclip command runs without the word: `docker run ... fastclip train --config ...` (launch/docker-entrypoint.sh).
#
# CUDA PyTorch base image: torch and a matching torchvision are already installed, so pip keeps them and
# adds open_clip_torch, webdataset and the rest from pyproject.toml. The -devel variant carries nvcc and gcc:
# torch.compile (Triton) and DeepSpeed's JIT-built ops need a compiler at run time. The editable install keeps
# configs/ (model configs under configs/models) where fastclip.models looks for them.
FROM pytorch/pytorch:2.5.1-cuda12.4-cudnn9-devel

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    OMP_NUM_THREADS=4

WORKDIR /opt/fastclip
COPY pyproject.toml README.md ./
COPY fastclip ./fastclip
COPY configs ./configs
COPY launch ./launch
# deepspeed: train.distributed deepspeed (ZeRO 1-3); wandb: --report-to wandb; parquet: data scan reads
# img2dataset's .parquet without the tars; awscli: `pipe:aws s3 cp ... -` and s3:// shards. transformers 5 turns
# PyTorch off below 2.6 (this image has 2.5.1): 4.x builds the Hugging Face text towers here
# torch stays the image's build, as launch/setup.sh keeps its pin: a constraint file for every pip install (else a
# dependency's requirement may pull another torch, a CPU or other-CUDA wheel, over the image's)
RUN python -c "import torch; print('torch==' + torch.__version__)" > /opt/torch-constraint.txt
ENV PIP_CONSTRAINT=/opt/torch-constraint.txt
RUN pip install -e ".[log,deepspeed,wandb,parquet]" awscli "transformers>=4.45,<5" \
    && python -c "import fastclip, open_clip, webdataset, deepspeed, wandb, pyarrow; print('fastclip ok')"

# not root: files written to mounted folders (runs/, data/) belong to an ordinary user; pass --user $(id -u):$(id -g)
# to write them as yourself
RUN useradd --create-home --uid 1000 fastclip && mkdir -p data runs && chown -R fastclip /opt/fastclip
USER fastclip
ENTRYPOINT ["/opt/fastclip/launch/docker-entrypoint.sh"]
CMD []
