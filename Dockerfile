# syntax=docker/dockerfile:1
# deepxd in a container, on the CPU: the daemon on the embedded storage plane, persisted in a volume, the native
# socket for deepxctl and the SDK inside the container. docs/docker.md has the whole story.
#
#   docker build -t deepx .                        # slim: no C compiler, numpy runs every kernel
#   docker build -t deepx:native --target native . # with gcc, for the native kernels (docs/compiler.md)
#   docker run --rm --shm-size=1g -v deepx-plane:/var/lib/deepx deepx
#   docker exec -it <container> deepxctl tensors ls
#
# Heap tensors live in /dev/shm, of which Docker gives 64 MB unless --shm-size says more; the pool of freed segments
# takes a quarter of it. The daemon runs as the user deepx (uid 10001), not root. deepxIR over UDP, unauthenticated,
# listens on the container's loopback only; publishing it is an explicit choice (docs/docker.md):
#   docker run ... -e DEEPX_UDP=0.0.0.0:9090 -e DEEPX_UDP_REMOTE=1 -p 127.0.0.1:9090:9090/udp deepx
# Settings are DEEPX_* variables (docs/daemon.md). The node id is fixed, not the container's host name, which changes
# with every `docker run`: heap tensors in the persisted plane belong to the node that made them. `docker stop` sends
# SIGTERM: deepxd drains in-flight programs and stops.

FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY deepx_core deepx_core
COPY deepx_sdk deepx_sdk
COPY deepxd deepxd
COPY deepxctl deepxctl
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim AS slim
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --find-links=/wheels /wheels/deepx-*.whl \
    && useradd --uid 10001 --create-home --shell /usr/sbin/nologin deepx \
    && mkdir -p /var/lib/deepx /run/deepx \
    && chown deepx:deepx /var/lib/deepx /run/deepx \
    && chmod 0700 /run/deepx
ENV DEEPX_KV=memory:///var/lib/deepx/plane.aof \
    DEEPX_UDP=127.0.0.1:9090 \
    DEEPX_LISTEN=unix:///run/deepx/deepxd.sock \
    DEEPX_ADDRESS=unix:///run/deepx/deepxd.sock \
    DEEPX_NODE_ID=deepxd \
    DEEPX_NATIVE_KERNELS=0
VOLUME /var/lib/deepx
WORKDIR /home/deepx
USER 10001:10001
ENTRYPOINT ["deepxd"]
CMD ["start"]

# the slim image with a C compiler: op-cpu compiles a few one-pass kernels at run time (optional, docs/compiler.md)
FROM slim AS native
USER 0
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
ENV DEEPX_NATIVE_KERNELS=1
USER 10001:10001

# the default target
FROM slim
