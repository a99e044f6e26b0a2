package main

import (
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"time"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	accesslogfilev3 "github.com/envoyproxy/go-control-plane/envoy/extensions/access_loggers/file/v3"
	accesslogstreamv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/access_loggers/stream/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"

	"github.com/idempotency-extproc/idempotency-extproc/e2e/proxy"
)

// accessLog renders the emulator's proxy.Record of a request with the text format of the
// bootstrap's access log. A Record holds fewer fields than Envoy records: commands it cannot
// answer (%BYTES_SENT%, %REQ(USER-AGENT)%, …) print "-", so a line is close to Envoy's, not
// Envoy's own output.
type accessLog struct {
	format string
}

// fallbackFormat is used when the bootstrap has no text access log: the request, its outcome and
// the processor's dynamic metadata under namespace %s.
const fallbackFormat = `[%%START_TIME%%] "%%REQ(:METHOD)%% %%REQ(:PATH)%% %%PROTOCOL%%" %%RESPONSE_CODE%% %%RESPONSE_CODE_DETAILS%% "%%REQ(X-REQUEST-ID)%%" route=%%ROUTE_NAME%% idempotency=%%DYNAMIC_METADATA(%[1]s:outcome)%% key_hash=%%DYNAMIC_METADATA(%[1]s:key_hash)%%` + "\n"

// accessLogFormat returns the text format of the first stdout or file access log of the first
// listener's HTTP connection manager, or fallbackFormat over namespace when there is none.
func accessLogFormat(b *bootstrapv3.Bootstrap, namespace string) (accessLog, error) {
	for _, l := range b.GetStaticResources().GetListeners() {
		for _, fc := range l.GetFilterChains() {
			for _, f := range fc.GetFilters() {
				hcm := &hcmv3.HttpConnectionManager{}
				if tc := f.GetTypedConfig(); tc == nil || !tc.MessageIs(hcm) {
					continue
				} else if err := tc.UnmarshalTo(hcm); err != nil {
					return accessLog{}, fmt.Errorf("listener %q: %w", l.GetName(), err)
				}
				for _, al := range hcm.GetAccessLog() {
					msg, err := al.GetTypedConfig().UnmarshalNew()
					if err != nil {
						return accessLog{}, fmt.Errorf("listener %q access_log %q: %w", l.GetName(), al.GetName(), err)
					}
					var text string
					switch c := msg.(type) {
					case *accesslogstreamv3.StdoutAccessLog:
						text = c.GetLogFormat().GetTextFormatSource().GetInlineString()
					case *accesslogstreamv3.StderrAccessLog:
						text = c.GetLogFormat().GetTextFormatSource().GetInlineString()
					case *accesslogfilev3.FileAccessLog:
						text = c.GetLogFormat().GetTextFormatSource().GetInlineString()
					}
					if text != "" {
						return accessLog{format: text}, nil
					}
				}
				return accessLog{format: fmt.Sprintf(fallbackFormat, namespace)}, nil
			}
		}
	}
	return accessLog{format: fmt.Sprintf(fallbackFormat, namespace)}, nil
}

// formatCommand is one command of Envoy's substitution format: %NAME%, %NAME(arg)%, with an
// optional :N length limit, which the demo ignores.
var formatCommand = regexp.MustCompile(`%([A-Z_]+)(?:\(([^)]*)\))?(?::[0-9]+)?%`)

// line renders r, which went to upstreamHost when the router tried it, and ended at now. It ends
// with a newline.
func (a accessLog) line(r proxy.Record, upstreamHost string, now time.Time) string {
	s := formatCommand.ReplaceAllStringFunc(a.format, func(m string) string {
		sub := formatCommand.FindStringSubmatch(m)
		return command(sub[1], sub[2], r, upstreamHost, now)
	})
	if !strings.HasSuffix(s, "\n") {
		s += "\n"
	}
	return s
}

func command(name, arg string, r proxy.Record, upstreamHost string, now time.Time) string {
	switch name {
	case "START_TIME":
		// Envoy's default START_TIME format; the Record has the duration, not the start.
		return now.Add(-r.Duration).UTC().Format("2006-01-02T15:04:05.000Z")
	case "REQ":
		// REQ(a?b): header a, else header b.
		for _, h := range strings.Split(arg, "?") {
			if v := requestHeader(r, h); v != "" {
				return v
			}
		}
		return "-"
	case "PROTOCOL":
		return "HTTP/1.1" // the emulator's listener speaks HTTP/1 only
	case "RESPONSE_CODE":
		return strconv.Itoa(r.Status)
	case "RESPONSE_CODE_DETAILS":
		return orDash(r.CodeDetails)
	case "RESPONSE_FLAGS":
		return orDash(r.ResponseFlags)
	case "DURATION":
		return strconv.FormatInt(r.Duration.Milliseconds(), 10)
	case "UPSTREAM_HOST":
		if r.Attempts > 0 {
			return upstreamHost
		}
		return "-"
	case "ROUTE_NAME":
		return orDash(r.Route)
	case "DYNAMIC_METADATA":
		ns, keys, _ := strings.Cut(arg, ":")
		if keys == "" {
			return r.DynamicMetadataValue(ns)
		}
		return r.DynamicMetadataValue(ns, strings.Split(keys, ":")...)
	default:
		return "-"
	}
}

// requestHeader returns the request headers a Record holds: :method, :path and x-request-id.
func requestHeader(r proxy.Record, name string) string {
	switch strings.ToLower(name) {
	case ":method":
		return r.Method
	case ":path":
		return r.Path
	case "x-request-id":
		return r.RequestID
	}
	return ""
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
