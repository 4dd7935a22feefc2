package workflows

import (
	"bytes"
	"html"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/yuin/goldmark"
	"github.com/yuin/goldmark/extension"

	vmflowv1 "vmflow/proto/vmflow/v1"
)

// TestDetailsShowHostileTextAsText: the last error in Current Details
// comes from QMP error text a hostile QEMU wrote, guest serial output, or
// an operator's abandon reason, and the Web UI renders Current Details as
// markdown. Rendered by a CommonMark renderer with GitHub's extensions (bare
// links, tables, strikethrough), every such text shows as exactly its
// characters in one code span of the "last error" item: no link, image,
// HTML, heading, list item, table or emphasis of its own, and newlines or
// terminal and bidi controls cannot lay out the page. Before, the text
// went into the markdown as it was.
func TestDetailsShowHostileTextAsText(t *testing.T) {
	md := goldmark.New(goldmark.WithExtensions(extension.GFM))
	item := regexp.MustCompile(`(?m)^<li>last error: <code>([^<]*)</code></li>$`)
	for _, c := range []struct{ name, text, shown string }{
		{"link", "[click to fix](https://evil.example/x)", ""},
		{"image", "![x](https://evil.example/t.png)", ""},
		{"html", `<img src=x onerror="alert(1)">`, ""},
		{"script", "<script>alert(1)</script>", ""},
		{"autolink", "see <https://evil.example/> or https://evil.example/fix or www.evil.example", ""},
		{"emphasis", "**bold** _em_ ~~strike~~ *x*", ""},
		{"entity", "&lt;b&gt; &#x3C;", ""},
		{"backticks", "`one` ``two`` ```three```", ""},
		{"backtick at the edges", "`x`", ""},
		{"spaces at the edges", " x ", ""},
		{"blocks", "qmp: error\n\n# Heading\n- injected item\n> quote\n```\nfence", "qmp: error  # Heading - injected item > quote ``` fence"},
		{"table", "| a | b |\r\n|---|---|\r\n| c | d |", "| a | b |  |---|---|  | c | d |"},
		{"terminal", "\x1b[31mred\x1b[0m\ttab\x00nul\x7f", "\uFFFD[31mred\uFFFD[0m tab\uFFFDnul\uFFFD"},
		{"bidi", "abc\u202edcba\u2066x\u2069", "abc\uFFFDdcba\uFFFDx\uFFFD"},
		{"invalid utf-8", "bad \xff\xfe byte", "bad \uFFFD byte"},
	} {
		t.Run(c.name, func(t *testing.T) {
			shown := c.shown
			if shown == "" {
				shown = c.text
			}
			tr := &tracker{kind: "delete", instanceID: "vm1", hostID: "h1", status: &vmflowv1.WorkflowStatus{
				Stage: StageReleaseFailed, Attempt: 3, LastError: c.text, NeedsAttention: true,
			}}
			var out bytes.Buffer
			require.NoError(t, md.Convert([]byte(tr.details()), &out))
			got := out.String()
			m := item.FindStringSubmatch(got)
			require.NotNil(t, m, "the last error is one code span of its item:\n%s", got)
			assert.Equal(t, shown, html.UnescapeString(m[1]), "shown as its characters")
			for _, tag := range []string{"<a", "<img", "<script", "<h1", "<h2", "<table", "<pre", "<del", "<em", "<blockquote"} {
				assert.NotContains(t, got, tag)
			}
			assert.Equal(t, 4, strings.Count(got, "<li>"), "stage, attempt, last error, needs attention: no item injected")
			assert.Equal(t, 2, strings.Count(got, "<strong>"), "only the details' own bold")
		})
	}
}
