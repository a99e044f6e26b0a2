//go:build unix && !linux

package cache

// mapPopulate is Linux's: elsewhere a new segment's pages are faulted in as they are written.
const mapPopulate = 0
