# Multi-stage build: compile in the Rust image with the measured profile (`dist`: fat LTO, one
# codegen unit; benchmarks/profiles.md), run from a slim Debian image.
#   docker build -t tollgate .
#   docker run --rm -p 8080:8080 tollgate            # proxy.yaml, served on 0.0.0.0:8080
#   docker run --rm -p 8080:8080 -v $PWD/my.yaml:/etc/tollgate/my.yaml tollgate -c /etc/tollgate/my.yaml
FROM rust:1-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock rustfmt.toml ./
COPY src ./src
COPY benches ./benches
RUN cargo build --profile dist --locked --bin tollgate

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 tollgate
COPY --from=build /src/target/dist/tollgate /usr/local/bin/tollgate
COPY proxy.yaml /etc/tollgate/proxy.yaml
USER tollgate
EXPOSE 8080
# Arguments given to `docker run IMAGE …` (or a compose `command:`, a Kubernetes `args:`)
# replace CMD. proxy.yaml listens on 127.0.0.1, which a published port cannot reach inside a
# container: `--listen` moves it to every interface (tests/it/guides.rs checks this image's
# config and arguments).
ENTRYPOINT ["tollgate"]
CMD ["-c", "/etc/tollgate/proxy.yaml", "--listen", "0.0.0.0:8080"]
