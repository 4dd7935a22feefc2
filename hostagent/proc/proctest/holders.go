package proctest

import "vmflow/hostagent/proc"

// Certain returns the holders that were seen holding the file, dropping the
// processes that could not be inspected: what a test waits on to know its
// own holder has the file open (production code counts an uninspectable
// process as a holder instead).
func Certain(hs []proc.Holder) []proc.Holder {
	var out []proc.Holder
	for _, h := range hs {
		if !h.Uncertain {
			out = append(out, h)
		}
	}
	return out
}
