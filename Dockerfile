# syntax=docker/dockerfile:1
#
# The `courier` binary (brokers, gateways, dev, and the client commands) in a small
# image.
#
#   docker build -t courier .
#   docker run --rm courier --help
#
# Cache-friendly: the cargo registry and the target directory are BuildKit cache
# mounts, so a rebuild after a source change recompiles only the crates that changed,
# not every dependency. protoc comes from the protoc-bin-vendored crate (see
# crates/proto/build.rs), so the builder needs nothing from apt.

FROM rust:1-bookworm AS builder
WORKDIR /src

# Manifests and the lockfile first, then the sources. Every workspace member's
# manifest must be present for `--locked` to resolve the workspace, hence
# benchmarks/, and crates/cli/Cargo.toml declares its integration test at
# ../../tests/main.rs (only that file is needed; the test itself is not built).
COPY Cargo.toml Cargo.lock ./
COPY proto ./proto
COPY crates ./crates
COPY benchmarks ./benchmarks
COPY tests/main.rs ./tests/main.rs

RUN --mount=type=cache,id=courier-cargo-registry,target=/usr/local/cargo/registry \
    --mount=type=cache,id=courier-cargo-git,target=/usr/local/cargo/git \
    --mount=type=cache,id=courier-target,target=/src/target \
    cargo build --release -p courier-cli --locked \
 && install -D -m 0755 target/release/courier /out/courier

FROM debian:bookworm-slim

# ca-certificates: the gateway fetches OAuth JWKS over https and the client
# commands reach gateways over https with the system's roots.
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 courier \
 && useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/courier \
      --no-create-home --shell /usr/sbin/nologin courier \
 && mkdir -p /var/lib/courier/data \
 && chown -R courier:courier /var/lib/courier

COPY --from=builder /out/courier /usr/local/bin/courier

WORKDIR /var/lib/courier
USER courier

# 26500: a gateway's client port (`courier gateway --addr`, 127.0.0.1:26500 by
#        default: give 0.0.0.0:26500 in a container).
# 26601: a broker's cluster port. `courier broker --addr` has no default; 26601 is
#        the port docs/operations.md and deploy/ use.
# 9600:  /metrics (`--metrics-addr`; off unless given, `courier dev` 127.0.0.1:9600).
EXPOSE 26500 26601 9600

# Data: `--data-dir /var/lib/courier/data` (owned by courier, so a named volume
# mounted there starts writable).
ENTRYPOINT ["courier"]
CMD ["--help"]
