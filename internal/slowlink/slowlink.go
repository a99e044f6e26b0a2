// Package slowlink is a TCP proxy for tests whose replies come late: a congested server or,
// with a delay longer than the test, a peer that vanished without closing anything.
package slowlink

import (
	"bytes"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// Start forwards the connections made to the address it returns to addr, and holds each reply
// (what addr sends back) by delay, as delay reads when the reply arrives, keeping their order.
// Requests pass at once. The proxy and its connections close when t ends.
func Start(t testing.TB, addr string, delay *atomic.Int64) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("slowlink: %v", err)
	}
	closed := make(chan struct{})
	var (
		mu    sync.Mutex
		conns []net.Conn
		wg    sync.WaitGroup
	)
	t.Cleanup(func() {
		close(closed)
		_ = l.Close()
		mu.Lock()
		for _, c := range conns {
			_ = c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			client, err := l.Accept()
			if err != nil {
				return
			}
			server, err := net.Dial("tcp", addr)
			if err != nil {
				_ = client.Close()
				continue
			}
			mu.Lock()
			conns = append(conns, client, server)
			mu.Unlock()
			wg.Add(2)
			go func() {
				defer wg.Done()
				_, _ = io.Copy(server, client)
				_ = server.Close()
			}()
			go func() {
				defer wg.Done()
				holdBack(server, client, delay, closed)
			}()
		}
	}()
	return l.Addr().String()
}

// holdBack copies src to dst in order, each read delay after it arrived, until closed.
func holdBack(src, dst net.Conn, delay *atomic.Int64, closed <-chan struct{}) {
	type chunk struct {
		b   []byte
		due time.Time
	}
	chunks := make(chan chunk, 1024)
	written := make(chan struct{})
	go func() {
		defer close(written)
		defer dst.Close()
		for c := range chunks {
			select {
			case <-time.After(time.Until(c.due)):
			case <-closed:
				return
			}
			if _, err := dst.Write(c.b); err != nil {
				_ = src.Close()
				return
			}
		}
	}()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			select {
			case chunks <- chunk{bytes.Clone(buf[:n]), time.Now().Add(time.Duration(delay.Load()))}:
			case <-written:
			}
		}
		if err != nil {
			close(chunks)
			<-written
			return
		}
	}
}
