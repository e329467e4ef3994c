# syntax=docker/dockerfile:1
#
# idemgate container image: the gateway alone, at /usr/local/bin/idemgate, without debug info
# (the default, last stage). The stage `demo` is another image: the demo upstream that
# docker-compose.yml runs in front of the gateway (with the gateway's binary beside it, for its
# health check), never shipped with the gateway.
#
#   docker build -t idemgate:latest .
#   docker build --target demo -t idemgate-demo:latest .
#   docker run --rm -v "$PWD/proxy.toml:/etc/idemgate/proxy.toml:ro" -p 8080:8080 idemgate:latest
#
# The image ships no config: mount one at /etc/idemgate/proxy.toml (or pass other arguments). Its
# `[server] listen` must not be 127.0.0.1 to be reachable from outside the container, and the
# HEALTHCHECK expects `admin = "0.0.0.0:9090"` (or 127.0.0.1:9090).
#
# /var/lib/idemgate, owned by the image's user, is where the disk store's volume goes: a new named
# volume mounted there takes that owner (deploy/compose/disk.yml). The image runs with a
# read-only root filesystem: the gateway writes nothing outside its store's directory.
#
# Built and run in the test suite by scripts/test-containers (podman; `--format docker` keeps the
# HEALTHCHECK, which the OCI image format has no field for).

FROM rust:1-bookworm AS build
WORKDIR /src
# Everything `cargo build` reads; tests/, docs/ and the rest stay out of the build context's
# layers (see .dockerignore).
COPY Cargo.toml Cargo.lock clippy.toml ./
COPY src/ src/
COPY examples/ examples/
# The registry and target caches persist between builds on the same builder (BuildKit), so a
# source change does not recompile every dependency. target/ is a cache mount, so the binaries
# are copied out of it in the same step.
RUN --mount=type=cache,target=/usr/local/cargo/registry,sharing=locked \
    --mount=type=cache,target=/src/target,sharing=locked \
    cargo build --release --locked --bin idemgate --example demo_upstream \
 && install -s -m 0755 target/release/idemgate /usr/local/bin/idemgate \
 && install -s -m 0755 target/release/examples/demo_upstream /usr/local/bin/demo_upstream

# The demo upstream (docker-compose.yml's `demo`): a deliberately non-idempotent API.
FROM debian:bookworm-slim AS demo
# libssl3: the gateway's binary (beside the demo, for its health check) links OpenSSL, for
# librdkafka's TLS to Kafka brokers.
RUN apt-get update \
 && apt-get install -y --no-install-recommends libssl3 \
 && apt-get clean \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /usr/local/bin/demo_upstream /usr/local/bin/demo_upstream
COPY --from=build /usr/local/bin/idemgate /usr/local/bin/idemgate
USER 10001
ENTRYPOINT ["/usr/local/bin/demo_upstream"]
CMD ["0.0.0.0:3000"]

# The gateway: the image that ships.
FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates libssl3 \
 && apt-get clean \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 idemgate \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin idemgate \
 && mkdir -p /etc/idemgate \
 && install -d -o 10001 -g 10001 -m 0700 /var/lib/idemgate
COPY --from=build /usr/local/bin/idemgate /usr/local/bin/idemgate
# 8080: the proxy (`[server] listen`), 9090: /healthz, /readyz, /metrics (`[server] admin`).
EXPOSE 8080 9090
USER 10001
# `idemgate probe` GETs the URL and exits 0 on 2xx, 1 otherwise: no curl needed in the image.
HEALTHCHECK --interval=10s --timeout=5s --start-period=10s --retries=3 \
    CMD ["/usr/local/bin/idemgate", "probe", "http://127.0.0.1:9090/readyz"]
ENTRYPOINT ["/usr/local/bin/idemgate"]
CMD ["run", "--config", "/etc/idemgate/proxy.toml"]
