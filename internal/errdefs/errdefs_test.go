package errdefs

import (
	"errors"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"strconv"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestClassesListed: every class this package declares is in Classes, once,
// so ClassOf can return it and the activity edge has a row for it.
func TestClassesListed(t *testing.T) {
	fset := token.NewFileSet()
	f, err := parser.ParseFile(fset, "errdefs.go", nil, parser.SkipObjectResolution)
	require.NoError(t, err)
	declared := map[string]bool{}
	ast.Inspect(f, func(n ast.Node) bool {
		lit, ok := n.(*ast.CompositeLit)
		if !ok {
			return true
		}
		if id, ok := lit.Type.(*ast.Ident); ok && id.Name == "Class" && len(lit.Elts) > 0 {
			if name, ok := lit.Elts[0].(*ast.BasicLit); ok {
				s, err := strconv.Unquote(name.Value)
				require.NoError(t, err)
				declared[s] = true
			}
		}
		return true
	})
	listed := map[string]bool{}
	for _, c := range Classes {
		assert.False(t, listed[c.Error()], "%q listed twice", c)
		listed[c.Error()] = true
	}
	assert.Equal(t, declared, listed)
}

func TestClassOf(t *testing.T) {
	errA := Conflict.New("a differs")
	errHook := Context("hook failed")
	assert.Equal(t, "a differs", errA.Error(), "the sentinel's text is its own")
	assert.NoError(t, errors.Unwrap(errA), "a sentinel does not unwrap to its class")
	wrapped := fmt.Errorf("create vm1: %w", errA)
	assert.ErrorIs(t, wrapped, errA)
	assert.ErrorIs(t, wrapped, Conflict)
	assert.NotErrorIs(t, wrapped, Busy)
	assert.Equal(t, Conflict, ClassOf(wrapped))
	assert.False(t, ClassOf(wrapped).Retryable())
	assert.True(t, ClassOf(Busy.New("locked")).Retryable())

	assert.Nil(t, ClassOf(nil))
	assert.Nil(t, ClassOf(syscall.EIO), "an error from outside has no class")
	assert.Nil(t, ClassOf(errHook), "a context has no class of its own")
	assert.Equal(t, NoUID, ClassOf(fmt.Errorf("%w: %w", errHook, NoUID.New("no uid"))), "its cause's class")
	assert.Equal(t, Refused, ClassOf(fmt.Errorf("%w: %w", InvalidInput.New("bad field"), Refused.New("refused"))),
		"the first class in precedence, not the first in the chain")

	adHoc := Misconfigured.Errorf("jail: %s needs %s", "qemu", "libc")
	assert.Equal(t, "jail: qemu needs libc", adHoc.Error())
	assert.Equal(t, Misconfigured, ClassOf(fmt.Errorf("launch: %w", adHoc)))
	cause := Unreadable.New("bad record")
	assert.ErrorIs(t, StillAlive.Errorf("stop: %w", cause), cause, "%w wraps as in fmt.Errorf")
	assert.Equal(t, StillAlive, ClassOf(StillAlive.Errorf("stop: %w", syscall.EIO)))
}
