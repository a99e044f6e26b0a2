# syntax=docker/dockerfile:1
# One image for linux/amd64 and linux/arm64: the build stage runs on the builder's own platform
# and cross-compiles (CGO_ENABLED=0), so no emulation is needed.
#
# Build for this machine:  docker build -t idempotency-extproc .
# Build both and push:     docker buildx build --platform linux/amd64,linux/arm64 \
#                            --build-arg VERSION=$(git describe --tags --always) \
#                            --build-arg REVISION=$(git rev-parse HEAD) \
#                            -t ghcr.io/idempotency-extproc/idempotency-extproc:TAG --push .
# Run:                     docker run -p 9002:9002 -p 9003:9003 idempotency-extproc

FROM --platform=$BUILDPLATFORM golang:1.26-bookworm AS build
ARG TARGETOS
ARG TARGETARCH
# The version --version prints, the ready log line and idempotency_build_info carry; .git is not
# in the build context, so the revision comes in the same way.
ARG VERSION=dev
ARG REVISION=unknown
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
RUN CGO_ENABLED=0 GOOS=$TARGETOS GOARCH=$TARGETARCH \
    go build -trimpath -tags vtprotobuf -ldflags="-s -w -X main.version=${VERSION} -X main.revision=${REVISION}" \
      -o /out/idempotency-extproc ./cmd/idempotency-extproc

FROM gcr.io/distroless/static-debian12:nonroot
ARG VERSION=dev
ARG REVISION=unknown
ARG CREATED=unknown
LABEL org.opencontainers.image.title="idempotency-extproc" \
      org.opencontainers.image.description="Idempotency-Key semantics for any HTTP upstream, as an Envoy external processor (ext_proc)" \
      org.opencontainers.image.url="https://github.com/idempotency-extproc/idempotency-extproc" \
      org.opencontainers.image.source="https://github.com/idempotency-extproc/idempotency-extproc" \
      org.opencontainers.image.documentation="https://github.com/idempotency-extproc/idempotency-extproc#readme" \
      org.opencontainers.image.version="$VERSION" \
      org.opencontainers.image.revision="$REVISION" \
      org.opencontainers.image.created="$CREATED" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="gcr.io/distroless/static-debian12:nonroot"
COPY --from=build /out/idempotency-extproc /idempotency-extproc
# 65532, distroless' nonroot: the chart's runAsUser.
USER 65532:65532
# 9002: ext_proc gRPC (Envoy) and grpc.health.v1; 9003: /metrics, /healthz, /readyz.
EXPOSE 9002 9003
ENTRYPOINT ["/idempotency-extproc"]
