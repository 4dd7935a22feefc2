package safetext

import (
	"go.uber.org/zap/buffer"
	"go.uber.org/zap/zapcore"
)

// JSONEncoder is zap's JSON encoder through EscapeJSON: zap writes C1 and bidi
// controls raw, which a terminal running journalctl would act on.
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
