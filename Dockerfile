# The images docker-compose.yml builds. The API service, the last stage
# (what `build: .` takes): built from the lockfile (dependencies in a
# layer of their own, rebuilt only when the manifests change), then a small
# runtime image running as a non-root user. And mtail, by its stage's name.
# Why each base image's tag: docs/stack.md, "Images".

# mtail, for compose's nginx-log-exporter: it counts the statuses nginx
# sends it (nginx/nginx.mtail), Debian's package, as the native stack runs
# it. Its socket is made writable by anyone (umask 0): nginx's workers run
# as a user of their own image, and the socket's directory is shared with
# nginx alone. A socket left by the last run is removed first: mtail
# leaves it behind, and would not start on it.
FROM debian:13.6-slim AS mtail
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends mtail \
 && rm -rf /var/lib/apt/lists/* \
 && install -d -o 65534 -g 65534 /run/mtail
USER 65534
ENTRYPOINT ["sh", "-c", "umask 0 && rm -f /run/mtail/nginx.sock && exec mtail \"$@\"", "mtail"]

FROM rust:1.100.0-slim-trixie AS build
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
