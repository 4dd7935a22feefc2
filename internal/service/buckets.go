package service

// LatencyBuckets are the histogram bucket bounds, in seconds, of every
// latency vmflow exports, its own and the Temporal SDK's: 1 ms to 10 min in
// 1-2.5-5 steps up to 10 s, then the minutes a stop ladder or a
// schedule-to-start on a loaded queue takes. OTel's default bounds (0, 5,
// 10, ... 10000) are meant for milliseconds: on the SDK's seconds they put a
// 120 ms and a 3 s schedule-to-start in the same bucket. A fresh slice on
// every call, so no caller can change another's bounds.
func LatencyBuckets() []float64 {
	return []float64{
		.001, .0025, .005, .01, .025, .05, .1, .25, .5,
		1, 2.5, 5, 10, 30, 60, 120, 300, 600,
	}
}
