# syntax=docker/dockerfile:1
# Build: docker build -t idempotency-extproc .
# Run:   docker run -p 9002:9002 -p 9003:9003 idempotency-extproc

FROM golang:1.26-bookworm AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
RUN CGO_ENABLED=0 go build -trimpath -ldflags="-s -w" -o /out/idempotency-extproc ./cmd/idempotency-extproc

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/idempotency-extproc /idempotency-extproc
USER nonroot:nonroot
# 9002: ext_proc gRPC (Envoy) and grpc.health.v1; 9003: /metrics, /healthz, /readyz.
EXPOSE 9002 9003
ENTRYPOINT ["/idempotency-extproc"]
