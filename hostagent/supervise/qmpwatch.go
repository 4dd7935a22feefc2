package supervise

import (
	"context"
	"fmt"

	"go.uber.org/zap"

	"vmflow/hostagent/store"
	"vmflow/hostagent/vmm"
)

// watchQMP marks vm's instance needing attention when a QMP connection broke
// the protocol: a QEMU sending what QEMU never sends may be in a guest's hands.
func (s *Supervisor) watchQMP(in *instance, vm *vmm.VM) {
	select {
	case err := <-vm.QMPViolation():
		s.markQMPViolation(in, vm, err)
	case <-vm.Closed():
	case <-s.ctx.Done():
	}
}

func (s *Supervisor) markQMPViolation(in *instance, vm *vmm.VM, cause error) {
	log := in.log.With(zap.Int("pid", vm.Identity().PID))
	log.Error("qmp protocol violation: connection dropped; the VM needs attention", zap.Error(cause))
	if err := in.acquire(s.ctx); err != nil {
		return // closing
	}
	defer in.release()
	if !in.isCurrent(vm) {
		return // stopped or replaced meanwhile: nothing of this QEMU is left to look at
	}
	ctx, cancel := context.WithTimeout(s.ctx, s.cfg.LockTimeout)
	defer cancel()
	l, err := s.st.Lock(ctx, in.id)
	if err != nil {
		log.Error("qmp protocol violation: cannot lock the instance to record it", zap.Error(err))
		return
	}
	defer unlock(l, log)
	reason := fmt.Sprintf("QMP protocol violation by QEMU %v, connection dropped (a guest may control it): %s", vm.Identity(), cause.Error())
	if _, err := l.Apply(store.NeedsAttention(reason, s.cfg.Now(), false)); err != nil {
		log.Error("qmp protocol violation: cannot record it", zap.Error(err))
	}
}
