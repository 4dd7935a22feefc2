package service

import (
	"fmt"
	"runtime"
	"runtime/debug"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
)

// Set at link time by `make build`:
//
//	-ldflags "-X vmflow/internal/service.version=v1.2.3 -X vmflow/internal/service.revision=<git sha>"
//
// Empty in a plain `go build`; Info then falls back to what the Go
// toolchain recorded (module version, VCS revision when built with VCS
// stamping).
var (
	version  string
	revision string
)

// Build says what a binary is.
type Build struct {
	Version   string // "v1.2.3", "v1.2.3-4-gabcdef0-dirty", or "dev"
	Revision  string // the full VCS commit, or "unknown"
	GoVersion string // runtime.Version()
}

// Info is this binary's build: the link-time stamp first, then the Go
// toolchain's build info, then "dev" and "unknown".
func Info() Build {
	b := Build{Version: version, Revision: revision, GoVersion: runtime.Version()}
	if bi, ok := debug.ReadBuildInfo(); ok {
		if b.Version == "" && bi.Main.Version != "" && bi.Main.Version != "(devel)" {
			b.Version = bi.Main.Version
		}
		if b.Revision == "" {
			modified := false
			for _, s := range bi.Settings {
				switch s.Key {
				case "vcs.revision":
					b.Revision = s.Value
				case "vcs.modified":
					modified = s.Value == "true"
				}
			}
			if b.Revision != "" && modified {
				b.Revision += "-dirty"
			}
		}
	}
	if b.Version == "" {
		b.Version = "dev"
	}
	if b.Revision == "" {
		b.Revision = "unknown"
	}
	return b
}

// String is the --version line of the binary called name.
func (b Build) String(name string) string {
	return fmt.Sprintf("%s %s (revision %s, %s)", name, b.Version, b.Revision, b.GoVersion)
}

// Fields are the build's log fields, for the line a binary logs at start.
func (b Build) Fields() []zap.Field {
	return []zap.Field{zap.String("version", b.Version), zap.String("revision", b.Revision), zap.String("go_version", b.GoVersion)}
}

// BuildInfoCollector is vmflow_build_info: 1, with the build in its labels, to
// show and join which build each host and worker runs.
func (b Build) BuildInfoCollector() prometheus.Collector {
	g := prometheus.NewGauge(prometheus.GaugeOpts{
		Name:        "vmflow_build_info",
		Help:        "The running vmflow build: version, VCS revision and Go version in the labels; the value is always 1.",
		ConstLabels: prometheus.Labels{"version": b.Version, "revision": b.Revision, "go_version": b.GoVersion},
	})
	g.Set(1)
	return g
}
