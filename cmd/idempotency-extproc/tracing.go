package main

import (
	"context"
	"errors"
	"fmt"

	"go.opentelemetry.io/otel/exporters/otlp/otlptrace"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"
)

// openTracing starts OpenTelemetry tracing when the SDK's own environment asks for an exporter:
// OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, the protocol in
// OTEL_EXPORTER_OTLP_TRACES_PROTOCOL or OTEL_EXPORTER_OTLP_PROTOCOL (http/protobuf by default, or
// grpc), OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES, OTEL_TRACES_SAMPLER and its argument;
// the exporters read the rest (headers, timeouts, certificates) themselves. Without an endpoint,
// or with OTEL_SDK_DISABLED=true, it returns a nil tracer: nothing is exported and nothing runs.
// shutdown flushes the spans still buffered.
func openTracing(ctx context.Context, getenv func(string) string) (tracer trace.Tracer, shutdown func(context.Context) error, err error) {
	none := func(context.Context) error { return nil }
	protocol, on, err := tracingProtocol(getenv)
	if err != nil || !on {
		return nil, none, err
	}
	var exporter *otlptrace.Exporter
	if protocol == "grpc" {
		exporter, err = otlptracegrpc.New(ctx)
	} else {
		exporter, err = otlptracehttp.New(ctx)
	}
	if err != nil {
		return nil, none, fmt.Errorf("tracing: %w", err)
	}
	res, err := resource.New(ctx,
		resource.WithAttributes(semconv.ServiceName("idempotency-extproc")),
		resource.WithFromEnv(), // OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES win
		resource.WithTelemetrySDK())
	if err != nil && !errors.Is(err, resource.ErrPartialResource) {
		return nil, none, fmt.Errorf("tracing: resource: %w", err)
	}
	// The sampler comes from OTEL_TRACES_SAMPLER and OTEL_TRACES_SAMPLER_ARG (the SDK reads them).
	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exporter), sdktrace.WithResource(res))
	return tp.Tracer("github.com/idempotency-extproc/idempotency-extproc/extproc"), tp.Shutdown, nil
}

// tracingProtocol is the OTLP protocol openTracing exports with, from the environment alone:
// on is false when no endpoint is set or OTEL_SDK_DISABLED=true; err names a protocol the
// processor does not export (http/json). Start-up validation (startupConfig) calls it, so that
// check refuses what serve would.
func tracingProtocol(getenv func(string) string) (protocol string, on bool, err error) {
	if getenv("OTEL_EXPORTER_OTLP_ENDPOINT") == "" && getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") == "" || getenv("OTEL_SDK_DISABLED") == "true" {
		return "", false, nil
	}
	protocol, source := getenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"), "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
	if protocol == "" {
		protocol, source = getenv("OTEL_EXPORTER_OTLP_PROTOCOL"), "OTEL_EXPORTER_OTLP_PROTOCOL"
	}
	switch protocol {
	case "", "http/protobuf":
		return "http/protobuf", true, nil
	case "grpc":
		return "grpc", true, nil
	}
	return "", false, fmt.Errorf("tracing: %s is %q; the processor exports grpc or http/protobuf", source, protocol)
}
