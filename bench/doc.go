// Package bench measures vmflow against the methods it replaces, side by
// side in one run, and writes BENCHMARKS.md at the repository root.
//
// The driver is TestBenchmarks in this package, gated by VMFLOW_BENCH=1 so
// `make test` never runs it (it takes minutes and starts hundreds of QEMUs):
//
//	make bench
//	# or: VMFLOW_BENCH=1 go test -run '^TestBenchmarks$' -v -count=1 -timeout 15m ./bench
//
// Absolute times on a shared 2-core machine drift with load, so every figure
// the report prints is a ratio or a pair measured in the same run. The
// non-test files hold what the driver needs that is worth testing on its
// own: percentiles, the markdown table, a deliberately minimal QMP client
// (the "raw QEMU action" baseline must not go through vmflow's own QMP
// code), and the machine description.
package bench
