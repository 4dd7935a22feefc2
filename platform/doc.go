// Package platform is what a platform API needs to drive vmflow from its own
// Go module: Dial (the connection both vmflow binaries use, configured like
// the temporal CLI through the SDK's envconfig, retried with backoff),
// ClientOptions, and DataConverter, the converter of every vmflow payload.
// With them, workflows.NewClient starts spawns and deletes, signals and
// queries; nothing under vmflow/internal is needed.
//
// A client that keeps the SDK's default converter (any official SDK, any
// language) works too: the workers decode json/protobuf and snake_case
// json/plain, and answer in snake_case json/plain (README, "A platform API
// in another language").
package platform
