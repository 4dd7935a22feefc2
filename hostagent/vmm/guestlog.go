package vmm

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode"
	"unicode/utf8"

	"golang.org/x/sys/unix"

	"vmflow/internal/errdefs"
)

// Bounds of a guest's log, virtlogd's defaults: qemu.log plus qemu.log.1 and
// qemu.log.2, 2 MiB each. A guest writes its serial port as fast as it likes
// (2.9 MB in 4 s under TCG, measured) and the log shares its filesystem with
// every record: unbounded, a guest could fill the host's disk.
const (
	DefaultLogMaxBytes = 2 << 20
	DefaultLogFiles    = 3
)

// Guest output pump bounds. The reader never waits on the disk: what it reads
// waits in memory for the writer, and what finds that buffer full (a slow or
// hung filesystem) is dropped and counted, so QEMU never blocks on its stdout.
const (
	guestLogChunk   = 32 << 10
	guestLogPending = 1 << 20 // bytes waiting for the disk at most
	// guestLogDrain is how long stopping the pump of an exited QEMU waits
	// for the pipe's EOF, so its last words reach the log.
	guestLogDrain = time.Second
)

// ErrLogNotPipe: the QEMU's stdout is not a pipe, so there is nothing to
// capture: a QEMU launched by an agent from before the bounded log writes
// qemu.log itself (unbounded) until its next launch.
var ErrLogNotPipe = errdefs.Internal.New("qemu stdout is not a pipe")

// RotatingLog is an io.Writer over path that never lets path grow past
// maxBytes: the write that would cross the bound rotates path to path.1
// (path.1 to path.2, ...) and starts a fresh path, keeping files files in all.
// Files are created 0600. It is safe for concurrent use.
type RotatingLog struct {
	path     string
	maxBytes int64
	files    int

	mu   sync.Mutex
	f    *os.File
	size int64
}

// NewRotatingLog returns a RotatingLog; the file is opened on the first write.
// maxBytes and files at or below zero take the defaults (2 MiB, 3 files).
func NewRotatingLog(path string, maxBytes int64, files int) *RotatingLog {
	if maxBytes <= 0 {
		maxBytes = DefaultLogMaxBytes
	}
	if files <= 0 {
		files = DefaultLogFiles
	}
	return &RotatingLog{path: path, maxBytes: maxBytes, files: files}
}

// Write appends p, rotating as often as needed. On an error the bytes not
// written are lost; the next Write tries again (reopening the file).
func (r *RotatingLog) Write(p []byte) (int, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	written := 0
	for len(p) > 0 {
		if r.f == nil {
			if err := r.open(); err != nil {
				return written, err
			}
		}
		room := r.maxBytes - r.size
		if room <= 0 {
			if err := r.rotate(); err != nil {
				return written, err
			}
			continue
		}
		chunk := p[:min(int64(len(p)), room)]
		n, err := r.f.Write(chunk)
		written += n
		r.size += int64(n)
		p = p[n:]
		if err != nil {
			// Reopen next time: the file may have been removed or the
			// filesystem remounted.
			r.f.Close()
			r.f = nil
			return written, fmt.Errorf("write %s: %w", r.path, err)
		}
	}
	return written, nil
}

func (r *RotatingLog) open() error {
	f, err := os.OpenFile(r.path, os.O_WRONLY|os.O_CREATE|os.O_APPEND|unix.O_NOFOLLOW, 0o600)
	if err != nil {
		return fmt.Errorf("open guest log: %w", err)
	}
	fi, err := f.Stat()
	if err != nil {
		f.Close()
		return fmt.Errorf("open guest log: %w", err)
	}
	// A file left by an older agent may be far above the bound already:
	// its size counts, so it is rotated before anything is added.
	r.f, r.size = f, fi.Size()
	return nil
}

// rotate shifts path.(i-1) to path.i, dropping the oldest, and leaves path
// to be created afresh.
func (r *RotatingLog) rotate() error {
	if r.f != nil {
		r.f.Close()
		r.f = nil
	}
	for i := r.files - 1; i >= 1; i-- {
		err := os.Rename(r.name(i-1), r.name(i))
		if err != nil && !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("rotate guest log: %w", err)
		}
	}
	if r.files == 1 {
		if err := os.Remove(r.path); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("rotate guest log: %w", err)
		}
	}
	r.size = 0
	return r.open()
}

func (r *RotatingLog) name(i int) string {
	if i == 0 {
		return r.path
	}
	return r.path + "." + strconv.Itoa(i)
}

// Close closes the current file.
func (r *RotatingLog) Close() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.f == nil {
		return nil
	}
	err := r.f.Close()
	r.f = nil
	return err
}

// LogFiles lists path and its rotations, newest first, as RotatingLog names
// them.
func LogFiles(path string) []string {
	out := []string{path}
	for i := 1; i < DefaultLogFiles; i++ {
		out = append(out, path+"."+strconv.Itoa(i))
	}
	return out
}

