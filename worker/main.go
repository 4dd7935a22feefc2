// Command vmflow-worker runs vmflow's workflows (package daemon/worker).
package main

import (
	"os"

	"vmflow/daemon/worker"
)

func main() { os.Exit(worker.Main(os.Args[1:])) }
