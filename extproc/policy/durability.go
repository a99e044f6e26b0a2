package policy

import (
	"fmt"
	"time"

	"go.yaml.in/yaml/v3"
)

// Durability says how many replicas of the store must acknowledge a request's claim, and then its
// completion, before the processor relies on them, so that a failover of the store cannot lose
// them (cache.Claim.Replicas).
type Durability struct {
	// Replicas is how many replicas must acknowledge each write; 0 waits for none.
	Replicas int
	// Timeout bounds each wait: more than 0 and at most store_timeout.
	Timeout time.Duration
}

// DefaultDurabilityTimeout is the built-in durability.timeout.
const DefaultDurabilityTimeout = 50 * time.Millisecond

// durabilityDoc documents the top-level durability field; the route's refers to it.
const durabilityDoc = "waits after each claim and each completion until `replicas` replicas of the Redis master acknowledge it, for at most `timeout` (at least `1ms`, at most `store_timeout`); a claim they do not confirm in time is withdrawn and answered as a store failure (`fail_mode`), a completion is kept, counted in `idempotency_durability_unconfirmed_total` and logged; `replicas: 0` waits for none; the memory store refuses `replicas` above 0"

// durabilityCheck is a durability mapping the file gives, checked against store_timeout once the
// whole file is read (store_timeout may come after it).
type durabilityCheck struct {
	route *Route // nil for the top level
	path  string
	node  *yaml.Node // the mapping
	// timeout is the timeout field's value, when the mapping gives it.
	timeout *yaml.Node
}

// durability reads a durability mapping over dst, field by field, and records it for
// checkDurability; route is the route it belongs to, nil at the top level.
func (d *decoder) durability(dst *Durability, route *Route, v *yaml.Node, path string) {
	base := *dst
	var timeout *yaml.Node
	d.fields(v, path, func(key string, k, fv *yaml.Node, at string) {
		switch key {
		case "replicas":
			if n, ok := d.intIn(fv, at, 0, maxReplicas, fmt.Sprintf("between 0 (off) and %d", maxReplicas)); ok {
				base.Replicas = n
			}
		case "timeout":
			timeout = fv
			if t, ok := d.duration(fv, at, time.Millisecond, MaxDuration, " (ten years)"); ok {
				base.Timeout = t
			}
		default:
			d.unknown(k, at, []string{"replicas", "timeout"})
		}
	})
	*dst = base
	d.durabilities = append(d.durabilities, durabilityCheck{route: route, path: path, node: v, timeout: timeout})
}

// maxReplicas bounds durability.replicas: far more replicas than any master has.
const maxReplicas = 1000

// checkDurability refuses a durability whose wait does not fit within store_timeout: a timeout
// the file gives, or one inherited by a durability that waits for replicas.
func (d *decoder) checkDurability(p *Policy) {
	for _, c := range d.durabilities {
		dur := p.Durability
		if c.route != nil {
			dur = c.route.Durability
		}
		if (c.timeout == nil && dur.Replicas == 0) || dur.Timeout <= p.StoreTimeout {
			continue
		}
		node, from := c.timeout, ""
		switch {
		case node != nil:
		case c.route != nil:
			node, from = c.node, " (inherited)"
		default:
			node, from = c.node, " (the default)"
		}
		d.fail(node, join(c.path, "timeout"), "%v%s exceeds store_timeout %v, which bounds each store call, the wait for replicas included", dur.Timeout, from, p.StoreTimeout)
	}
}
