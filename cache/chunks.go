package cache

// chunkBits sets the elements of a chunk: 4096.
const chunkBits = 12

const chunkLen = 1 << chunkBits

// chunks is an array that grows a chunk at a time and never moves what it holds, so that growing
// it costs neither a copy of what it holds nor the page faults of a larger array, under the
// store's lock: appending to one slice of entries stalled a call for 3 to 150 ms each time the
// slice grew, as an empty store filled to a quarter of a million records.
type chunks[T any] struct {
	c [][]T
	n int32
}

// at returns element i, which must be below len.
func (a *chunks[T]) at(i int32) *T { return &a.c[i>>chunkBits][i&(chunkLen-1)] }

func (a *chunks[T]) len() int32 { return a.n }

// push appends v, in a new chunk if the last is full.
func (a *chunks[T]) push(v T) {
	if int(a.n) == len(a.c)*chunkLen {
		a.c = append(a.c, make([]T, chunkLen))
	}
	a.n++
	*a.at(a.n - 1) = v
}

// pop removes the last element, and keeps its chunk for later pushes.
func (a *chunks[T]) pop() {
	var zero T
	a.n--
	*a.at(a.n) = zero
}
