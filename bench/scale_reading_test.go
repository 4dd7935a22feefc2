package bench

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
)

// TestScaleReadingTakesOffTheBackground: with make bench-scale's figures
// of 2026-12-06 (1,000 VMs spawned in 87.6 s, 5,000 in 852.5 s, 100 per
// agent both times), the agents' spawn CPU per VM grew 1.98×, and less
// their idle CPU over each phase it fell (0.82×): the reading says the
// growth is the longer phase's, not the launches'. A launch whose own
// cost grew would still be called so.
func TestScaleReadingTakesOffTheBackground(t *testing.T) {
	round := func(n, hosts int, spawnSec, agentSpawnSec, idleAgentShare float64) *scaleRound {
		return &scaleRound{size: scaleSize{n, hosts},
			spawn: scalePhase{wall: time.Duration(spawnSec * float64(time.Second)), cpu: cpuSplit{agent: agentSpawnSec, server: 1},
				machine: machineCPU{busy: 1, total: 1}},
			idle: scalePhase{wall: 2 * time.Minute, cpu: cpuSplit{agent: idleAgentShare * 120}}}
	}
	got := scaleReading([]*scaleRound{round(1000, 10, 87.6, 17.2, 0.025), round(5000, 50, 852.5, 170.5, 0.128)})
	assert.Contains(t, got, "grew 1.98×")
	assert.Contains(t, got, "15.0 and 12.3 ms per VM: 0.82×")
	assert.Contains(t, got, "the longer phase's background")

	got = scaleReading([]*scaleRound{round(1000, 10, 87.6, 17.2, 0.025), round(5000, 50, 100, 170.5, 0.025)})
	assert.Contains(t, got, "grows with the machine's processes")
}
