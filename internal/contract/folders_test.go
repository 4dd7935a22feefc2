package contract

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestREADMEFolderTable: README's "Folders" table names every package of the
// module, and every folder it names exists. A package added without a row
// (or a row left behind by a move) fails here, so the table a newcomer reads
// first matches the tree.
func TestREADMEFolderTable(t *testing.T) {
	b, err := os.ReadFile(filepath.Join("..", "..", "README.md"))
	require.NoError(t, err)
	_, table, ok := strings.Cut(string(b), "\n## Folders\n")
	require.True(t, ok, "README has a Folders section")
	table, _, _ = strings.Cut(table, "\n## ")
	row := regexp.MustCompile("(?m)^\\| `([^`]+)` \\|")
	named := map[string]bool{}
	for _, m := range row.FindAllStringSubmatch(table, -1) {
		named[strings.TrimSuffix(m[1], "/")] = true
	}
	require.Greater(t, len(named), 10, "rows read from the table")

	pkgs := goListDeps(t, false, "vmflow/...")
	for pkg := range pkgs {
		rel := strings.TrimPrefix(strings.TrimPrefix(pkg, "vmflow"), "/")
		if rel == "" {
			continue // the module root holds no package
		}
		assert.True(t, named[rel], "README's folder table has no row for %s", rel)
	}
	for name := range named {
		if strings.HasPrefix(name, ".") {
			continue // .ci/run: a file
		}
		fi, err := os.Stat(filepath.Join("..", "..", name))
		if assert.NoError(t, err, "README's folder table names %s", name) {
			assert.True(t, fi.IsDir(), "%s is a folder", name)
		}
	}
}
