# Multi-stage build: compile in the Rust image, run from a slim Debian image.
FROM rust:1-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock rustfmt.toml ./
COPY src ./src
COPY benches ./benches
RUN cargo build --release --locked --bin tollgate

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 tollgate
COPY --from=build /src/target/release/tollgate /usr/local/bin/tollgate
COPY proxy.yaml /etc/tollgate/proxy.yaml
USER tollgate
EXPOSE 8080 9901
ENTRYPOINT ["tollgate", "-c", "/etc/tollgate/proxy.yaml"]
