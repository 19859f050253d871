# The two Cohort binaries: `cohort` (coordinator, simulate, demo, partition) and
# `cohort-edge` (the edge client). Build: `docker build -t cohort .`
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p cohort-coordinator -p cohort-edge --bins \
 && strip target/release/cohort target/release/cohort-edge

FROM debian:bookworm-slim
# curl and jq serve the health check and the compose set-up script only.
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates curl jq \
 && rm -rf /var/lib/apt/lists/*
# A fixed unprivileged user; the directories exist in the image so that new named
# volumes mounted there start out owned by it.
RUN useradd --system --uid 10001 --home-dir /var/lib/cohort cohort \
 && mkdir -p /var/lib/cohort/coordinator /var/lib/cohort/shared /var/lib/cohort/state \
 && chown -R cohort /var/lib/cohort
COPY --from=build /src/target/release/cohort /src/target/release/cohort-edge /usr/local/bin/
COPY docker/setup.sh /usr/local/bin/cohort-setup
USER cohort
WORKDIR /var/lib/cohort
EXPOSE 8443
ENTRYPOINT ["cohort"]
CMD ["--help"]
