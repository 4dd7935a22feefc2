package tclient

import (
	"fmt"
	"strings"
	"unicode"

	"go.temporal.io/sdk/log"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"vmflow/internal/safetext"
)

// Log keys vmflow uses everywhere, in its own logs and in the SDK's (the
// adapter renames the SDK's keys to these). One spelling per key, so a log
// search for instance_id finds every line about an instance.
const (
	KeyInstanceID = "instance_id"
	KeyHostID     = "host_id"
	KeyWorkflowID = "workflow_id"
	KeyRunID      = "run_id"
	KeyActivity   = "activity"
	KeyTaskQueue  = "task_queue"
	KeyError      = "error"
	KeyNamespace  = "namespace"
)

// sdkKeys maps the SDK's log keys (internal_logging_tags.go) and common
// spellings from our own code to vmflow's keys. Keys not listed are turned
// into snake_case by snakeCase, so nothing reaches the log in CamelCase.
var sdkKeys = map[string]string{
	"WorkflowID":        KeyWorkflowID,
	"RunID":             KeyRunID,
	"ActivityType":      KeyActivity,
	"LocalActivityType": KeyActivity,
	"TaskQueue":         KeyTaskQueue,
	"Error":             KeyError,
	"err":               KeyError,
	"Namespace":         KeyNamespace,
	"InstanceID":        KeyInstanceID,
	"instanceID":        KeyInstanceID,
	"instanceId":        KeyInstanceID,
	"HostID":            KeyHostID,
	"hostID":            KeyHostID,
	"hostId":            KeyHostID,
}

// ZapLogger implements the SDK's log.Logger over zap, so the SDK's own lines
// (worker start, poller errors, workflow and activity loggers) land in the
// same JSON stream as vmflow's with the same key spellings.
type ZapLogger struct {
	z *zap.Logger
}

var (
	_ log.Logger          = (*ZapLogger)(nil)
	_ log.WithLogger      = (*ZapLogger)(nil)
	_ log.WithSkipCallers = (*ZapLogger)(nil)
)

// NewZapLogger wraps z, skipping the wrapper's frame so zap's caller is the
// code that logged; a nil z logs nothing.
func NewZapLogger(z *zap.Logger) *ZapLogger {
	if z == nil {
		z = zap.NewNop()
	}
	return &ZapLogger{z: z.WithOptions(zap.AddCallerSkip(1))}
}

// Zap returns the underlying logger (with the adapter's caller skip).
func (l *ZapLogger) Zap() *zap.Logger { return l.z }

// Debug logs at debug level.
func (l *ZapLogger) Debug(msg string, keyvals ...any) { l.z.Debug(msg, Fields(keyvals...)...) }

// Info logs at info level.
func (l *ZapLogger) Info(msg string, keyvals ...any) { l.z.Info(msg, Fields(keyvals...)...) }

// Warn logs at warn level.
func (l *ZapLogger) Warn(msg string, keyvals ...any) { l.z.Warn(msg, Fields(keyvals...)...) }

// Error logs at error level.
func (l *ZapLogger) Error(msg string, keyvals ...any) { l.z.Error(msg, Fields(keyvals...)...) }

// With returns a logger that adds keyvals to every line.
func (l *ZapLogger) With(keyvals ...any) log.Logger {
	return &ZapLogger{z: l.z.With(Fields(keyvals...)...)}
}

// WithCallerSkip returns a logger that skips skip more frames when finding
// the caller (the SDK uses it for its replay-aware wrappers).
func (l *ZapLogger) WithCallerSkip(skip int) log.Logger {
	return &ZapLogger{z: l.z.WithOptions(zap.AddCallerSkip(skip))}
}

// Fields turns the SDK's key/value list into zap fields with vmflow's key
// spellings; a malformed list never loses information or panics.
func Fields(keyvals ...any) []zap.Field {
	fields := make([]zap.Field, 0, (len(keyvals)+1)/2)
	for i := 0; i < len(keyvals); i += 2 {
		var key string
		switch k := keyvals[i].(type) {
		case string:
			key = k
		default:
			key = fmt.Sprint(k)
		}
		if i+1 >= len(keyvals) {
			fields = append(fields, zap.String("missing_value", key))
			break
		}
		key = LogKey(key)
		val := keyvals[i+1]
		if err, ok := val.(error); ok {
			fields = append(fields, zap.NamedError(key, err))
			continue
		}
		fields = append(fields, zap.Any(key, val))
	}
	return fields
}

// LogKey returns vmflow's spelling of a log key: the mapped name for the
// SDK's known keys, snake_case for anything else.
func LogKey(key string) string {
	if k, ok := sdkKeys[key]; ok {
		return k
	}
	return snakeCase(key)
}

// snakeCase turns CamelCase, acronyms included ("HTTPServer"), into
// snake_case; snake_case comes back unchanged.
func snakeCase(s string) string {
	rs := []rune(s)
	var b strings.Builder
	b.Grow(len(s) + 4)
	for i, r := range rs {
		if unicode.IsUpper(r) {
			if i > 0 {
				prev := rs[i-1]
				nextLower := i+1 < len(rs) && unicode.IsLower(rs[i+1])
				if prev != '_' && (unicode.IsLower(prev) || unicode.IsDigit(prev) || (unicode.IsUpper(prev) && nextLower)) {
					b.WriteByte('_')
				}
			}
			b.WriteRune(unicode.ToLower(r))
			continue
		}
		b.WriteRune(r)
	}
	return b.String()
}

// NewLogger is the zap JSON logger both binaries write with: ISO 8601
// times under "ts", the level given by --log-level, on stderr.
func NewLogger(level string) (*zap.Logger, error) {
	return newLogger(level, "stderr")
}

// newLogger is NewLogger writing to the given zap output paths (tests pass
// a file).
func newLogger(level string, outputs ...string) (*zap.Logger, error) {
	lvl, err := zapcore.ParseLevel(level)
	if err != nil {
		return nil, fmt.Errorf("--log-level: %w", err)
	}
	ec := zap.NewProductionEncoderConfig()
	ec.TimeKey = "ts"
	ec.EncodeTime = zapcore.ISO8601TimeEncoder
	sink, _, err := zap.Open(outputs...)
	if err != nil {
		return nil, fmt.Errorf("open log output: %w", err)
	}
	errSink, _, err := zap.Open("stderr")
	if err != nil {
		return nil, fmt.Errorf("open log error output: %w", err)
	}
	// zap's JSON encoder with C1 and bidirectional controls escaped too:
	// the agent logs workflow ids, QEMU's stderr and guest bytes, and its
	// log is read on terminals. No sampling (zap's production config keeps
	// 100 identical lines a second and then every 100th): the lines that
	// repeat are exactly an incident's ("release failed" for every instance
	// of a wedged GPU), and vmflow's volume is bounded by its work.
	core := zapcore.NewCore(safetext.JSONEncoder(ec), sink, zap.NewAtomicLevelAt(lvl))
	return zap.New(core, zap.ErrorOutput(errSink), zap.AddCaller(), zap.AddStacktrace(zapcore.ErrorLevel)), nil
}
