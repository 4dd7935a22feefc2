package topology_test

import (
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/topology"
)

func TestParseCPUList(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want []int
	}{
		{"", []int{}},
		{"\n", []int{}},
		{"0", []int{0}},
		{"0-1\n", []int{0, 1}},
		{"0-3,8-11", []int{0, 1, 2, 3, 8, 9, 10, 11}},
		{"5,1-2", []int{1, 2, 5}},
		{"0-3,2-5,4", []int{0, 1, 2, 3, 4, 5}},
		{"7-7", []int{7}},
		{"65535", []int{65535}},
	} {
		got, err := topology.ParseCPUList(tc.in)
		if assert.NoError(t, err, "%q", tc.in) {
			assert.Equal(t, tc.want, got, "%q", tc.in)
		}
	}
	for _, in := range []string{
		"a", "-1", "1-", "-", "3-1", "0,,1", ",", "0 ,1", " 0", "0-3:2/4", "+1",
		"65536", "0-65536", "0-4294967295", "99999999999999999999", "0\n\n", "0x1",
	} {
		_, err := topology.ParseCPUList(in)
		assert.ErrorIs(t, err, topology.ErrMalformed, "%q", in)
	}
}

// A list that repeats the widest range as often as fits in a page costs
// the parse one range's work, not thousands.
func TestParseCPUListRepeatsCostOnce(t *testing.T) {
	in := strings.TrimSuffix(strings.Repeat("0-65535,", 4000), ",")
	got, err := topology.ParseCPUList(in)
	require.NoError(t, err)
	assert.Len(t, got, topology.MaxCPUs)
}

func TestFormatCPUList(t *testing.T) {
	assert.Equal(t, "", topology.FormatCPUList(nil))
	assert.Equal(t, "0", topology.FormatCPUList([]int{0}))
	assert.Equal(t, "0-3,8-11", topology.FormatCPUList([]int{8, 9, 10, 11, 0, 1, 2, 3}))
	assert.Equal(t, "1,3,5-6", topology.FormatCPUList([]int{6, 5, 3, 1, 5}))
}

// FuzzParseCPUList: no input panics; what parses is ascending, distinct
// and in range, and its formatted form parses back to it.
func FuzzParseCPUList(f *testing.F) {
	for _, s := range []string{"", "0", "0-3,8-11", "5,1-2", "0-65535", "3-1", "0,,1", "a-b", "1-2-3", "0-\n"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		cpus, err := topology.ParseCPUList(s)
		if err != nil {
			if !assert.ErrorIs(t, err, topology.ErrMalformed) {
				t.FailNow()
			}
			return
		}
		for i, c := range cpus {
			if c < 0 || c >= topology.MaxCPUs || (i > 0 && c <= cpus[i-1]) {
				t.Fatalf("%q parsed to %v: not ascending and in range at %d", s, cpus, i)
			}
		}
		back, err := topology.ParseCPUList(topology.FormatCPUList(cpus))
		require.NoError(t, err)
		if !slices.Equal(cpus, back) {
			t.Fatalf("%q: %v formats as %q, which parses to %v", s, cpus, topology.FormatCPUList(cpus), back)
		}
		// Each number the input names is listed.
		for part := range strings.SplitSeq(strings.TrimSuffix(s, "\n"), ",") {
			lo, _, _ := strings.Cut(part, "-")
			if n, err := strconv.Atoi(lo); err == nil && s != "" {
				if _, ok := slices.BinarySearch(cpus, n); !ok {
					t.Fatalf("%q: %d missing from %v", s, n, cpus)
				}
			}
		}
	})
}
