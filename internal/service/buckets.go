package service

// LatencyBuckets are the bounds, in seconds, of every latency vmflow exports,
// the SDK's included: OTel's defaults are for milliseconds. A fresh slice each
// call, so no caller changes another's.
func LatencyBuckets() []float64 {
	return []float64{
		.001, .0025, .005, .01, .025, .05, .1, .25, .5,
		1, 2.5, 5, 10, 30, 60, 120, 300, 600,
	}
}
