# deepxd in a container, on the CPU: the daemon on the embedded storage plane, persisted in a volume, with deepxIR
# over UDP on port 9090 and the native socket for deepxctl and the SDK inside the container.
#
#   docker build -t deepx .
#   docker run --rm -p 9090:9090/udp -v deepx-plane:/var/lib/deepx deepx
#   docker exec -it <container> deepxctl tensors ls
#
# Settings are DEEPX_* variables (docs/daemon.md): -e DEEPX_KV=redis://redis:6379/0 puts the plane in a Redis that
# several daemons share (give each its own -e DEEPX_NODE_ID=...). The node id is fixed here, not the container's host
# name, which changes with every `docker run`: heap tensors in the persisted plane belong to the node that made them.
# `docker stop` sends SIGTERM: deepxd drains in-flight programs and stops. UDP listens on every address of the
# container (DEEPX_UDP_REMOTE=1, so that -p reaches it): deepxIR over UDP is unauthenticated, so publish the port only
# where its senders are trusted (docs/daemon.md, "who can do what").
FROM python:3.11-slim

# a C compiler for the native kernels that op-cpu compiles at run time (optional: without it numpy runs everything)
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/deepx
COPY pyproject.toml README.md ./
COPY deepx_sdk deepx_sdk
COPY deepxd deepxd
COPY deepxctl deepxctl
COPY config config
RUN pip install --no-cache-dir . && mkdir -p /var/lib/deepx /run/deepx

ENV DEEPX_KV=memory:///var/lib/deepx/plane.aof \
    DEEPX_UDP=0.0.0.0:9090 \
    DEEPX_UDP_REMOTE=1 \
    DEEPX_LISTEN=unix:///run/deepx/deepxd.sock \
    DEEPX_ADDRESS=unix:///run/deepx/deepxd.sock \
    DEEPX_NODE_ID=deepxd
VOLUME /var/lib/deepx
EXPOSE 9090/udp

ENTRYPOINT ["deepxd"]
CMD ["start"]
