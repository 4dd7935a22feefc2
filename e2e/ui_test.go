package e2e

import (
	"context"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/stretchr/testify/require"
	enumspb "go.temporal.io/api/enums/v1"

	"vmflow/hostagent/gpu/vgpusim"
	"vmflow/testsupport/devserver"
	"vmflow/workflows"
)

// requireChromium skips t when Debian's Chromium is missing (`make tools`
// installs it).
func requireChromium(t *testing.T) string {
	t.Helper()
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome"} {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	t.Skip("Chromium not found: `make tools` installs Debian's chromium")
	return ""
}

// browser is a headless Chromium tab for one test.
type browser struct {
	t   *testing.T
	ctx context.Context
	out string
	n   int
}

func newBrowser(t *testing.T, out string) *browser {
	t.Helper()
	bin := requireChromium(t)
	opts := append(chromedp.DefaultExecAllocatorOptions[:],
		chromedp.ExecPath(bin),
		// Root in a sandbox-less container; no GPU; nothing but the
		// loopback UI: the flags Chromium needs to run as root here.
		chromedp.NoSandbox,
		chromedp.DisableGPU,
		chromedp.Flag("disable-quic", true),
		chromedp.Flag("disable-background-networking", true),
		chromedp.WindowSize(1600, 1200),
		chromedp.UserDataDir(t.TempDir()),
	)
	actx, cancelAlloc := chromedp.NewExecAllocator(context.Background(), opts...)
	ctx, cancel := chromedp.NewContext(actx)
	t.Cleanup(func() {
		cancel()
		cancelAlloc()
	})
	// The first Run starts the browser; no deadline on it (a deadline would
	// end the browser with it), so start it with a cheap action and bound
	// the start with a watchdog instead.
	started := make(chan error, 1)
	go func() {
		_, err := chromedp.Run(ctx, chromedp.Evaluate[string]("navigator.userAgent"))
		started <- err
	}()
	timer := time.NewTimer(60 * time.Second)
	defer timer.Stop()
	select {
	case err := <-started:
		if err != nil {
			t.Fatalf("start Chromium: %v", err)
		}
	case <-timer.C:
		t.Fatal("Chromium did not start within 60 s")
	}
	return &browser{t: t, ctx: ctx, out: out}
}

// open loads url and waits until the page's text holds every one of want,
// then saves a full-page screenshot named name. It returns the page's text.
func (b *browser) open(name, url string, timeout time.Duration, want ...string) string {
	b.t.Helper()
	ctx, cancel := context.WithTimeout(b.ctx, timeout)
	defer cancel()
	if _, err := chromedp.Run(ctx, chromedp.Navigate(url)); err != nil {
		b.t.Fatalf("open %s: %v", url, err)
	}
	text, missing := b.textWith(ctx, want)
	b.n++
	shot := filepath.Join(b.out, fmt.Sprintf("%02d-%s.png", b.n, name))
	if png, err := chromedp.Run(b.ctx, chromedp.FullScreenshot(100)); err != nil {
		b.t.Errorf("screenshot %s: %v", name, err)
	} else if err := os.WriteFile(shot, png, 0o644); err != nil {
		b.t.Errorf("save screenshot: %v", err)
	}
	if len(missing) > 0 {
		txt := strings.TrimSuffix(shot, ".png") + ".txt"
		_ = os.WriteFile(txt, []byte(text), 0o644)
		b.t.Fatalf("%s (%s): page never showed %q within %s; screenshot %s, text %s", name, url, missing, timeout, shot, txt)
	}
	b.t.Logf("%s: found %q; screenshot %s", name, want, shot)
	return text
}

// pageText is the page's visible text plus that of its iframes: the UI
// renders markdown (Current Details) inside an iframe, whose text the
// page's innerText leaves out. A srcdoc frame is read from its attribute
// when its document is not reachable.
const pageText = `(() => {
	let t = document.body ? document.body.innerText : '';
	for (const f of document.querySelectorAll('iframe')) {
		let d = null;
		try { d = f.contentDocument; } catch (e) {}
		if (d && d.body) t += '\n' + d.body.innerText;
		else if (f.srcdoc) t += '\n' + f.srcdoc;
	}
	return t;
})()`

