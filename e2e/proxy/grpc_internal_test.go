package proxy

import "testing"

// isGrpc follows Grpc::Common::hasGrpcContentType: exactly application/grpc or application/grpc+….
func TestIsGrpcIsEnvoys(t *testing.T) {
	for ct, want := range map[string]bool{
		"application/grpc":               true,
		"application/grpc+proto":         true,
		"application/grpc;charset=utf-8": false,
		"application/grpc-web":           false,
		"application/json":               false,
		"":                               false,
	} {
		if got := isGrpc(headerList{{name: "content-type", value: ct}}); got != want {
			t.Errorf("isGrpc(%q) = %v, want %v", ct, got, want)
		}
	}
}
