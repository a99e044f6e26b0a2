//go:build !unix

package arena

import "errors"

// mapSegment is not supported on this system: segments are allocated on the Go heap.
func mapSegment(int) ([]byte, error) { return nil, errors.ErrUnsupported }

// munmapSegment is never called where mapSegment always fails.
func munmapSegment([]byte) error { return errors.ErrUnsupported }