// textWith polls the page's visible text until it contains every string of
// want or ctx ends; it returns the last text and what is missing from it.
func (b *browser) textWith(ctx context.Context, want []string) (string, []string) {
	var text string
	var missing []string
	tick := time.NewTicker(250 * time.Millisecond)
	defer tick.Stop()
	for {
		t, err := chromedp.Run(ctx, chromedp.Evaluate[string](pageText))
		if err == nil {
			text = t
		}
		missing = missing[:0]
		for _, w := range want {
			if !strings.Contains(text, w) {
				missing = append(missing, w)
			}
		}
		if len(missing) == 0 {
			return text, nil
		}
		select {
		case <-ctx.Done():
			return text, missing
		case <-tick.C:
		}
	}
}

// Test 7: an operator finds a stuck delete in the Web UI. The release
// fails on its own (fault injected in the simulator); the delete is found
// in the workflow list filtered by VmNeedsAttention, and the release's
// failure text is on its page between rounds (Current Details) and while a
// round runs (Pending Activities).
func TestWebUIShowsStuckDelete(t *testing.T) {
	timeTest(t)
	requireChromium(t)
	devserver.RequireBinary(t)
	srv := devserver.Start(t, devserver.Options{UI: true})
	// An hour between rounds: the between-rounds state holds still while
	// the browser looks; a retry signal starts the next round on demand.
	e := newEnv(t, envOptions{server: srv, workerArgs: []string{"--release-backoff", "1h", "--release-backoff-max", "1h"}})
	b := newBrowser(t, e.out)
	id := "e2e-ui-" + suffix(t)
	delID := workflows.DeleteWorkflowID(id)
	ns := srv.Namespace()

	e.spawn(e.noneSpawn(id, true))
	e.sim.Set(t, vgpusim.CtlFailRelease, "EBUSY")
	run := e.startDelete(id, 1)
	st := e.waitStage(delID, workflows.StageReleaseFailed, 60*time.Second, nil)
	// The kernel's words for EBUSY, as the release error carries them.
	const failure = "device or resource busy"
	require.Contains(t, st.GetLastError(), failure)

	base := srv.UIAddress() + "/namespaces/" + url.PathEscape(ns) + "/workflows"
	list := base + "?query=" + url.QueryEscape("VmNeedsAttention=true")
	b.open("list-needs-attention", list, 60*time.Second, delID)

	wf := base + "/" + url.PathEscape(delID) + "/" + run.GetRunID()
	// Between rounds: the workflow's Current Details (set with
	// SetCurrentDetails, shown on the User Metadata tab) carry the stage
	// and the last error.
	b.open("between-rounds", wf+"/user-metadata", 60*time.Second, workflows.StageReleaseFailed, failure)

	// During a round: the next round's first attempt fails at once; the
	// second starts a second later. Block it in the simulator so the round
	// stays open with the first attempt's failure on the pending card.
	e.cli("workflow", "signal", "--workflow-id", delID, "--name", workflows.RetrySignal, "--input", `{"reason":"e2e: UI during a round"}`)
	blocked := false
	waitFor(t, 30*time.Second, "a pending release attempt after a failed one", func() (bool, string) {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		desc, err := e.c.DescribeWorkflow(ctx, delID, "")
		if err != nil {
			return false, err.Error()
		}
		for _, pa := range desc.RawResponse.GetPendingActivities() {
			if pa.GetActivityType().GetName() != workflows.ActivityReleaseLeases || pa.GetLastFailure() == nil {
				continue
			}
			if !blocked {
				e.sim.Set(t, vgpusim.CtlBlockRelease, "")
				blocked = true
			}
			return pa.GetState() == enumspb.PENDING_ACTIVITY_STATE_STARTED,
				fmt.Sprintf("attempt %d %s, last failure %q", pa.GetAttempt(), pa.GetState(), pa.GetLastFailure().GetMessage())
		}
		return false, fmt.Sprintf("%d pending activities", len(desc.RawResponse.GetPendingActivities()))
	})
	b.open("during-round", wf+"/pending-activities", 60*time.Second, "Attempt", "Last Failure", failure)

	// Lift both faults and let the delete finish.
	e.sim.Clear(t, vgpusim.CtlFailRelease)
	e.sim.Clear(t, vgpusim.CtlBlockRelease)
	require.NoError(t, run.Get(e.ctx(90*time.Second), nil))
	e.assertNothingLeft()
}
