// Package clock abstracts time so that leases, TTLs and renewals can be tested without sleeping.
package clock

import (
	"sort"
	"sync"
	"time"
)

// Clock tells the time and runs functions later. Implementations are safe for concurrent use.
type Clock interface {
	// Now returns the current time.
	Now() time.Time
	// AfterFunc calls f in its own goroutine once d has elapsed, unless the returned Timer is
	// stopped first.
	AfterFunc(d time.Duration, f func()) Timer
}

// Timer is a pending call made by [Clock.AfterFunc].
type Timer interface {
	// Stop prevents the call from running. It reports whether it stopped the call, false when the
	// call already ran or was stopped.
	Stop() bool
	// Reset makes the call due d from now, as [time.Timer.Reset] does: it reports whether the
	// call was still pending, and schedules it again when it had run or was stopped.
	Reset(d time.Duration) bool
}

// Real is the wall clock.
type Real struct{}

// Now implements [Clock.Now].
func (Real) Now() time.Time { return time.Now() }

// AfterFunc implements [Clock.AfterFunc] with [time.AfterFunc].
func (Real) AfterFunc(d time.Duration, f func()) Timer { return time.AfterFunc(d, f) }

// Fake is a manual clock for tests: time moves only when Advance is called, and Advance runs
// every function that became due, in order of due time, before it returns.
type Fake struct {
	mu      sync.Mutex
	now     time.Time
	pending []*fakeTimer
}

// NewFake returns a Fake clock set to start.
func NewFake(start time.Time) *Fake { return &Fake{now: start} }

// Now implements [Clock.Now].
func (c *Fake) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

// AfterFunc implements [Clock.AfterFunc]. The function runs synchronously inside the Advance call
// that makes it due, so a test observes its effects as soon as Advance returns.
func (c *Fake) AfterFunc(d time.Duration, f func()) Timer {
	c.mu.Lock()
	defer c.mu.Unlock()
	t := &fakeTimer{clock: c, due: c.now.Add(d), f: f}
	c.pending = append(c.pending, t)
	return t
}

// Pending reports how many functions are waiting to run.
func (c *Fake) Pending() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.pending)
}

// Advance moves the clock forward by d, running due functions at their due times.
func (c *Fake) Advance(d time.Duration) {
	c.mu.Lock()
	end := c.now.Add(d)
	for {
		sort.SliceStable(c.pending, func(i, j int) bool { return c.pending[i].due.Before(c.pending[j].due) })
		if len(c.pending) == 0 || c.pending[0].due.After(end) {
			break
		}
		t := c.pending[0]
		c.pending = c.pending[1:]
		if t.due.After(c.now) {
			c.now = t.due
		}
		c.mu.Unlock()
		t.f()
		c.mu.Lock()
	}
	c.now = end
	c.mu.Unlock()
}

type fakeTimer struct {
	clock *Fake
	due   time.Time
	f     func()
}

func (t *fakeTimer) Reset(d time.Duration) bool {
	was := t.Stop()
	c := t.clock
	c.mu.Lock()
	defer c.mu.Unlock()
	t.due = c.now.Add(d)
	c.pending = append(c.pending, t)
	return was
}

func (t *fakeTimer) Stop() bool {
	c := t.clock
	c.mu.Lock()
	defer c.mu.Unlock()
	for i, p := range c.pending {
		if p == t {
			c.pending = append(c.pending[:i], c.pending[i+1:]...)
			return true
		}
	}
	return false
}
