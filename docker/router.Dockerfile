# The router in front of the pagedserve replicas (docker/k8s/router.yaml): vllm-router from the package index.
#   docker build -f docker/router.Dockerfile -t pagedserve-router .
FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN pip install "vllm-router==0.1.17" && useradd --create-home --uid 1000 router
USER router
EXPOSE 8000 29000
ENTRYPOINT ["vllm-router"]
