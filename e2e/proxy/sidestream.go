package proxy

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// openTimeout bounds opening a stream when no message timer runs (FULL_DUPLEX_STREAMED and
// observability mode): the processor cluster's connect_timeout in the shipped configs.
const openTimeout = 5 * time.Second

// errOpenDeadline is the cause of an open that ran into the message timer.
var errOpenDeadline = errors.New("proxy: message timer expired while opening the stream")

// recvResult is one ProcessingResponse, or the error that ended the stream.
type recvResult struct {
	resp *extprocv3.ProcessingResponse
	err  error
}

// sideStream is the ext_proc gRPC stream of one HTTP request (ExternalProcessorStreamImpl). The
// exchange's goroutine queues messages and closes; one goroutine started by open writes the queue
// to the stream and another receives into recv. Sending never blocks the exchange: Envoy's
// Grpc::AsyncStream::sendMessage (async_client_impl.cc) encodes into the HTTP/2 stream's buffer
// and returns, whatever the processor's flow-control window, so a processor that answers while
// Envoy still sends chunks never deadlocks it. Its context derives from the proxy's, not the
// request's, so that observability mode can close it after the request
// (deferred_close_timeout).
type sideStream struct {
	p      *Proxy
	index  int // of the processor in Config.Processors
	addr   string
	ctx    context.Context
	cancel context.CancelFunc
	stream extprocv3.ExternalProcessor_ProcessClient
	recv   chan recvResult
	done   chan struct{} // closed when the receiving goroutine ends
	// closed is set once Envoy's side has closed the stream (closeStream): later messages are
	// not sent and answers are ignored.
	closed bool
	// ended is set once recv delivered the stream's end.
	ended bool

	// The send queue: messages in order, then the half-close; wake (capacity 1) tells the
	// writing goroutine there is news; written is closed when that goroutine ends.
	outMu     sync.Mutex
	out       []*extprocv3.ProcessingRequest
	halfClose bool
	wake      chan struct{}
	written   chan struct{}
	// halfClosed is closed once the half-close is written (or the writer gave up).
	halfClosed chan struct{}
}

// open starts the stream with its initial metadata (AsyncStreamImpl::initialize: the
// grpc_service initial_metadata, then the trace context) and its receiving goroutine. deadline
// bounds the attempt; the zero time means openTimeout. StreamRetries other processors are tried
// when one refuses the stream, as grpc_service's retry_policy with connect-failure or
// refused-stream does: nothing reached it.
func (s *sideStream) open(md []*corev3.HeaderValue, deadline time.Time, discard bool) error {
	if deadline.IsZero() {
		deadline = time.Now().Add(openTimeout)
	}
	pairs := make([]string, 0, 2*len(md))
	for _, hv := range md {
		v := hv.GetValue()
		if v == "" {
			v = string(hv.GetRawValue())
		}
		pairs = append(pairs, strings.ToLower(hv.GetKey()), v)
	}
	// The stream lives on s.ctx; a timer bounds the wait for a transport by cancelling it
	// (the exchange then treats the stream as timed out and closes it).
	var expired atomic.Bool
	t := time.AfterFunc(time.Until(deadline), func() {
		expired.Store(true)
		s.cancel()
	})
	sctx := metadata.NewOutgoingContext(s.ctx, metadata.Pairs(pairs...))
	st, err := s.p.clients[s.index].Process(sctx)
	for retry := 0; err != nil && status.Code(err) == codes.Unavailable && retry < s.p.cfg.StreamRetries && !expired.Load(); retry++ {
		i := s.p.pick(s.index)
		s.index, s.addr = i, s.p.cfg.Processors[i]
		st, err = s.p.clients[s.index].Process(sctx)
	}
	if !t.Stop() || expired.Load() {
		return errOpenDeadline
	}
	if err != nil {
		return err
	}
	s.stream = st
	s.p.stats.streamsStarted.Add(1)
	s.recv = make(chan recvResult)
	s.done = make(chan struct{})
	s.wake = make(chan struct{}, 1)
	s.written = make(chan struct{})
	s.halfClosed = make(chan struct{})
	go s.receive(discard)
	go s.write()
	return nil
}