// LogStats is what a guest-output pump did.
type LogStats struct {
	// Read is every byte read from QEMU's stdout and stderr.
	Read uint64
	// Dropped is what never reached the log: the writer was behind by a
	// full queue, or writing failed (disk full, I/O error).
	Dropped uint64
	// LastErr is the last write error, empty when none.
	LastErr string
	// Done: the pump has ended (EOF or stopped) and written or dropped
	// everything it read.
	Done bool
}

// GuestLog pumps a QEMU's stdout and stderr (one pipe) into a RotatingLog.
// It keeps the last logTailBytes it read in memory, so a failed launch quotes
// its own output without reading the disk.
//
// An idle pump (a QEMU that said its few lines and is quiet for its life,
// hundreds of them per agent) holds one goroutine parked in the runtime's
// poller and no buffer: the read buffer is taken from a pool only once
// the pipe is readable, and the writer runs only while something waits for
// the disk. A reader with a 32 KiB buffer of its own cost every VM 64 KiB
// of goroutine stack, and a writer parked for the VM's life 8 KiB more.
type GuestLog struct {
	r    *os.File
	w    *RotatingLog
	read chan struct{} // closed when the reader ends (EOF or stopped)
	done chan struct{} // closed when the reader ended and everything it read is written or dropped

	// pending is what the reader handed to the writer; writing says a
	// writer runs; ended says the reader is done. Guarded by qmu.
	qmu     sync.Mutex
	pending []byte
	writing bool
	ended   bool

	bytesRead atomic.Uint64
	dropped   atomic.Uint64

	mu      sync.Mutex
	tail    []byte
	lastErr string
	closing bool
}

// readChunks are the pumps' read buffers, held only for one read.
var readChunks = sync.Pool{New: func() any { b := make([]byte, guestLogChunk); return &b }}

// startGuestLog starts pumping r into the rotating log at path. r belongs to
// the pump from then on.
func startGuestLog(r *os.File, path string) *GuestLog {
	g := &GuestLog{
		r: r, w: NewRotatingLog(path, 0, 0),
		read: make(chan struct{}), done: make(chan struct{}),
	}
	go g.readLoop()
	return g
}

// readLoop drains the pipe until EOF (QEMU exited) or Stop, never blocking on
// the writer: what finds the pending buffer full is dropped. It waits for
// the pipe in the runtime's poller holding no buffer.
func (g *GuestLog) readLoop() {
	defer g.endRead()
	rc, err := g.r.SyscallConn()
	if err != nil {
		return
	}
	for {
		var (
			n    int
			rerr error
		)
		err := rc.Read(func(fd uintptr) bool {
			bp := readChunks.Get().(*[]byte)
			defer readChunks.Put(bp)
			for {
				n, rerr = unix.Read(int(fd), *bp)
				if !errors.Is(rerr, unix.EINTR) {
					break
				}
			}
			if errors.Is(rerr, unix.EAGAIN) {
				return false // park in the poller until readable
			}
			if rerr == nil && n > 0 {
				g.take((*bp)[:n])
			}
			return true
		})
		if err != nil || rerr != nil || n <= 0 {
			return // os.ErrClosed from Stop, a read error, or EOF
		}
	}
}

// take hands b to the writer (starting one if none runs) or drops it when
// the writer is behind by a full queue; b is the reader's, so it is copied.
func (g *GuestLog) take(b []byte) {
	g.bytesRead.Add(uint64(len(b)))
	g.keepTail(b)
	g.qmu.Lock()
	defer g.qmu.Unlock()
	if len(g.pending)+len(b) > guestLogPending {
		g.dropped.Add(uint64(len(b)))
		return
	}
	g.pending = append(g.pending, b...)
	if !g.writing {
		g.writing = true
		go g.writeLoop()
	}
}

// endRead marks the reader done; with no writer running, the pump is done.
func (g *GuestLog) endRead() {
	g.qmu.Lock()
	g.ended = true
	finished := !g.writing
	g.qmu.Unlock()
	close(g.read)
	if finished {
		g.finish()
	}
}

func (g *GuestLog) finish() {
	g.w.Close()
	close(g.done)
}

// writeLoop writes what is pending until nothing is, then ends, dropping its
// buffers: the next output starts another.
func (g *GuestLog) writeLoop() {
	var spare []byte
	for {
		g.qmu.Lock()
		chunk := g.pending
		if len(chunk) == 0 {
			g.writing, g.pending = false, nil
			finished := g.ended
			g.qmu.Unlock()
			if finished {
				g.finish()
			}
			return
		}
		g.pending = spare[:0] // reused while output keeps coming: two buffers in all
		g.qmu.Unlock()
		n, err := g.w.Write(chunk)
		if err != nil {
			g.dropped.Add(uint64(len(chunk) - n))
			g.mu.Lock()
			g.lastErr = err.Error()
			g.mu.Unlock()
		}
		spare = chunk
	}
}

