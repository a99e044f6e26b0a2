//go:build unix

package arena

import "syscall"

// mapSegment maps n bytes of zeroed, private, anonymous memory: outside the Go heap, so the
// collector neither counts nor scans them. Where the system can, their pages are populated at
// once (mapPopulate) rather than faulted in one by one as records are written. It is the default
// of Options.Map.
func mapSegment(n int) ([]byte, error) {
	return syscall.Mmap(-1, 0, n, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE|mapPopulate)
}

// munmapSegment unmaps b, which mapSegment returned.
func munmapSegment(b []byte) error { return syscall.Munmap(b) }
