package stubvmm

import (
	"syscall"
	"unsafe"
)

// Everything below runs without Go's runtime (main.go says why): no
// allocation (no append past a global array, no string conversion, no
// interface, no closure, no defer, no map), no goroutine, no panic that
// is not a crash. Raw system calls only: syscall.RawSyscall6 is what Go's
// own fork child calls before its exec, for the same reason.

// version is the first line of `qemu-system-x86_64 --version` as
// vmm.ParseVersionOutput reads it: QEMU 7.2, which the confinement was
// written against, and a package saying what it really is.
const version = "QEMU emulator version 7.2.0 (vmflow stub VMM: no guest)\n"

// The QMP messages the stub sends, in the spacing QEMU 7.2 uses.
const (
	greeting = `{"QMP": {"version": {"qemu": {"micro": 0, "minor": 2, "major": 7}, "package": "vmflow stub VMM"}, "capabilities": ["oob"]}}` + "\n"

	returnEmpty  = `{"return": {}`
	returnStatus = `{"return": {"status": "running", "singlestep": false, "running": true}`

	errNegotiation = `{"error": {"class": "CommandNotFound", "desc": "Expecting capabilities negotiation with 'qmp_capabilities'"}`
	errNegotiated  = `{"error": {"class": "CommandNotFound", "desc": "Capabilities negotiation is already complete, command ignored"}`
	errNotFound    = `{"error": {"class": "CommandNotFound", "desc": "The command `
	errNotFoundEnd = ` has not been found"}`
	errNoExecute   = `{"error": {"class": "GenericError", "desc": "QMP input must be a JSON object with member 'execute'"}`
	errTooLong     = `{"error": {"class": "GenericError", "desc": "QMP input longer than the stub VMM reads"}`
)

// maxLine bounds one QMP command line. What the agent sends is under 100
// bytes; a longer line is answered with an error and dropped.
const maxLine = 4096

var (
	// in holds what was read of the client and not yet answered.
	in [maxLine]byte
	// out is one reply being written: an id may be as long as a line.
	out [maxLine + 256]byte
)

// bareMain is the program (entry calls it): the version, or QMP until quit
// or powerdown. It returns the exit status.
func bareMain(argc int, argv unsafe.Pointer, handler uintptr) int {
	args := argList{n: argc, p: argv}
	if args.has("--version") || args.has("-version") {
		writeAll(1, version)
		return 0
	}
	for _, sig := range [...]uintptr{uintptr(syscall.SIGTERM), uintptr(syscall.SIGINT), uintptr(syscall.SIGHUP)} {
		setSignal(sig, handler)
	}
	// A write to a client that went away is an EPIPE, not the end of
	// the VM (QEMU ignores SIGPIPE too).
	setSignal(uintptr(syscall.SIGPIPE), sigIgn)
	fd, ok := args.qmpFD()
	if !ok {
		writeAll(2, "stubvmm: no -chardev socket,...,fd=N in argv: nothing to serve QMP on\n")
		return 1
	}
	return serve(fd)
}

// serve accepts one QMP client at a time on the listener fd and answers it
// until it goes away, then takes the next; it returns only to exit.
func serve(fd int) int {
	// Blocking: the stub has nothing to do but wait for its client.
	if fl, e := sys(syscall.SYS_FCNTL, uintptr(fd), syscall.F_GETFL, 0); e == 0 && fl&syscall.O_NONBLOCK != 0 {
		sys(syscall.SYS_FCNTL, uintptr(fd), syscall.F_SETFL, fl&^syscall.O_NONBLOCK)
	}
	for {
		c, e := sys(syscall.SYS_ACCEPT4, uintptr(fd), 0, 0)
		if e == syscall.EINTR || e == syscall.ECONNABORTED {
			continue
		}
		if e != 0 {
			writeAll(2, "stubvmm: accept on the QMP listener failed\n")
			return 1
		}
		if code, exit := converse(int(c)); exit {
			return code
		}
		sys(syscall.SYS_CLOSE, c, 0, 0)
	}
}

// converse is one client's connection: the greeting, then a reply to each
// line. exit is true when a command ends the VM (quit, powerdown).
func converse(c int) (code int, exit bool) {
	if !writeAll(c, greeting) {
		return 0, false
	}
	var s session
	filled := 0
	for {
		n, e := sys(syscall.SYS_READ, uintptr(c), uintptr(unsafe.Pointer(&in[filled])), uintptr(len(in)-filled))
		if e == syscall.EINTR {
			continue
		}
		if e != 0 || n == 0 {
			return 0, false // the client went away: the next one may come
		}
		filled += int(n)
		start := 0
		for i := start; i < filled; i++ {
			if in[i] != '\n' {
				continue
			}
			line := in[start:i]
			start = i + 1
			if s.skipping {
				// The rest of an over-long line: its error is sent.
				s.skipping = false
				continue
			}
			r := s.answer(line)
			if r.n > 0 && !writeAll(c, bytesOf(out[:r.n])) {
				return 0, false
			}
			if r.exit {
				return 0, true
			}
		}
		// Keep the unanswered tail at the front.
		for i := start; i < filled; i++ {
			in[i-start] = in[i]
		}
		filled -= start
		if filled == len(in) {
			// A line longer than the buffer: answer it now, drop the
			// rest of it up to its newline.
			if !s.skipping {
				r := s.reply(errTooLong, nil)
				if !writeAll(c, bytesOf(out[:r.n])) {
					return 0, false
				}
			}
			s.skipping = true
			filled = 0
		}
	}
}

