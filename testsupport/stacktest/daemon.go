package stacktest

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"vmflow/internal/service"
)

// Daemon is a vmflow binary run as a subprocess, restartable, its output
// appended to one log file. Set the exported fields, then Start it.
type Daemon struct {
	Name string   // for messages and the log's start lines
	Bin  string   // the executable
	Args []string // its arguments
	Env  []string // added to this process's environment
	Log  string   // the log file, appended to

	// LineWatch sends the output through a pipe, copied to Log line by
	// line, so Watch can see (and time) each line. Without it the output
	// goes straight to Log, and Watch must not be used.
	LineWatch bool

	mu       sync.Mutex
	cmd      *exec.Cmd
	done     chan struct{}
	started  time.Time
	runs     int
	watchers []*watcher
}

type watcher struct {
	match func(string) bool
	ch    chan Line
}

// Line is a log line and when the harness read it.
type Line struct {
	At   time.Time
	Text string
}

// Watch returns a channel that receives the first line of the daemon's
// output, from now on, for which match holds. It needs LineWatch.
func (d *Daemon) Watch(match func(string) bool) <-chan Line {
	if !d.LineWatch {
		panic("stacktest: Watch on " + d.Name + " without LineWatch")
	}
	w := &watcher{match: match, ch: make(chan Line, 1)}
	d.mu.Lock()
	d.watchers = append(d.watchers, w)
	d.mu.Unlock()
	return w.ch
}

// Start starts the daemon; t fails if it is already running or cannot
// start.
func (d *Daemon) Start(t testing.TB) {
	t.Helper()
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.cmd != nil {
		select {
		case <-d.done:
		default:
			t.Fatalf("%s: already running", d.Name)
		}
	}
	f, err := os.OpenFile(d.Log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		t.Fatalf("%s log: %v", d.Name, err)
	}
	d.runs++
	fmt.Fprintf(f, "=== %s start #%d at %s: %s %s\n", d.Name, d.runs, time.Now().Format(time.RFC3339Nano), d.Bin, strings.Join(d.Args, " "))
	cmd := exec.Command(d.Bin, d.Args...)
	cmd.Env = append(os.Environ(), d.Env...)
	var pr, pw *os.File
	if d.LineWatch {
		if pr, pw, err = os.Pipe(); err != nil {
			f.Close()
			t.Fatalf("%s pipe: %v", d.Name, err)
		}
		cmd.Stdout, cmd.Stderr = pw, pw
	} else {
		cmd.Stdout, cmd.Stderr = f, f
	}
	// A crashed or timed-out test binary takes its daemons with it.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	started := time.Now()
	if err := cmd.Start(); err != nil {
		if pw != nil {
			pw.Close()
			pr.Close()
		}
		f.Close()
		t.Fatalf("start %s: %v", d.Name, err)
	}
	if pw != nil {
		pw.Close() // the child holds its copy
	}
	done := make(chan struct{})
	go func() {
		if pr != nil {
			d.copyLines(pr, f)
		}
		_ = cmd.Wait() // the exit status is in the log's context; only reaping matters
		if pr != nil {
			pr.Close()
		}
		f.Close()
		close(done)
	}()
	d.cmd, d.done, d.started = cmd, done, started
}

// copyLines copies the daemon's output to the log and hands matching lines to
// watchers, until the daemon and any child holding its stderr exit.
func (d *Daemon) copyLines(r io.Reader, f *os.File) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		at := time.Now()
		line := sc.Text()
		_, _ = f.WriteString(line + "\n")
		d.mu.Lock()
		kept := d.watchers[:0]
		for _, w := range d.watchers {
			if w.match(line) {
				w.ch <- Line{At: at, Text: line}
				continue
			}
			kept = append(kept, w)
		}
		d.watchers = kept
		d.mu.Unlock()
	}
}

// Pid is the pid of the daemon's last start; 0 before the first.
func (d *Daemon) Pid() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.cmd == nil || d.cmd.Process == nil {
		return 0
	}
	return d.cmd.Process.Pid
}

// Exited reports whether the daemon's last start exited and was reaped (false
// before any), for a crash test to restart one that killed itself.
func (d *Daemon) Exited() bool {
	d.mu.Lock()
	done := d.done
	d.mu.Unlock()
	if done == nil {
		return false
	}
	select {
	case <-done:
		return true
	default:
		return false
	}
}

// Started is when the daemon's last start exec'd it.
func (d *Daemon) Started() time.Time {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.started
}

// Kill sends SIGKILL (a crash: no cleanup in the process) and waits until
// the process is reaped; t fails if it is not within 10 s.
func (d *Daemon) Kill(t testing.TB) {
	t.Helper()
	if err := d.Signal(syscall.SIGKILL, 10*time.Second); err != nil {
		t.Fatalf("kill -9 %s: %v", d.Name, err)
	}
}

// Stop sends SIGTERM, then SIGKILL after service.StopTimeout plus 5 s, and waits
// until reaped.
func (d *Daemon) Stop() error {
	if err := d.Signal(syscall.SIGTERM, service.StopTimeout+5*time.Second); err != nil {
		return errors.Join(err, d.Signal(syscall.SIGKILL, 10*time.Second))
	}
	return nil
}

// Signal sends sig and waits up to wait until the daemon is reaped. A
// daemon that is not running is left alone.
func (d *Daemon) Signal(sig syscall.Signal, wait time.Duration) error {
	d.mu.Lock()
	cmd, done := d.cmd, d.done
	d.mu.Unlock()
	if cmd == nil {
		return nil
	}
	select {
	case <-done:
		return nil
	default:
	}
	if err := cmd.Process.Signal(sig); err != nil && !errors.Is(err, os.ErrProcessDone) {
		return fmt.Errorf("%s %s: %w", d.Name, sig, err)
	}
	timer := time.NewTimer(wait)
	defer timer.Stop()
	select {
	case <-done:
		return nil
	case <-timer.C:
		return fmt.Errorf("%s (pid %d) still running %s after %s", d.Name, cmd.Process.Pid, wait, sig)
	}
}

// Tail is the last n bytes of the daemon's log, for failure reports.
func (d *Daemon) Tail(n int) string {
	b, err := os.ReadFile(d.Log)
	if err != nil {
		return fmt.Sprintf("(no log: %v)", err)
	}
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return string(b)
}
