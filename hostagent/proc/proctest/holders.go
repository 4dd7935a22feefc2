package proctest

import "vmflow/hostagent/proc"

// Certain drops uninspectable processes from hs, so a test can wait for its own
// holder (production counts them as holders).
func Certain(hs []proc.Holder) []proc.Holder {
	var out []proc.Holder
	for _, h := range hs {
		if !h.Uncertain {
			out = append(out, h)
		}
	}
	return out
}