// session is one client's state: QEMU refuses every command but
// qmp_capabilities until it has run.
type session struct {
	negotiated bool
	// skipping: the line being read was too long and answered; the bytes
	// up to its newline are dropped.
	skipping bool
}

// result is a reply made in out: its length, and whether the VM ends
// once it is sent.
type result struct {
	n    int
	exit bool
}

// answer makes the reply to one command line in out.
func (s *session) answer(line []byte) result {
	if isSpace(line) {
		return result{}
	}
	cmd, ok := parseCommand(line)
	if !ok {
		return s.reply(errNoExecute, cmd.id)
	}
	if !s.negotiated {
		if !equal(cmd.execute, "qmp_capabilities") {
			return s.reply(errNegotiation, cmd.id)
		}
		s.negotiated = true
		return s.reply(returnEmpty, cmd.id)
	}
	switch {
	case equal(cmd.execute, "qmp_capabilities"):
		return s.reply(errNegotiated, cmd.id)
	case equal(cmd.execute, "query-status"):
		return s.reply(returnStatus, cmd.id)
	case equal(cmd.execute, "system_powerdown"), equal(cmd.execute, "quit"):
		r := s.reply(returnEmpty, cmd.id)
		r.exit = true
		return r
	}
	w := writer{}
	w.str(errNotFound)
	w.str(`'`)
	for _, b := range cmd.execute {
		// The name as sent, minus anything that would need escaping.
		if b == '_' || b == '-' || (b >= 'a' && b <= 'z') || (b >= 'A' && b <= 'Z') || (b >= '0' && b <= '9') {
			w.byte(b)
		}
	}
	w.str(`'`)
	w.str(errNotFoundEnd)
	return w.end(cmd.id)
}

// reply is msg (an object left open) with the command's id, if it had one.
func (s *session) reply(msg string, id []byte) result {
	w := writer{}
	w.str(msg)
	return w.end(id)
}

// writer builds a reply in out.
type writer struct{ n int }

func (w *writer) byte(b byte) {
	if w.n < len(out) {
		out[w.n] = b
		w.n++
	}
}

func (w *writer) str(s string) {
	for i := 0; i < len(s); i++ {
		w.byte(s[i])
	}
}

// end closes the reply: `, "id": ID}` and a newline.
func (w *writer) end(id []byte) result {
	if len(id) > 0 {
		w.str(`, "id": `)
		for _, b := range id {
			w.byte(b)
		}
	}
	w.str("}\n")
	return result{n: w.n}
}

// command is what one QMP line asks: the "execute" string's content and
// the "id" member's JSON text, as slices of the line.
type command struct {
	execute, id []byte
}

// parseCommand reads a line as a JSON object and picks its "execute"
// string and "id" value out of its top-level members. ok is false when the
// line is no object or has no "execute" string; id is set whenever found,
// so even that error carries it, as QEMU's does. Not a validator: what it
// cannot read is answered with an error, as QEMU answers what it cannot
// parse.
func parseCommand(line []byte) (cmd command, ok bool) {
	i := skipSpace(line, 0)
	if i >= len(line) || line[i] != '{' {
		return cmd, false
	}
	i++
	for {
		i = skipSpace(line, i)
		if i < len(line) && line[i] == '}' {
			break
		}
		// A member: "key" : value
		kStart := i
		i = skipString(line, i)
		if i < 0 {
			return cmd, false
		}
		key := line[kStart+1 : i-1]
		i = skipSpace(line, i)
		if i >= len(line) || line[i] != ':' {
			return cmd, false
		}
		i = skipSpace(line, i+1)
		vStart := i
		i = skipValue(line, i)
		if i < 0 {
			return cmd, false
		}
		switch {
		case equal(key, "execute"):
			if line[vStart] != '"' {
				return cmd, false
			}
			cmd.execute = line[vStart+1 : i-1]
		case equal(key, "id"):
			cmd.id = line[vStart:i]
		}
		i = skipSpace(line, i)
		if i < len(line) && line[i] == ',' {
			i++
			continue
		}
		if i < len(line) && line[i] == '}' {
			break
		}
		return cmd, false
	}
	return cmd, cmd.execute != nil
}

// skipValue returns the index after the JSON value at i, or -1.
func skipValue(b []byte, i int) int {
	if i >= len(b) {
		return -1
	}
	switch b[i] {
	case '"':
		return skipString(b, i)
	case '{', '[':
		// Nested: count brackets outside strings.
		depth := 0
		for i < len(b) {
			switch b[i] {
			case '"':
				if i = skipString(b, i); i < 0 {
					return -1
				}
				continue
			case '{', '[':
				depth++
			case '}', ']':
				depth--
				if depth == 0 {
					return i + 1
				}
			}
			i++
		}
		return -1
	}
	// A number or a literal: up to the next delimiter.
	start := i
	for i < len(b) && b[i] != ',' && b[i] != '}' && b[i] != ']' && !space(b[i]) {
		i++
	}
	if i == start {
		return -1
	}
	return i
}

