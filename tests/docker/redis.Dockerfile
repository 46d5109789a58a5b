# A Redis image for tests/docker/test_compose_docker.py where the official redis:7 cannot be pulled
# (no registry): Debian's redis-server on the same base as the jaxstream image. Like the official
# image it runs as the user `redis` and ships redis-cli for the health check.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
RUN apt-get update && apt-get install -y --no-install-recommends redis-server redis-tools \
    && rm -rf /var/lib/apt/lists/*
