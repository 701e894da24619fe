# Loom's container image: the coordinator, the worker agent, loom-train with its plugins and the
# CLI, on Debian 12 (docs/deploy.md). CPU build from Debian's packages (LibTorch 1.13 CPU): a
# CUDA image needs a LibTorch 2.x + CUDA base, which Debian does not package.
#   docker build -t loom:0.1.0 --build-arg LOOM_COMMIT=$(git rev-parse --short=12 HEAD) .
# The manifests in deploy/kubernetes use loom:0.1.0; push it to your registry and edit them.

# Build stage: the same packages and build as a developer machine (scripts/install-deps).
FROM debian:12 AS build
ARG LOOM_COMMIT=unknown
ENV DEBIAN_FRONTEND=noninteractive LOOM_COMMIT=${LOOM_COMMIT}
COPY scripts/install-deps /src/scripts/install-deps
RUN bash /src/scripts/install-deps && rm -rf /var/lib/apt/lists/*
COPY . /src
RUN cmake -S /src -B /build -G Ninja -DCMAKE_BUILD_TYPE=Release -DLOOM_BUILD_TESTS=OFF \
      -DLOOM_CUDA=OFF \
    && ninja -C /build \
    && cmake --install /build --prefix /opt/loom \
    && /src/scripts/runtime-packages /opt/loom > /opt/loom/runtime-packages

# Runtime stage: only the shared libraries the installed programs load (derived from the
# binaries by scripts/runtime-packages), a non-root user and nothing else.
FROM debian:12-slim
ENV DEBIAN_FRONTEND=noninteractive
COPY --from=build /opt/loom/runtime-packages /tmp/runtime-packages
RUN apt-get update -qq \
    && xargs -a /tmp/runtime-packages apt-get install -y -qq --no-install-recommends \
    && rm -rf /var/lib/apt/lists/* /tmp/runtime-packages \
    && groupadd --system --gid 10001 loom \
    && useradd --system --uid 10001 --gid loom --home-dir /var/lib/loom --shell /usr/sbin/nologin loom \
    && mkdir -p /var/lib/loom /var/lib/loom-worker /srv/loom \
    && chown loom:loom /var/lib/loom /var/lib/loom-worker /srv/loom
COPY --from=build /opt/loom/bin/ /usr/local/bin/
COPY --from=build /opt/loom/lib/loom/ /usr/local/lib/loom/
USER 10001:10001
WORKDIR /var/lib/loom
# No default process: the manifests say which program each container runs.
CMD ["loom", "--help"]
