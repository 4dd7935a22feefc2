// Package testsupport is the root of the tree of test machinery that drives
// the real parts: testsupport/devserver (a real Temporal server),
// testsupport/stacktest (the real binaries as daemons),
// testsupport/powercut (a file system that loses unsynced writes) and
// testsupport/promtest (a real Prometheus server, and the rules and
// dashboard it is given) and testsupport/otlptest (a trace collector
// keeping the spans it is sent).
//
// The module reads top to bottom, and no arrow points back up (the layers
// and their test are in internal/contract):
//
//	e2e, bench, deploy      the test drivers
//	testsupport/...         this tree: imports anything below it
//	package main            the binaries: main.go only
//	daemon/...              the daemons: the only host-side Temporal wiring
//	activities/             adapters from Temporal to hostagent/...
//	workflows/, platform/   workflow code and the client side
//	hostagent/..., guest/   host packages: never Temporal
//	internal/..., proto/    what everything above shares
//
// Only tests (_test files), other test support and the test drivers import
// this tree or an xxxtest fixture package (proctest, vmmtest, tclienttest):
// no binary and no library links test machinery.
package testsupport