// write sends the queued messages in order and, once asked and the queue is empty, half-closes.
// It ends there, on a failed send (the stream's end arrives on recv) or when the context ends.
func (s *sideStream) write() {
	defer close(s.written)
	defer close(s.halfClosed)
	for {
		select {
		case <-s.wake:
		case <-s.ctx.Done():
			return
		}
		for {
			s.outMu.Lock()
			batch, half := s.out, s.halfClose
			s.out = nil
			s.outMu.Unlock()
			if len(batch) == 0 {
				if half {
					_ = s.stream.CloseSend()
					return
				}
				break
			}
			for _, m := range batch {
				if err := s.stream.Send(m); err != nil {
					return
				}
				s.p.stats.messagesSent.Add(1)
			}
		}
	}
}

// poke wakes the writing goroutine.
func (s *sideStream) poke() {
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

// receive delivers every answer, then the error that ended the stream, until the stream's
// context is done. With discard (observability mode) answers are read and dropped.
func (s *sideStream) receive(discard bool) {
	defer close(s.done)
	for {
		resp, err := s.stream.Recv()
		if discard && err == nil {
			continue
		}
		select {
		case s.recv <- recvResult{resp: resp, err: err}:
		case <-s.ctx.Done():
			return
		}
		if err != nil {
			return
		}
	}
}

// send queues one message. A failure to send it is not reported: the stream's end arrives on
// recv.
func (s *sideStream) send(req *extprocv3.ProcessingRequest) bool {
	if s.closed || s.stream == nil {
		return false
	}
	s.outMu.Lock()
	s.out = append(s.out, req)
	s.outMu.Unlock()
	s.poke()
	return true
}

// active reports whether answers may still arrive.
func (s *sideStream) active() bool {
	return s != nil && s.stream != nil && !s.closed && !s.ended
}

// closeGrace bounds the wait between the half-close and the reset; drainBound the wait for the
// queued messages and the half-close to be written before it.
const (
	closeGrace = 20 * time.Millisecond
	drainBound = time.Second
)

// close ends the stream the way Envoy's default close does (ExternalProcessorStreamImpl::close
// without ext_proc_graceful_grpc_close): a half-close followed by a reset, so the server's Recv
// sees io.EOF or Canceled. Envoy's half-close goes after the messages its stream
// buffered; here they wait in the send queue, so the half-close is written after them (up to
// drainBound, for a processor that stopped reading), and grpc-go, which drops what it still
// queues at a reset, gets up to closeGrace for the server to end the stream after it. It waits
// for the receiving and writing goroutines.
func (s *sideStream) close() {
	if s == nil {
		return
	}
	s.closed = true
	if s.stream != nil {
		s.outMu.Lock()
		s.halfClose = true
		s.outMu.Unlock()
		s.poke()
		s.drainUntil(s.halfClosed, drainBound)
		s.drainUntil(nil, closeGrace)
	}
	s.cancel()
	if s.done != nil {
		<-s.done
		<-s.written
	}
}

// drainUntil discards answers until stop is closed, the stream ends, or d passes.
func (s *sideStream) drainUntil(stop <-chan struct{}, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	for !s.ended {
		select {
		case <-stop:
			return
		case r := <-s.recv:
			if r.err != nil {
				s.ended = true
			}
		case <-s.done:
			return
		case <-t.C:
			return
		}
	}
}

// deferredClose closes the stream after d, or when the proxy closes (DeferredDeletableStream in
// observability mode). The proxy's WaitGroup tracks it.
func (s *sideStream) deferredClose(d time.Duration) {
	s.p.wg.Add(1)
	go func() {
		defer s.p.wg.Done()
		t := time.NewTimer(d)
		defer t.Stop()
		select {
		case <-t.C:
		case <-s.p.ctx.Done():
		}
		s.close()
	}()
}
