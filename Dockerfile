# Worker image for TPU VMs on GKE: the trainer and the recovery step programs.
# Build: docker build -t REGION-docker.pkg.dev/PROJECT/REPO/jax-slice-recovery-worker:VERSION .
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# JAX for TPU first (libtpu comes from the JAX release index), so that code changes reuse this layer.
RUN pip install "jax[tpu]>=0.10,<0.11" \
      -f https://storage.googleapis.com/jax-releases/libtpu_releases.html

COPY pyproject.toml README.md ./
COPY jaxrec ./jaxrec
COPY recovery_steps ./recovery_steps
COPY trainer ./trainer
COPY workflows ./workflows
RUN pip install .

# Argo and the JobSet set the command (python -m recovery_steps.<step> / python -m trainer).
CMD ["python", "-m", "trainer", "--help"]
