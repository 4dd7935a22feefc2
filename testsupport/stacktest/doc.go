// Package stacktest is the harness that vmflow's end-to-end tests (e2e/)
// and benchmarks (bench/) share for running the real binaries: it builds
// vmflow-worker and vmflow-hostagent from this checkout, runs them as
// restartable subprocesses with their output in a log file (Daemon), and
// makes the test process a child subreaper that reaps the QEMUs a killed
// host agent leaves behind, as systemd does in production.
//
// It is for tests only: nothing outside e2e/ and bench/ imports it.
package stacktest
