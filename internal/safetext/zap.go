package safetext

import (
	"go.uber.org/zap/buffer"
	"go.uber.org/zap/zapcore"
)

// JSONEncoder wraps zap's JSON encoder so that every log line is passed
// through EscapeJSON: zap escapes C0 controls but writes C1 and
// bidirectional controls raw, and a log read with journalctl or tail on a
// terminal would act on them.
func JSONEncoder(cfg zapcore.EncoderConfig) zapcore.Encoder {
	return jsonEncoder{zapcore.NewJSONEncoder(cfg)}
}

type jsonEncoder struct{ zapcore.Encoder }

func (e jsonEncoder) Clone() zapcore.Encoder { return jsonEncoder{e.Encoder.Clone()} }

func (e jsonEncoder) EncodeEntry(ent zapcore.Entry, fields []zapcore.Field) (*buffer.Buffer, error) {
	buf, err := e.Encoder.EncodeEntry(ent, fields)
	if err != nil {
		return nil, err
	}
	line := buf.Bytes()
	safe := EscapeJSON(line)
	if len(safe) == len(line) {
		return buf, nil // nothing rewritten (EscapeJSON only grows)
	}
	buf.Reset()
	_, _ = buf.Write(safe) // a buffer.Buffer write never fails
	return buf, nil
}
