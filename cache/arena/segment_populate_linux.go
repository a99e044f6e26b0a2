package arena

import "syscall"

// mapPopulate has a new segment's pages populated by the mmap call itself. A store that grows
// otherwise takes a page fault per 4 KiB as records are written to its new segments, under its
// lock: in the benchmark runs (docs/runs/history.md), populating costs half the CPU of those
// faults (0.35 against 0.73 ms per 256 KiB segment), and a growing store's first executions took
// 20-24 µs less CPU each in two paired comparative runs.
const mapPopulate = syscall.MAP_POPULATE
