package arena

import (
	"os"
	"runtime"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"
)

// threadFaults returns the page faults the calling thread has taken.
func threadFaults(t *testing.T) int64 {
	var ru syscall.Rusage
	require.NoError(t, syscall.Getrusage(syscall.RUSAGE_THREAD, &ru))
	return int64(ru.Minflt) // int32 on 32-bit systems
}

// touchFaults returns the page faults writing a byte to each page of b takes on this thread.
func touchFaults(t *testing.T, b []byte) int64 {
	before := threadFaults(t)
	for i := 0; i < len(b); i += os.Getpagesize() {
		b[i] = 1
	}
	return threadFaults(t) - before
}

// TestSegmentIsPopulated checks that a new segment's pages are in place when it is mapped: the
// records written to it fault none in, where a plain mapping faults one per page.
func TestSegmentIsPopulated(t *testing.T) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	size := DefaultSegmentSize
	pages := int64(size / os.Getpagesize())

	plain, err := syscall.Mmap(-1, 0, size, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
	require.NoError(t, err)
	defer func() { require.NoError(t, syscall.Munmap(plain)) }()
	// A transparent huge page would fault the control mapping in at once.
	require.NoError(t, syscall.Madvise(plain, syscall.MADV_NOHUGEPAGE))
	require.GreaterOrEqual(t, touchFaults(t, plain), pages/2, "a plain mapping faults its pages in as they are written")

	seg, err := mapSegment(size)
	require.NoError(t, err)
	defer func() { require.NoError(t, munmapSegment(seg)) }()
	require.Less(t, touchFaults(t, seg), max(pages/8, 1), "a segment's pages are populated when it is mapped")
}
