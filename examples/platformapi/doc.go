// Package platformapi is a platform API's view of vmflow from outside its
// module: this is its own Go module (example.com/platformapi, with a replace
// to the vmflow checkout), so the compiler refuses any import under
// vmflow/internal. Its test drives vmflow's real workflows on a real dev
// server the way a platform API would: a client on the SDK's default data
// converter (what any official SDK uses unless told otherwise) spawns,
// queries status, signals retry and deletes; vmflow/platform.Dial and the
// typed workflows.Client are used beside it.
//
// `go test ./...` in the vmflow module skips nested modules; `make test`
// and `make lint` run this one explicitly.
package platformapi
