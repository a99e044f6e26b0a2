package extproc

import (
	"time"
)

// durabilityLogInterval is the least time between two log lines saying why covered requests get
// durability-unmet: one per request would flood the log for as long as the replicas are missing.
const durabilityLogInterval = 10 * time.Second

// SetReplicas tells s how many replicas its store has now (cache.Replicated), as a readiness
// check counted them, or, with n below 0, that it does not know (the store did not answer). While
// it knows, a covered request of a route whose durability.replicas is above n is answered 503
// durability-unmet (or passes unprotected under fail_mode: open) without a store call: its claim
// could only be withdrawn unconfirmed. While it does not (as before the first call), requests go
// to the store, which judges each claim itself. Safe for concurrent use.
func (s *Server) SetReplicas(n int) {
	s.replicasSeen.Store(int64(max(n, -1)) + 1)
}

// durabilityUnmet reports whether the store is known to have fewer replicas than need.
func (s *Server) durabilityUnmet(need int) bool {
	seen := s.replicasSeen.Load()
	return seen > 0 && seen-1 < int64(need)
}

// undurable reports whether the store is known to have fewer replicas than need, and then keeps
// errDurabilityUnmet as the claim's failure (the request's outcome is durability_unmet) and logs
// the cause at most once per durabilityLogInterval.
func (c *leaseCall) undurable(need int) bool {
	s := c.s
	if !s.durabilityUnmet(need) {
		return false
	}
	now := s.clock.Now().UnixNano()
	if last := s.durabilityLogged.Load(); (last == 0 || now-last >= int64(durabilityLogInterval)) && s.durabilityLogged.CompareAndSwap(last, now) {
		c.event(s.log.Warn()).Int("durability_replicas", need).Int64("replicas_seen", s.replicasSeen.Load()-1).
			Msg("durability.replicas asks for more replicas than the store has: covered requests of this route get durability-unmet until a replica is attached (logged at most every 10s)")
	}
	if c.err == nil {
		c.err = errDurabilityUnmet
	}
	return true
}