// keepTail keeps the last logTailBytes read, in a buffer of that size made
// at the first output.
func (g *GuestLog) keepTail(b []byte) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.tail == nil {
		g.tail = make([]byte, 0, logTailBytes)
	}
	if len(b) >= logTailBytes {
		g.tail = append(g.tail[:0], b[len(b)-logTailBytes:]...)
		return
	}
	if over := len(g.tail) + len(b) - logTailBytes; over > 0 {
		g.tail = append(g.tail[:0], g.tail[over:]...)
	}
	g.tail = append(g.tail, b...)
}

// Tail is the last logTailBytes the pump read, raw: quote it with QuoteLog.
func (g *GuestLog) Tail() []byte {
	g.mu.Lock()
	defer g.mu.Unlock()
	return append([]byte(nil), g.tail...)
}

// Stats says what the pump read and dropped so far.
func (g *GuestLog) Stats() LogStats {
	done := false
	select {
	case <-g.done:
		done = true
	default:
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	return LogStats{Read: g.bytesRead.Load(), Dropped: g.dropped.Load(), LastErr: g.lastErr, Done: done}
}

// waitEOF waits up to d for the reader to see EOF; true when it did.
func (g *GuestLog) waitEOF(d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-g.read:
		return true
	case <-t.C:
		return false
	}
}

// Stop waits up to drain for EOF (QEMU's last words), then closes the pipe;
// Drained says when the writer finished. Later output is lost until a
// re-attach (QEMU ignores the EPIPE). Idempotent.
func (g *GuestLog) Stop(drain time.Duration) {
	if drain > 0 {
		g.waitEOF(drain)
	}
	g.mu.Lock()
	first := !g.closing
	g.closing = true
	g.mu.Unlock()
	if first {
		g.r.Close() // unblocks the reader: the pipe is in the runtime poller
	}
	<-g.read
	// What was read is written (or counted dropped) before Stop returns, so
	// a failed launch's caller finds QEMU's last words in the file; bounded,
	// since the writer may be stuck on a full or hung disk.
	t := time.NewTimer(guestLogFlush)
	defer t.Stop()
	select {
	case <-g.done:
	case <-t.C:
	}
}

// guestLogFlush bounds how long Stop waits for the writer to put what was
// read on disk.
const guestLogFlush = 2 * time.Second

// guestOutput returns the write end w for QEMU's stdout and stderr and the
// GuestLog pumping the read end into the bounded log at path; close w after
// the fork so the pump sees EOF. A pipe, as a file would grow without bound.
func guestOutput(path string) (w *os.File, g *GuestLog, err error) {
	// After an agent restart CaptureLog reopens this pipe via /proc/<pid>/fd/1.
	r, w, err := os.Pipe()
	if err != nil {
		return nil, nil, fmt.Errorf("guest log pipe: %w", err)
	}
	return w, startGuestLog(r, path), nil
}

// openStdoutPipe opens a new reader of the pipe that is pid's fd 1 (like a
// FIFO's open; pidfd_getfd would give QEMU's write end), O_NONBLOCK so the
// open never waits and Stop can unblock a Read.
func openStdoutPipe(pid int) (*os.File, error) {
	path := "/proc/" + strconv.Itoa(pid) + "/fd/1"
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open %s: %w", path, err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("stat %s: %w", path, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFIFO {
		// Reading a regular file here would append qemu.log to itself.
		unix.Close(fd)
		return nil, fmt.Errorf("%s: %w", path, ErrLogNotPipe)
	}
	return os.NewFile(uintptr(fd), path), nil
}

// Markers that fence text quoted from a guest's log. The text between them
// is the guest's and QEMU's, never vmflow's: QuoteLog strips whatever could
// close the fence early or pose as another line.
const (
	logFenceOpen  = "«qemu.log: "
	logFenceClose = "»"
)

// QuoteLog makes guest-controlled log text safe for an error, a log line or
// the Web UI: one line, no control characters, valid UTF-8, and fenced
// «qemu.log: ...» so it cannot pose as vmflow's own words.
func QuoteLog(b []byte) string {
	var sb strings.Builder
	sb.WriteString(logFenceOpen)
	s := strings.TrimSpace(string(b))
	if s == "" {
		sb.WriteString("(empty)")
	}
	lastBreak := false
	for len(s) > 0 {
		r, size := utf8.DecodeRuneInString(s)
		s = s[size:]
		switch {
		case r == '\n':
			if !lastBreak {
				sb.WriteString(" ⏎ ")
			}
			lastBreak = true
			continue
		case r == '«' || r == '»':
			sb.WriteByte('"')
		case r == '\t':
			sb.WriteByte(' ')
		case r == utf8.RuneError && size <= 1:
			sb.WriteRune(utf8.RuneError)
		case unicode.IsControl(r), unicode.Is(unicode.Cf, r), r == '\u2028', r == '\u2029':
			// C0, DEL, C1 (a lone CSI), and format characters such as the
			// bidi overrides that reorder what a reader sees.
		default:
			sb.WriteRune(r)
		}
		lastBreak = false
	}
	sb.WriteString(logFenceClose)
	return sb.String()
}

var _ io.Writer = (*RotatingLog)(nil)