// skipString returns the index after the JSON string starting at i, or -1.
func skipString(b []byte, i int) int {
	if i >= len(b) || b[i] != '"' {
		return -1
	}
	for i++; i < len(b); i++ {
		switch b[i] {
		case '\\':
			i++
		case '"':
			return i + 1
		}
	}
	return -1
}

func skipSpace(b []byte, i int) int {
	for i < len(b) && space(b[i]) {
		i++
	}
	return i
}

func space(c byte) bool { return c == ' ' || c == '\t' || c == '\r' || c == '\n' }

func isSpace(b []byte) bool { return skipSpace(b, 0) == len(b) }

// equal compares bytes with a string without converting either.
func equal(b []byte, s string) bool {
	if len(b) != len(s) {
		return false
	}
	for i := range b {
		if b[i] != s[i] {
			return false
		}
	}
	return true
}

// bytesOf is b as a string without a copy (the writes only read it).
func bytesOf(b []byte) string {
	if len(b) == 0 {
		return ""
	}
	return unsafe.String(&b[0], len(b))
}

// argList is the process's argv as the kernel laid it out: n pointers to
// NUL-terminated strings from p.
type argList struct {
	n int
	p unsafe.Pointer
}

// arg is argument i as a slice of its bytes (without the NUL).
func (a argList) arg(i int) []byte {
	s := *(*unsafe.Pointer)(unsafe.Add(a.p, uintptr(i)*unsafe.Sizeof(a.p)))
	n := 0
	for *(*byte)(unsafe.Add(s, n)) != 0 {
		n++
	}
	return unsafe.Slice((*byte)(s), n)
}

func (a argList) has(flag string) bool {
	for i := 1; i < a.n; i++ {
		if equal(a.arg(i), flag) {
			return true
		}
	}
	return false
}

// qmpFD finds the listener's number in QEMU's `-chardev
// socket,id=qmp,fd=N,server=on,wait=off` (vmm's qmpArgs).
func (a argList) qmpFD() (int, bool) {
	for i := 1; i+1 < a.n; i++ {
		if !equal(a.arg(i), "-chardev") {
			continue
		}
		if fd, ok := chardevFD(a.arg(i + 1)); ok {
			return fd, true
		}
	}
	return 0, false
}

// chardevFD reads N of a socket chardev's "fd=N" option.
func chardevFD(opt []byte) (int, bool) {
	const prefix = "socket,"
	if len(opt) < len(prefix) || !equal(opt[:len(prefix)], prefix) {
		return 0, false
	}
	for i := len(prefix) - 1; i < len(opt); i++ {
		if opt[i] != ',' || i+4 > len(opt) || !equal(opt[i+1:i+4], "fd=") {
			continue
		}
		fd, digits := 0, 0
		for j := i + 4; j < len(opt) && opt[j] != ','; j++ {
			if opt[j] < '0' || opt[j] > '9' || digits == 9 {
				return 0, false
			}
			fd = fd*10 + int(opt[j]-'0')
			digits++
		}
		return fd, digits > 0
	}
	return 0, false
}

// sigIgn is SIG_IGN.
const sigIgn = 1

// saRestorer and saRestart: struct sigaction's flags (the kernel's
// x86_64 ABI needs a restorer; the handler never returns to it).
const (
	saRestorer = 0x04000000
	saRestart  = 0x10000000
)

// kernelSigaction is the kernel's struct sigaction on x86_64.
type kernelSigaction struct {
	handler  uintptr
	flags    uint64
	restorer uintptr
	mask     uint64
}

var sigact kernelSigaction

func setSignal(sig, handler uintptr) {
	sigact = kernelSigaction{handler: handler, flags: saRestorer | saRestart, restorer: handler}
	if handler == sigIgn {
		sigact.flags, sigact.restorer = 0, 0
	}
	syscall.RawSyscall6(syscall.SYS_RT_SIGACTION, sig, uintptr(unsafe.Pointer(&sigact)), 0, 8, 0, 0)
}

// writeAll writes s to fd whole; false when fd failed.
func writeAll(fd int, s string) bool {
	for len(s) > 0 {
		n, e := sys(syscall.SYS_WRITE, uintptr(fd), uintptr(unsafe.Pointer(unsafe.StringData(s))), uintptr(len(s)))
		if e == syscall.EINTR {
			continue
		}
		if e != 0 || n == 0 {
			return false
		}
		s = s[n:]
	}
	return true
}

// sys is one raw system call: no runtime to tell.
func sys(trap, a1, a2, a3 uintptr) (uintptr, syscall.Errno) {
	r, _, e := syscall.RawSyscall(trap, a1, a2, a3)
	return r, e
}
