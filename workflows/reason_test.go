package workflows

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/mock"
	"github.com/stretchr/testify/require"

	vmflowv1 "vmflow/proto/vmflow/v1"
)

// TestUpdateReasonsAreBounded: a retry or abandon whose reason is longer
// than MaxReasonBytes is refused by the validator (nothing recorded), even
// where the same update with a short reason is accepted. Fails before the
// bound: the 1 MiB abandon was accepted and became the delete's result.
func TestUpdateReasonsAreBounded(t *testing.T) {
	e := newEnv(t)
	e.OnActivity(h.BeginDelete, mock.Anything, mock.Anything).Return(&vmflowv1.BeginDeleteResult{HasClaim: true}, nil)
	e.OnActivity(h.StopVM, mock.Anything, mock.Anything).Return(nil, scheduleToStart())
	e.counted("ReleaseLeases")
	huge := strings.Repeat("r", 1<<20)
	var hugeAbandon, hugeRetry, abandon *updateOutcome
	e.RegisterDelayedCallback(func() {
		hugeRetry = e.update(RetryUpdate, &vmflowv1.RetrySignal{Reason: huge})
		hugeAbandon = e.update(AbandonUpdate, &vmflowv1.AbandonSignal{Reason: huge})
		abandon = e.update(AbandonUpdate, &vmflowv1.AbandonSignal{Reason: strings.Repeat("d", MaxReasonBytes)})
	}, 10*time.Minute)
	e.ExecuteWorkflow(DeleteWorkflow, deleteReq())
	require.NoError(t, e.GetWorkflowError())
	refusal(t, hugeRetry, "retry refused: the reason is 1048576 bytes, longer than 1024")
	refusal(t, hugeAbandon, "abandon refused: the reason is 1048576 bytes, longer than 1024")
	require.NotNil(t, abandon)
	require.True(t, abandon.accepted, "a reason of MaxReasonBytes is accepted")
	var res vmflowv1.DeleteResult
	require.NoError(t, e.GetWorkflowResult(&res))
	assert.Len(t, res.GetAbandonReason(), MaxReasonBytes)
}
