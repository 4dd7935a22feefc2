package bench

import (
	"strings"
	"testing"
)

// docBlock is a section of BENCHMARKS.md that a make target of its own
// writes between two markers (make bench-fleet, make bench-scale); make
// bench, which rewrites the rest, keeps each as it is.
type docBlock struct{ begin, end string }

// of returns b's section of doc, markers included, or "" when it has none.
func (b docBlock) of(doc string) string {
	i := strings.Index(doc, b.begin)
	j := strings.Index(doc, b.end)
	if i < 0 || j < i {
		return ""
	}
	return doc[i : j+len(b.end)]
}

// into replaces b's section of doc with block, or appends block.
func (b docBlock) into(doc, block string) string {
	if old := b.of(doc); old != "" {
		return strings.Replace(doc, old, block, 1)
	}
	if doc != "" && !strings.HasSuffix(doc, "\n") {
		doc += "\n"
	}
	return doc + "\n" + block + "\n"
}

// keptBlocks are the sections make bench keeps from the file it rewrites,
// in the order they are appended when missing.
var keptBlocks = []docBlock{fleetSection, scaleSection}

// keepBlocks puts into doc every kept section old has.
func keepBlocks(doc, old string) string {
	for _, b := range keptBlocks {
		if blk := b.of(old); blk != "" {
			doc = b.into(doc, blk)
		}
	}
	return doc
}

// TestKeepBlocks: make bench keeps the sections make bench-fleet and make
// bench-scale wrote, and appends them in order when its new text has none.
func TestKeepBlocks(t *testing.T) {
	fleet := fleetBegin + "\nfleet rows\n" + fleetEnd
	scale := scaleBegin + "\nscale rows\n" + scaleEnd
	old := "# old\n\n" + scale + "\n\n" + fleet + "\n"
	got := keepBlocks("# new\n", old)
	if want := "# new\n\n" + fleet + "\n\n" + scale + "\n"; got != want {
		t.Errorf("keepBlocks:\n got %q\nwant %q", got, want)
	}
	if got := keepBlocks("# new\n", "# old, no sections\n"); got != "# new\n" {
		t.Errorf("nothing to keep: got %q", got)
	}
	if got := scaleSection.into("a\n"+scale+"\nb\n", scaleBegin+"\nnew\n"+scaleEnd); got != "a\n"+scaleBegin+"\nnew\n"+scaleEnd+"\nb\n" {
		t.Errorf("replaced in place: got %q", got)
	}
}
