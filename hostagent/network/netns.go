package network

import (
	"errors"
	"fmt"
	"runtime"

	"github.com/vishvananda/netns"
)

// inNS runs fn on an OS thread inside the host network's namespace: what
// acts in the calling thread's namespace (opening /dev/net/tun, whose
// TUNSETIFF finds or makes the TAP there) must run there. fn runs on a
// goroutine of its own whose thread is locked for its whole life: the
// thread switches back before it is unlocked, and if switching back fails
// it stays locked, so the runtime ends it with the goroutine and no other
// goroutine ever runs in the wrong namespace. With no namespace configured
// fn runs where it is called.
func (n *Net) inNS(fn func() error) error {
	if !n.ns.IsOpen() {
		return fn()
	}
	done := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := netns.Get()
		if err != nil {
			runtime.UnlockOSThread()
			done <- fmt.Errorf("network: read this thread's netns: %w", err)
			return
		}
		defer orig.Close()
		if err := netns.Set(n.ns); err != nil {
			// setns failed: the thread is where it was.
			runtime.UnlockOSThread()
			done <- fmt.Errorf("%w: enter netns %q: %w", ErrMisconfigured, n.cfg.NetNS, err)
			return
		}
		ferr := fn()
		if err := netns.Set(orig); err != nil {
			// Left locked: the thread dies with this goroutine.
			done <- errors.Join(fmt.Errorf("network: return from netns %q: %w", n.cfg.NetNS, err), ferr)
			return
		}
		runtime.UnlockOSThread()
		done <- ferr
	}()
	return <-done
}
