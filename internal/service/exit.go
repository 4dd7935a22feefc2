package service

// Exit codes of every vmflow command: its subcommands and both daemons.
const (
	ExitOK    = 0
	ExitError = 1
	ExitUsage = 2 // bad flags or a configuration refused before anything ran
)
