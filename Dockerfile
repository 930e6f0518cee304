# pagedserve on an NVIDIA GPU.
#   docker build -t pagedserve .
#   docker run --gpus all -p 8000:8000 -v /path/to/checkpoint:/models/model:ro pagedserve
# Any `pagedserve serve` flag can be appended to `docker run ... pagedserve`, or set as PAGEDSERVE_<FLAG>.
FROM pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# An unprivileged user owns the app and its caches.
RUN useradd --create-home --uid 1000 pagedserve
WORKDIR /opt/pagedserve

# Dependencies first (a layer that survives source edits), then the package itself. The base image's
# CUDA build of torch (and its triton) already satisfies the torch requirement.
COPY pyproject.toml README.md ./
COPY server ./server
COPY engine ./engine
COPY kernels ./kernels
COPY configs ./configs
RUN pip install ".[triton]"

USER pagedserve
ENV PAGEDSERVE_CACHE=/home/pagedserve/.cache/pagedserve \
    PAGEDSERVE_MODEL=/models/model \
    PAGEDSERVE_DEVICE=cuda
# The checkpoint (a Hugging Face directory: config.json, *.safetensors, tokenizer files) is mounted here.
VOLUME ["/models"]
EXPOSE 8000

# Loading weights and capturing CUDA graphs takes a while: a generous start period.
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)" || exit 1

ENTRYPOINT ["pagedserve", "serve", "--host", "0.0.0.0", "--port", "8000"]
