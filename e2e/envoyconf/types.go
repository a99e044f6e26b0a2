package envoyconf

// Types that typed_configs in envoy/ name beyond those envoyconf.go links in: protojson resolves
// an "@type" only through the global registry.
import (
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/jwt_authn/v3"
)
