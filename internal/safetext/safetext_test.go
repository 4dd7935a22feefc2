package safetext

import (
	"bytes"
	"encoding/json"
	"testing"
	"unicode/utf8"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

func TestEscape(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"spawn/vm1", "spawn/vm1"},
		{`C:\path ünïcode 名前`, `C:\path ünïcode 名前`},
		{"\x1b]0;owned\a\x1b[2J", `\x1b]0;owned\x07\x1b[2J`},
		{"a\nstate\trunning\r", `a\nstate\trunning\r`},
		{"del\x7f", `del\x7f`},
		{"c1 \u009b2J", `c1 \u009b2J`},
		{"bidi \u202eevil\u2066", `bidi \u202eevil\u2066`},
		{"bad \xff\xfe utf8", `bad \xff\xfe utf8`},
	} {
		got := Escape(tc.in)
		assert.Equal(t, tc.want, got, "Escape(%q)", tc.in)
		assert.Equal(t, tc.in != tc.want, Needed(tc.in), "Needed(%q)", tc.in)
	}
}

func FuzzEscape(f *testing.F) {
	f.Add("\x1b[2J\nstate running")
	f.Add("\u009b\u202e\xff")
	f.Fuzz(func(t *testing.T, s string) {
		out := Escape(s)
		if !utf8.ValidString(out) {
			t.Fatalf("Escape(%q) = %q: not UTF-8", s, out)
		}
		for _, r := range out {
			if unsafeRune(r) {
				t.Fatalf("Escape(%q) = %q keeps %U", s, out, r)
			}
		}
		js, err := json.Marshal(s)
		if err != nil {
			t.Fatal(err)
		}
		safe := EscapeJSON(js)
		var back string
		if err := json.Unmarshal(safe, &back); err != nil {
			t.Fatalf("EscapeJSON(%s) = %s: %v", js, safe, err)
		}
		var orig string
		_ = json.Unmarshal(js, &orig)
		if back != orig {
			t.Fatalf("EscapeJSON changed the value: %q != %q", back, orig)
		}
		for _, r := range string(safe) {
			if unsafeRune(r) {
				t.Fatalf("EscapeJSON(%s) keeps %U", js, r)
			}
		}
	})
}

func TestJSONEncoderEscapesC1AndBidi(t *testing.T) {
	var out bytes.Buffer
	core := zapcore.NewCore(JSONEncoder(zap.NewProductionEncoderConfig()), zapcore.AddSync(&out), zap.InfoLevel)
	log := zap.New(core).With(zap.String("workflow_id", "wf\u009b2J"))
	log.Info("qemu said", zap.String("stderr", "\x1b[2J\u202eboom"))
	line := out.String()
	for _, bad := range []string{"\x1b", "\u009b", "\u202e"} {
		assert.NotContains(t, line, bad)
	}
	var m map[string]any
	require.NoError(t, json.Unmarshal(out.Bytes(), &m))
	assert.Equal(t, "wf\u009b2J", m["workflow_id"], "the value survives, escaped only in the text")
	assert.Equal(t, "\x1b[2J\u202eboom", m["stderr"])
}
