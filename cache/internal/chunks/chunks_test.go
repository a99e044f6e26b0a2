package chunks

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// An Array holds what is pushed, in order, across chunks, and never moves an element.
func TestArrayGrowsWithoutMoving(t *testing.T) {
	var a Array[int]
	a.Push(0)
	first := a.At(0)
	const n = 3*chunkLen + 10
	for i := 1; i < n; i++ {
		a.Push(i)
	}
	require.Equal(t, int32(n), a.Len())
	require.Same(t, first, a.At(0), "growing moved nothing")
	for i := range int32(n) {
		require.Equal(t, int(i), *a.At(i))
	}
	for range chunkLen + 5 {
		a.Pop()
	}
	require.Equal(t, int32(n-chunkLen-5), a.Len())
	a.Push(-1)
	require.Equal(t, -1, *a.At(a.Len() - 1))
	require.Same(t, first, a.At(0))
}
