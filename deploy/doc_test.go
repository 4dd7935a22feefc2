// Package deploy_test checks what deploy/ ships: the systemd units' key
// settings, setup-temporal.sh against a real dev server, and every temporal
// command in RUNBOOK.md against a dev server with a delete stuck in
// release-failed. The folder holds no Go package of its own: units, scripts
// and documents, and these tests.
package deploy_test
