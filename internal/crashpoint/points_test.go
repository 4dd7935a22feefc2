package crashpoint

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestParse(t *testing.T) {
	name, n, err := Parse(StoreWriteRenamed + "@7")
	require.NoError(t, err)
	assert.Equal(t, StoreWriteRenamed, name)
	assert.Equal(t, int64(7), n)
	_, n, err = Parse(StoreWriteRenamed)
	require.NoError(t, err)
	assert.Equal(t, int64(1), n)
}

func TestAllIsUniqueAndNamesTheStopSteps(t *testing.T) {
	seen := map[string]bool{}
	for _, p := range All {
		assert.False(t, seen[p], "%s listed twice", p)
		seen[p] = true
	}
	assert.GreaterOrEqual(t, len(All), 30)
	for step, want := range map[string]string{
		"powerdown_sent": StopPowerdownSent, "quit_sent": StopQuitSent, "kill_sent": StopKillSent, "gone": StopGone,
	} {
		assert.Equal(t, want, StopStep(step))
	}
}

// TestEveryPointIsPlaced reads the module's sources: every point in All is
// hit somewhere (a point nobody calls would make the matrix report it as
// never hit, but only after minutes), and every call names a listed point.
func TestEveryPointIsPlaced(t *testing.T) {
	// go test runs in the package folder: the module is two levels up.
	root, err := filepath.Abs(filepath.Join("..", ".."))
	require.NoError(t, err)
	_, err = os.Stat(filepath.Join(root, "go.mod"))
	require.NoError(t, err, "module root")
	// A lease driver names its release's points in a ReleasePoints literal
	// (lease.Driver.Points), which the engine hits for it.
	call := regexp.MustCompile(`(?:crashpoint\.Hit\(|(?:Releasing|Done|Recorded): )crashpoint\.(\w+)`)
	placed := map[string]bool{}
	err = filepath.WalkDir(root, func(path string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (d.Name() == ".cache" || d.Name() == ".git") {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return nil
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		for _, m := range call.FindAllStringSubmatch(string(b), -1) {
			placed[m[1]] = true
		}
		if strings.Contains(string(b), "crashpoint.HitStop(") {
			placed["StopPowerdownSent"], placed["StopQuitSent"], placed["StopKillSent"], placed["StopGone"] = true, true, true, true
		}
		return nil
	})
	require.NoError(t, err)
	for _, name := range constNames(t) {
		assert.True(t, placed[name], "crashpoint.%s is never hit", name)
	}
}

// constNames are the identifiers of this package's point constants.
func constNames(t *testing.T) []string {
	t.Helper()
	b, err := os.ReadFile("crashpoint.go")
	require.NoError(t, err)
	re := regexp.MustCompile(`(?m)^\t([A-Z]\w+)\s+= "`)
	var names []string
	for _, m := range re.FindAllStringSubmatch(string(b), -1) {
		if m[1] != "EnvVar" {
			names = append(names, m[1])
		}
	}
	require.Len(t, names, len(All), "every constant is in All")
	return names
}
