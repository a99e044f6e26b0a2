// Package chunks is an array that grows a chunk at a time and never moves what it holds.
package chunks

// chunkBits sets the elements of a chunk: 4096.
const chunkBits = 12

const chunkLen = 1 << chunkBits

// Array grows a chunk at a time and never moves what it holds, so that growing it costs neither a
// copy of what it holds nor the page faults of a larger array, under its owner's lock: appending
// to one slice of entries stalled a memory store's call for 3 to 150 ms each time the slice grew,
// as an empty store filled to a quarter of a million records. The zero value is empty. It is not
// safe for concurrent use.
type Array[T any] struct {
	c [][]T
	n int32
}

// At returns element i, which must be below Len. The pointer stays valid while i is.
func (a *Array[T]) At(i int32) *T { return &a.c[i>>chunkBits][i&(chunkLen-1)] }

// Len returns the number of elements.
func (a *Array[T]) Len() int32 { return a.n }

// Push appends v, in a new chunk if the last is full.
func (a *Array[T]) Push(v T) {
	if int(a.n) == len(a.c)*chunkLen {
		a.c = append(a.c, make([]T, chunkLen))
	}
	a.n++
	*a.At(a.n - 1) = v
}

// Pop removes the last element, and keeps its chunk for later pushes.
func (a *Array[T]) Pop() {
	var zero T
	a.n--
	*a.At(a.n) = zero
}
