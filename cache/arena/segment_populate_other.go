//go:build unix && !linux

package arena

// mapPopulate is Linux's: elsewhere a new segment's pages are faulted in as they are written.
const mapPopulate = 0
