package proc

// WithBeforePidfd runs fn in Open right before pidfd_open (test only).
func WithBeforePidfd(fn func()) Option { return func(o *options) { o.beforePidfd = fn } }
