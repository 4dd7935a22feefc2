package fleet

// ReadAt is Read as of a given time: a test steps past HandoverGrace
// without waiting it out.
var ReadAt = readAt
