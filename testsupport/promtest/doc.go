// Package promtest is the test machinery for vmflow's monitoring files
// (deploy/prometheus/, deploy/grafana/) that deploy's tests and the e2e
// share: the rules file with its durations scaled (ScaleRuleDurations), the
// metric names a PromQL expression selects (MetricNames), a Grafana
// dashboard's queries with its variables substituted (ReadDashboard,
// Substitute), and Debian's Prometheus server run for one test (Start) with
// a client of its HTTP API.
//
// It is for tests only: nothing outside deploy/ and e2e/ imports it.
package promtest
