package stubvmm

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
)

func TestAnswer(t *testing.T) {
	var s session
	say := func(line string) (string, bool) {
		r := s.answer([]byte(line))
		return string(out[:r.n]), r.exit
	}
	for _, tc := range []struct{ in, want string }{
		{`{"execute": "query-status", "id": "vmflow-1"}`, `{"error": {"class": "CommandNotFound", "desc": "Expecting capabilities negotiation with 'qmp_capabilities'"}, "id": "vmflow-1"}` + "\n"},
		{`{"execute":"qmp_capabilities","id":"vmflow-2"}`, `{"return": {}, "id": "vmflow-2"}` + "\n"},
		{`{"execute":"qmp_capabilities"}`, `{"error": {"class": "CommandNotFound", "desc": "Capabilities negotiation is already complete, command ignored"}}` + "\n"},
		{` { "id" : {"a": ["}", 1]} , "arguments": {"x": [1, {"y": "\"}"}]}, "execute" : "query-status" } `, `{"return": {"status": "running", "singlestep": false, "running": true}, "id": {"a": ["}", 1]}}` + "\n"},
		{`{"execute": "query-block", "id": 7}`, `{"error": {"class": "CommandNotFound", "desc": "The command 'query-block' has not been found"}, "id": 7}` + "\n"},
		{`{"execute": "x\"y,}"}`, `{"error": {"class": "CommandNotFound", "desc": "The command 'xy' has not been found"}}` + "\n"},
		{`{"id": 5}`, `{"error": {"class": "GenericError", "desc": "QMP input must be a JSON object with member 'execute'"}, "id": 5}` + "\n"},
		{`{"execute": 5}`, `{"error": {"class": "GenericError", "desc": "QMP input must be a JSON object with member 'execute'"}}` + "\n"},
		{`[1]`, `{"error": {"class": "GenericError", "desc": "QMP input must be a JSON object with member 'execute'"}}` + "\n"},
		{`{"execute": "quit"`, `{"error": {"class": "GenericError", "desc": "QMP input must be a JSON object with member 'execute'"}}` + "\n"},
		{"  \r", ""},
	} {
		got, exit := say(tc.in)
		assert.Equal(t, tc.want, got, "reply to %s", tc.in)
		assert.False(t, exit, "%s ends nothing", tc.in)
		if got != "" {
			assert.True(t, json.Valid([]byte(got)), "valid JSON: %s", got)
		}
	}
	for _, end := range []string{"quit", "system_powerdown"} {
		got, exit := say(`{"execute": "` + end + `", "id": "x"}`)
		assert.Equal(t, `{"return": {}, "id": "x"}`+"\n", got)
		assert.True(t, exit, "%s ends the VM", end)
	}
}

func TestChardevFD(t *testing.T) {
	for opt, want := range map[string]int{
		"socket,id=qmp,fd=3,server=on,wait=off": 3,
		"socket,fd=17":                          17,
		"socket,id=fd=9,fd=12":                  12,
		"stdio,id=serial0,fd=3":                 -1,
		"socket,id=qmp,fd=,server=on":           -1,
		"socket,id=qmp,fd=3x":                   -1,
		"socket,id=qmp,fd=1234567890":           -1,
		"socket,path=/x":                        -1,
	} {
		fd, ok := chardevFD([]byte(opt))
		if want < 0 {
			assert.False(t, ok, "%s", opt)
			continue
		}
		assert.True(t, ok, "%s", opt)
		assert.Equal(t, want, fd, "%s", opt)
	}
}

// FuzzAnswer: whatever a client sends, the stub neither panics (without
// its runtime a panic is a crash) nor sends anything but one JSON line.
func FuzzAnswer(f *testing.F) {
	for _, s := range []string{`{"execute":"qmp_capabilities","id":"a"}`, `{"execute": "quit"}`, `{"id": [1, {"x": "}"}], "execute": "q"}`, `{"`, `{"a":`, `{"a":"\`, `{"execute":"x","id":}`, `{"id":{`} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, line string) {
		if strings.ContainsRune(line, '\n') || len(line) > maxLine {
			return
		}
		s := session{negotiated: true}
		r := s.answer([]byte(line))
		if r.n == 0 {
			return
		}
		got := out[:r.n]
		if !strings.HasSuffix(string(got), "\n") || strings.Count(string(got), "\n") != 1 {
			t.Fatalf("reply %q is not one line", got)
		}
		var v map[string]any
		if err := json.Unmarshal(got, &v); err != nil && json.Valid([]byte(line)) {
			t.Fatalf("reply %q to valid JSON %q: %v", got, line, err)
		}
	})
}
