// Package metrics defines the host agent's Prometheus metrics: what an
// operator graphs and alerts on (instances by state, how long stops take,
// how fast exits are seen, vGPU claims and release failures, re-attaches).
//
// Gauges that describe the host (instances, claims) are read from the store
// at scrape time, so they can never drift from the records.
package metrics

import (
	"github.com/prometheus/client_golang/prometheus"

	"vmflow/hostagent/store"
	"vmflow/internal/service"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// Agent holds the agent's own metrics. Every histogram resolves 1 ms to
// 10 min (service.LatencyBuckets), the same bounds as the SDK's latencies.
type Agent struct {
	StopDuration    prometheus.Histogram
	ExitDetect      prometheus.Histogram
	LaunchDuration  prometheus.Histogram
	ReleaseFailures *prometheus.CounterVec
	Reattach        prometheus.Counter
	// ClaimsUnserved counts held vGPU claims this agent has no driver for
	// (--vgpu-driver=none on a host whose records hold claims): their
	// deletes park needing attention until the agent runs with a driver.
	ClaimsUnserved prometheus.Gauge
	// RestartsRefused counts restarts the host's admission policy refused
	// (the recorded spec is outside the policy the agent runs with): each
	// leaves its instance needing attention.
	RestartsRefused prometheus.Counter
}

// New registers the agent's metrics with reg. st, when not nil, backs the
// vmflow_instances and vmflow_vgpu_claims gauges.
func New(reg prometheus.Registerer, st *store.Store) (*Agent, error) {
	a := &Agent{
		StopDuration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "vmflow_stop_duration_seconds",
			Help:    "Time from the start of the stop ladder until the VM's whole thread group was gone.",
			Buckets: service.LatencyBuckets(),
		}),
		ExitDetect: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "vmflow_exit_detect_seconds",
			Help: "Time from a VM's exit (QEMU reaped, or the pidfd readable) until the agent recorded it.",
			// Below 1 ms too: a pidfd wake-up is seen in tens of µs.
			Buckets: append([]float64{.0001, .0005}, service.LatencyBuckets()...),
		}),
		LaunchDuration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "vmflow_launch_duration_seconds",
			Help:    "Time from fork until QMP reported the VM running.",
			Buckets: service.LatencyBuckets(),
		}),
		ReleaseFailures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "vmflow_vgpu_release_failures_total",
			Help: "vGPU releases that failed, by errno (or reason when no errno applies).",
		}, []string{"errno"}),
		Reattach: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "vmflow_reattach_total",
			Help: "VMs re-attached after an agent restart.",
		}),
		ClaimsUnserved: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "vmflow_vgpu_claims_unserved",
			Help: "Held vGPU claims this agent cannot release because it runs without a vGPU driver.",
		}),
		RestartsRefused: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "vmflow_restarts_refused_total",
			Help: "Restarts refused because the host's admission policy no longer admits the instance's recorded spec.",
		}),
	}
	// The errnos a sysfs release is known to fail with (FACTS: mdev remove
	// EAGAIN/ENODEV, old kernels EBUSY; EIO from a wedged driver) exist at 0
	// from the start: the series is there before the first failure, so
	// increase()/rate() alerts fire on the first one instead of never
	// seeing a counter start.
	for _, errno := range []string{"EAGAIN", "EBUSY", "EIO", "ENODEV"} {
		a.ReleaseFailures.WithLabelValues(errno)
	}
	cs := []prometheus.Collector{a.StopDuration, a.ExitDetect, a.LaunchDuration, a.ReleaseFailures, a.Reattach, a.ClaimsUnserved, a.RestartsRefused}
	if st != nil {
		cs = append(cs, &storeCollector{st: st})
	}
	for _, c := range cs {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return a, nil
}

var (
	instancesDesc = prometheus.NewDesc("vmflow_instances", "Instance records on this host, by state.", []string{"state"}, nil)
	claimsDesc    = prometheus.NewDesc("vmflow_vgpu_claims", "vGPU claims held by instance records on this host.", nil, nil)
	unreadable    = prometheus.NewDesc("vmflow_records_unreadable", "Instance records that could not be read.", nil, nil)
)

// storeCollector reads the store at each scrape.
type storeCollector struct{ st *store.Store }

func (c *storeCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- instancesDesc
	ch <- claimsDesc
	ch <- unreadable
}

func (c *storeCollector) Collect(ch chan<- prometheus.Metric) {
	recs, err := c.st.List()
	byState := map[string]float64{}
	for _, s := range vmflowv1.InstanceState_value {
		if st := vmflowv1.InstanceState(s); st != vmflowv1.InstanceState_INSTANCE_STATE_UNSPECIFIED {
			byState[store.StateName(st)] = 0
		}
	}
	claims := 0.0
	for _, r := range recs {
		byState[store.StateName(r.GetState())]++
		if store.ClaimHeld(r) {
			claims++
		}
	}
	for state, n := range byState {
		ch <- prometheus.MustNewConstMetric(instancesDesc, prometheus.GaugeValue, n, state)
	}
	ch <- prometheus.MustNewConstMetric(claimsDesc, prometheus.GaugeValue, claims)
	bad, _ := store.Unreadable(err)
	ch <- prometheus.MustNewConstMetric(unreadable, prometheus.GaugeValue, float64(len(bad)))
}
