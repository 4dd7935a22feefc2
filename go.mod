module vmflow

go 1.26.0

require (
	github.com/digitalocean/go-qemu v0.0.0-20250212194115-ee9b0668d242 // indirect
	github.com/google/uuid v1.6.0 // indirect
	github.com/hanwen/go-fuse/v2 v2.12.1 // indirect
	github.com/prometheus/client_golang v1.25.0 // indirect
	github.com/stretchr/testify v1.12.1 // indirect
	go.temporal.io/sdk v1.51.0 // indirect
	go.uber.org/multierr v1.10.0 // indirect
	go.uber.org/zap v1.28.0 // indirect
	go.yaml.in/yaml/v3 v3.0.5 // indirect
	golang.org/x/sys v0.50.0 // indirect
	google.golang.org/protobuf v1.36.12 // indirect
)
