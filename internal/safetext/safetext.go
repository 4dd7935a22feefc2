// Package safetext escapes text that a guest, QEMU or a caller wrote before
// it reaches an operator's terminal: a workflow id the Temporal server
// accepted with escape sequences in it, QEMU's stderr, a guest's serial
// output. A terminal acts on C0 and C1 control characters (ESC starts a CSI
// or OSC sequence that can retitle the window, clear the screen or move the
// cursor to overwrite rows), and bidirectional formatting characters reorder
// what is shown; a newline or tab inside a field forges a row of a table.
// Everything else is printed as it is.
package safetext

import (
	"fmt"
	"strings"
	"unicode/utf8"
)

// unsafeRune reports whether r must not reach a terminal raw: C0 (tab and
// newline forge columns and rows), DEL, C1 (U+009B is a one-character CSI),
// and bidi formatting ("Trojan Source", CVE-2021-42574).
func unsafeRune(r rune) bool {
	switch {
	case r < 0x20, r == 0x7f, r >= 0x80 && r <= 0x9f:
		return true
	case r == 0x061c, r == 0x200e, r == 0x200f,
		r >= 0x202a && r <= 0x202e, r >= 0x2066 && r <= 0x2069:
		return true
	}
	return false
}

// Needed reports whether Escape would change s.
func Needed(s string) bool {
	for i := 0; i < len(s); {
		r, n := utf8.DecodeRuneInString(s[i:])
		if (r == utf8.RuneError && n == 1) || unsafeRune(r) {
			return true
		}
		i += n
	}
	return false
}

// Escape writes every unsafe rune of s as a Go quoted string would (\x1b,
// \u202e) and non-UTF-8 bytes as \xNN; printable text is kept.
func Escape(s string) string {
	if !Needed(s) {
		return s
	}
	var b strings.Builder
	b.Grow(len(s) + 16)
	for i := 0; i < len(s); {
		r, n := utf8.DecodeRuneInString(s[i:])
		switch {
		case r == utf8.RuneError && n == 1:
			fmt.Fprintf(&b, `\x%02x`, s[i])
		case r == '\n':
			b.WriteString(`\n`)
		case r == '\r':
			b.WriteString(`\r`)
		case r == '\t':
			b.WriteString(`\t`)
		case r < 0x80 && unsafeRune(r):
			fmt.Fprintf(&b, `\x%02x`, r)
		case unsafeRune(r):
			fmt.Fprintf(&b, `\u%04x`, r)
		default:
			b.WriteString(s[i : i+n])
		}
		i += n
	}
	return b.String()
}

// EscapeJSON writes every non-ASCII unsafe rune of JSON js as \uXXXX: encoders
// pass C1 and bidi controls through, and outside strings JSON is ASCII, so the
// escape means the same character.
func EscapeJSON(js []byte) []byte {
	clean := true
	for i := 0; i < len(js); {
		if js[i] < utf8.RuneSelf {
			i++
			continue
		}
		r, n := utf8.DecodeRune(js[i:])
		if unsafeRune(r) {
			clean = false
			break
		}
		i += n
	}
	if clean {
		return js
	}
	out := make([]byte, 0, len(js)+16)
	for i := 0; i < len(js); {
		if js[i] < utf8.RuneSelf {
			out = append(out, js[i])
			i++
			continue
		}
		r, n := utf8.DecodeRune(js[i:])
		if unsafeRune(r) {
			out = fmt.Appendf(out, `\u%04x`, r)
		} else {
			out = append(out, js[i:i+n]...)
		}
		i += n
	}
	return out
}
