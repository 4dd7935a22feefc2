package service

import (
	"fmt"
	"net/http"
	"strings"
	"sync"
)

// Readiness is what /readyz answers: ready when every condition a binary
// named is met. A binary names its conditions before it serves /readyz
// (NotReady), and meets them as it starts (Ready); it can take readiness
// back when it stops.
type Readiness struct {
	mu      sync.Mutex
	order   []string          // conditions in the order they were named
	waiting map[string]string // unmet condition -> why
}

// NewReadiness returns a Readiness without conditions: ready.
func NewReadiness() *Readiness { return &Readiness{waiting: map[string]string{}} }

// NotReady marks cond unmet, with why for /readyz's answer.
func (r *Readiness) NotReady(cond, why string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, ok := r.waiting[cond]; !ok && !r.named(cond) {
		r.order = append(r.order, cond)
	}
	r.waiting[cond] = why
}

// Ready marks cond met.
func (r *Readiness) Ready(cond string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if !r.named(cond) {
		r.order = append(r.order, cond)
	}
	delete(r.waiting, cond)
}

func (r *Readiness) named(cond string) bool {
	for _, c := range r.order {
		if c == cond {
			return true
		}
	}
	return false
}

// Check returns nil when every condition is met, else an error naming each
// unmet one and why.
func (r *Readiness) Check() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	var unmet []string
	for _, c := range r.order {
		if why, ok := r.waiting[c]; ok {
			unmet = append(unmet, c+": "+why)
		}
	}
	if len(unmet) > 0 {
		return fmt.Errorf("not ready: %s", strings.Join(unmet, "; "))
	}
	return nil
}

// ServeHTTP answers /readyz: 200 "ready", or 503 with what is unmet.
func (r *Readiness) ServeHTTP(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	if err := r.Check(); err != nil {
		w.WriteHeader(http.StatusServiceUnavailable)
		fmt.Fprintln(w, err.Error())
		return
	}
	fmt.Fprintln(w, "ready")
}

// Healthz answers 200 while the process serves HTTP: liveness only, since an
// agent waiting for Temporal still supervises and must not be restarted.
func Healthz(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	fmt.Fprintln(w, "ok")
}
