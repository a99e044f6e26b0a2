package extproc

import (
	"context"
	"testing"

	"google.golang.org/grpc/tap"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
)

// What the first-message deadline costs a stream: the tap's context and timer as a stream opens,
// and stopping the timer at its first message. No goroutine is started.
func BenchmarkFirstMessageTimer(b *testing.B) {
	store, err := cache.NewMemory(cache.MemoryOptions{})
	if err != nil {
		b.Fatal(err)
	}
	defer store.Close()
	s, err := NewServer(Options{Store: store})
	if err != nil {
		b.Fatal(err)
	}
	handle, info := s.TapHandle(), &tap.Info{FullMethodName: processMethod}
	b.ReportAllocs()
	for b.Loop() {
		ctx, err := handle(context.Background(), info)
		if err != nil {
			b.Fatal(err)
		}
		if err := ctx.Value(firstMessageKey{}).(*firstMessageContext).arrived(); err != nil {
			b.Fatal(err)
		}
	}
}
