package tclient

// CreateCommands exposes the permission hint's commands to the external test
// that runs them against a dev server (testsupport/devserver imports this
// package, so that test cannot live inside it).
var CreateCommands = createCommands
