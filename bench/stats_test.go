package bench

import (
	"bufio"
	"context"
	"net"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestSummarize(t *testing.T) {
	var ds []time.Duration
	for i := 100; i >= 1; i-- {
		ds = append(ds, time.Duration(i)*time.Millisecond)
	}
	s := Summarize(ds)
	assert.Equal(t, 100, s.N)
	assert.Equal(t, 50*time.Millisecond, s.Median)
	assert.Equal(t, 99*time.Millisecond, s.P99)
	assert.Equal(t, time.Millisecond, s.Min)
	assert.Equal(t, 100*time.Millisecond, s.Max)
	assert.Equal(t, 100*time.Millisecond, ds[0], "input left unsorted")

	small := Summarize([]time.Duration{3, 1, 2})
	assert.Equal(t, time.Duration(2), small.Median)
	assert.Equal(t, time.Duration(3), small.P99, "with few samples p99 is the maximum")
	assert.Equal(t, Summary{}, Summarize(nil))
}

func TestFormat(t *testing.T) {
	assert.Equal(t, "0.250", MS(250*time.Microsecond))
	assert.Equal(t, "12.5", MS(12500*time.Microsecond))
	assert.Equal(t, "1500", MS(1500*time.Millisecond))
	assert.Equal(t, "-9.2", MS(-9245*time.Microsecond))
	assert.Equal(t, "2.00×", Ratio(2*time.Second, time.Second))
	assert.Equal(t, "n/a", Ratio(time.Second, 0))
	tab := Table{Header: []string{"a", "b"}}
	tab.Add("x|y", "1")
	assert.Equal(t, "| a | b |\n| --- | --- |\n| x\\|y | 1 |\n", tab.Markdown())
}

// TestRawQMP drives the minimal client against a scripted server that
// sends events before the greeting and between command and reply, and
// closes the connection instead of answering "quit", as QEMU may.
func TestRawQMP(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "qmp.sock")
	ln, err := net.Listen("unix", sock)
	require.NoError(t, err)
	defer ln.Close()
	got := make(chan []string, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		r := bufio.NewReader(c)
		var cmds []string
		defer func() { got <- cmds }()
		_, _ = c.Write([]byte(`{"event":"RESUME"}` + "\n" + `{"QMP":{"version":{}}}` + "\n"))
		for {
			line, err := r.ReadString('\n')
			if err != nil {
				return
			}
			cmds = append(cmds, strings.TrimSpace(line))
			switch {
			case strings.Contains(line, "quit"):
				return
			case strings.Contains(line, "bogus"):
				_, _ = c.Write([]byte(`{"error":{"class":"CommandNotFound","desc":"nope"}}` + "\n"))
			default:
				_, _ = c.Write([]byte(`{"event":"X"}` + "\n" + `{"return":{}}` + "\n"))
			}
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	q, err := DialRawQMP(ctx, sock)
	require.NoError(t, err)
	defer q.Close()
	require.NoError(t, q.Execute(ctx, "system_powerdown"))
	err = q.Execute(ctx, "bogus")
	require.Error(t, err)
	assert.Contains(t, err.Error(), "CommandNotFound")
	assert.ErrorIs(t, q.Execute(ctx, "quit"), ErrQMPClosed)
	assert.Equal(t, []string{`{"execute":"qmp_capabilities"}`, `{"execute":"system_powerdown"}`, `{"execute":"bogus"}`, `{"execute":"quit"}`}, <-got)
}
