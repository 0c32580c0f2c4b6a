# The API service, for docker-compose.yml. Two stages: build from the
# lockfile (dependencies in a layer of their own, rebuilt only when the
# manifests change), then a small runtime image running as a non-root user.

FROM rust:1.98.1-slim-trixie AS build
WORKDIR /src
# Dependencies first: the manifests and lockfile, with empty sources, so
# this layer is cached until a dependency changes.
COPY Cargo.toml Cargo.lock ./
COPY loadtest/Cargo.toml loadtest/Cargo.toml
COPY testkit/Cargo.toml testkit/Cargo.toml
RUN mkdir -p src loadtest/src testkit/src benches \
 && echo 'fn main() {}' > src/main.rs \
 && touch src/lib.rs testkit/src/lib.rs \
 && echo 'fn main() {}' > loadtest/src/main.rs \
 && echo 'fn main() {}' > benches/memory_check.rs \
 && cargo build --release --locked --package ratelimiter --bin ratelimiter
# Then the service itself.
COPY src src
COPY lua lua
RUN touch src/main.rs src/lib.rs \
 && cargo build --release --locked --package ratelimiter --bin ratelimiter

FROM debian:13.6-slim
# curl for the healthcheck; ca-certificates: the roots for TLS to a
# collector, and to a rediss:// Redis without redis.tls_ca_file.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates curl \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --no-create-home ratelimiter
COPY --from=build /src/target/release/ratelimiter /usr/local/bin/ratelimiter
USER 10001
EXPOSE 8080
ENV RL_LISTEN=0.0.0.0:8080
ENTRYPOINT ["/usr/local/bin/ratelimiter"]
